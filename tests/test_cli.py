"""`jha generate`: the embedded default, a saved transformers checkpoint, --json, and clear errors."""

import json

import pytest

from jax_hybrid_attn.cli import main


def run(capsys, *args) -> tuple[int, str, str]:
    code = main(["generate", "--no-progress", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_the_embedded_model_prints_one_json_object_with_outputs_and_metrics(capsys):
    code, out, _ = run(capsys, "--json", "--max-tokens", "5", "--prompt", "Hello", "--prompt-token-ids", "[[1, 2, 3]]",
                       "--max-num-batched-tokens", "8")  # fmt: skip
    assert code == 0
    payload = json.loads(out)  # nothing else on stdout
    assert [len(o["output_token_ids"]) for o in payload["outputs"]] == [5, 5]
    assert payload["outputs"][1]["prompt_token_ids"] == [1, 2, 3]
    assert payload["outputs"][0]["prompt_token_ids"] == [257, *b"Hello"]  # the byte tokenizer's BOS, then bytes
    metrics = payload["metrics"]
    assert metrics["requests"] == 2 and metrics["kv_cache"]["hybrid"] is True
    assert {"ttft_s", "itl_s", "prefill_tokens_per_s", "decode_tokens_per_s", "prefix_cache_hit_rate"} <= set(metrics)


def test_the_report_and_no_hybrid(capsys, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\nsecond prompt\n")
    code, out, _ = run(capsys, "--prompt-file", str(prompts), "--max-tokens", "3", "--no-hybrid", "--num-blocks", "64",
                       "--max-model-len", "64")  # fmt: skip
    assert code == 0
    assert "requests 2 (0 refused)" in out and "every layer as full attention" in out and "TTFT" in out


def test_a_saved_transformers_checkpoint_runs(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.MistralConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8)  # fmt: skip
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path)
    code, out, _ = run(capsys, "--model", str(tmp_path), "--json", "--max-tokens", "4", "--prompt", "abc",
                       "--ignore-eos")  # fmt: skip
    assert code == 0 and len(json.loads(out)["outputs"][0]["output_token_ids"]) == 4


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent/model"], "/nonexistent/model"),
        (["--temperature", "-1"], "temperature"),
        (["--top-p", "0"], "top_p"),
        (["--max-num-batched-tokens", "0"], "max_num_batched_tokens"),
        (["--max-model-len", "8", "--prompt", "a prompt longer than eight bytes"], "max_model_len"),
        (["--tensor-parallel", "64"], "tensor_parallel=64"),
    ],
)
def test_bad_input_is_a_clear_error(capsys, args, message):
    code, out, err = run(capsys, "--max-tokens", "2", *args)
    if code == 0:  # a refused prompt: the others run, the refusal is reported
        assert "refused" in err and message in err
    else:
        assert code == 2 and message in err and out == ""


def test_malformed_token_ids_are_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--prompt-token-ids", "[[1, 'a']]"])
    assert "--prompt-token-ids" in capsys.readouterr().err


def test_memory_sizes_parse_with_units():
    from jax_hybrid_attn.cli import memory_size

    assert [memory_size(t) for t in ("2GiB", "512MB", "1e9", "4096")] == [2 * 2**30, 512 * 10**6, 10**9, 4096]
    with pytest.raises(Exception, match="kv-memory"):
        memory_size("lots")
