"""`jha generate`: the embedded default, saved transformers checkpoints (greedy tokens equal to transformers'),
--json, what is served, and clear errors."""

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
                       "--max-model-len", "64", "--max-num-seqs", "2", "--max-num-batched-tokens", "16")  # fmt: skip
    assert code == 0
    assert "requests 2 (0 refused)" in out and "every layer as full attention" in out and "TTFT" in out
    assert "model gemma3_text, 6 layers: full 1: 5; sliding (window 32) 5: 0-4; random weights" in out


def test_the_kv_cache_dtype_flag_takes_vllms_names():
    from jax_hybrid_attn.cli import build_parser
    from jax_hybrid_attn.engine_options import make_engine_config

    for flag, name in (("auto", None), ("fp8", "float8_e4m3fn"), ("fp8_e4m3", "float8_e4m3fn")):
        dtype = make_engine_config(build_parser().parse_args(["generate", "--kv-cache-dtype", flag])).kv_cache_dtype
        assert (dtype and dtype.name) == name


def test_the_cublas_matmuls_flag_reaches_the_engine_config():
    from jax_hybrid_attn.cli import build_parser
    from jax_hybrid_attn.engine import EngineConfig
    from jax_hybrid_attn.engine_options import make_engine_config

    for flags, on in (([], True), (["--no-cublas-matmuls"], False), (["--cublas-matmuls"], True)):
        assert make_engine_config(build_parser().parse_args(["generate", *flags])).cublas_matmuls is on
    with pytest.raises(ValueError, match="cublas_matmuls"):
        EngineConfig(cublas_matmuls="yes")


def test_a_saved_transformers_checkpoint_runs(capsys, tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.MistralConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8)  # fmt: skip
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    transformers.MistralForCausalLM(config).save_pretrained(tmp_path)
    code, out, err = run(capsys, "--model", str(tmp_path), "--json", "--max-tokens", "4", "--prompt", "abc",
                         "--ignore-eos", "--warmup")  # fmt: skip
    payload = json.loads(out)
    assert code == 0 and len(payload["outputs"][0]["output_token_ids"]) == 4
    # no tokenizer file at all: bytes, said on stderr and in the report
    assert "tokenizer: UTF-8 bytes (the checkpoint ships no tokenizer file)" in err
    assert payload["metrics"]["tokenizer"] == "UTF-8 bytes (the checkpoint ships no tokenizer file)"
    # what was compiled before the warm-up run is still counted after it
    assert payload["metrics"]["compiled_executables"] > 0 and payload["metrics"]["compile_s"] > 0


@pytest.fixture(scope="module")
def mistral_checkpoint(tmp_path_factory):
    """A tiny Mistral checkpoint written by transformers (no tokenizer files)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    config = transformers.MistralConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8)  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("mistral")
    transformers.MistralForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:4096]),
         "model.safetensors' is not a readable safetensors file: Error while deserializing header"),
        (lambda d: (d / "model.safetensors").write_bytes(b""), "is not a readable safetensors file"),
        (lambda d: (d / "config.json").write_text("{'model_type': 'mistral'"), "config.json' is not valid JSON"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("command", ["generate", "compare"])
def test_a_damaged_checkpoint_is_named_in_one_line(capsys, tmp_path, mistral_checkpoint, command, damage, message):
    import shutil

    shutil.copytree(mistral_checkpoint, tmp_path, dirs_exist_ok=True)
    damage(tmp_path)
    assert main([command, "--model", str(tmp_path), *(["--no-progress"] if command == "generate" else [])]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.strip().splitlines()[-1].startswith(f"jha {command}: ")


def test_compare_on_a_torch_device_that_is_not_there_is_refused_before_loading(capsys, mistral_checkpoint,
                                                                               monkeypatch):  # fmt: skip
    torch = pytest.importorskip("torch")
    from jax_hybrid_attn.models import compare

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    monkeypatch.setattr(compare, "load_model", lambda *args, **kwargs: pytest.fail("the weights were loaded"))
    assert main(["compare", "--model", str(mistral_checkpoint), "--torch-device", "cuda"]) == 2
    assert "torch_device='cuda': torch has no cuda device here" in capsys.readouterr().err


@pytest.fixture
def no_weights(monkeypatch):
    """Fail a test that reads any weight (the embedded model's random ones too)."""
    import jax_hybrid_attn.engine_options as engine_options

    monkeypatch.setattr(engine_options, "load", lambda *args, **kwargs: pytest.fail("the weights were loaded"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "/nonexistent/model"], "/nonexistent/model"),
        (["--temperature", "-1"], "--temperature: temperature=-1.0"),
        (["--top-p", "0"], "--top-p: top_p=0.0"),
        (["--max-tokens", "-1"], "--max-tokens: max_tokens=-1"),
        (["--top-k", "-2"], "--top-k: top_k=-2"),
        (["--max-num-batched-tokens", "0"], "max_num_batched_tokens"),
        (["--max-model-len", "8", "--prompt", "a prompt longer than eight bytes"], "every prompt would be refused"),
        (["--tensor-parallel", "64"], "tensor_parallel=64"),
        (["--kv-memory", "1KiB"], "only 0 are available"),
        (["--max-model-len", "100000"], "max_model_len=100000 exceeds the model's max_position_embeddings=4096"),
        (["--max-model-len", "16", "--prompt", "0123456789", "--max-tokens", "8"],
         "--max-tokens=8: prompt [0] has 11 tokens and the model's length is max_model_len=16: give at most "
         "--max-tokens 5"),
        (["--prompt-token-ids", "[]"], "--prompt-token-ids='[]' holds no prompt"),
        (["--prompt-token-ids", "[[1, 999]]"], "999"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2_before_any_weight_is_read(capsys, no_weights, args, message):
    code, out, err = run(capsys, "--max-tokens", "2", *args)
    assert code == 2 and out == "" and message in err, err
    assert err.strip().splitlines()[-1].startswith("jha generate: error: ") and "Traceback" not in err


def test_prompt_files_that_hold_no_prompt_or_cannot_be_read(capsys, no_weights, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    code, out, err = run(capsys, "--prompt-file", str(empty))
    assert code == 2 and f"--prompt-file={str(empty)!r} holds no prompt" in err
    code, out, err = run(capsys, "--prompt-file", str(tmp_path / "missing.txt"))
    assert code == 2 and "cannot be read" in err and "missing.txt" in err


def test_options_are_spelled_out_and_the_version_is_printed(capsys):
    from jax_hybrid_attn.cli import package_version

    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--max-token", "5"])  # an abbreviation of --max-tokens
    assert exit_.value.code == 2 and "unrecognized arguments: --max-token" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"jha {package_version()}"
    assert package_version()[0].isdigit()


def test_a_missing_extra_is_named_with_its_install_command(capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    missing = {"fastapi", "torch"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else find_spec(name, *a))
    assert main(["serve", "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "jha serve: error: jha serve needs the serve extra (fastapi not installed): pip install " in err
    assert "'jax-hybrid-attn[serve]'" in err
    assert main(["compare", "--model", "."]) == 2
    assert "needs the torch extra (torch not installed)" in capsys.readouterr().err


def test_a_port_in_use_fails_before_the_model_loads(capsys, monkeypatch):
    import socket

    from jax_hybrid_attn.cli import EXIT_SERVER_NOT_STARTED
    from jax_hybrid_attn.serve import server

    monkeypatch.setattr(server, "build_server", lambda *args, **kwargs: pytest.fail("the model was loaded"))
    monkeypatch.setattr(server, "server_options", lambda args: None)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == EXIT_SERVER_NOT_STARTED
    assert f"jha serve: error: cannot listen on 127.0.0.1:{port}: " in capsys.readouterr().err


def test_a_failure_of_the_package_itself_is_exit_70_with_its_traceback(capsys, monkeypatch):
    from jax_hybrid_attn import cli

    monkeypatch.setitem(cli.COMMANDS, "generate", lambda args: {}["a bug"])
    assert main(["generate"]) == cli.EXIT_INTERNAL_ERROR
    err = capsys.readouterr().err
    assert "Traceback" in err and "KeyError: 'a bug'" in err and "internal error" in err


def test_malformed_token_ids_are_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--prompt-token-ids", "[[1, 'a']]"])
    assert "--prompt-token-ids" in capsys.readouterr().err


def test_memory_sizes_parse_with_units():
    from jax_hybrid_attn.engine_options import memory_size

    assert [memory_size(t) for t in ("2GiB", "512MB", "1e9", "4096")] == [2 * 2**30, 512 * 10**6, 10**9, 4096]
    with pytest.raises(Exception, match="kv-memory"):
        memory_size("lots")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """``saved(family)``: (the tiny transformers model of `family`, its save_pretrained directory), made once."""
    from tests.hf_families import hf_model

    made = {}

    def get(family):
        if family not in made:
            model = hf_model(family)
            path = tmp_path_factory.mktemp(family)
            model.save_pretrained(path)
            made[family] = model, path
        return made[family]

    return get


@pytest.mark.parametrize("family", ["gemma3", "llama4", "qwen3", "qwen3_moe"])
def test_a_checkpoint_serves_transformers_greedy_tokens_and_says_what_it_serves(capsys, saved, family):
    """A 20-token prompt prefilled in chunks of 8 across the windows and chunks: transformers' greedy tokens. A
    wrapper's image prompt alone is refused. The model line and metrics.model name what was served."""
    from jax_hybrid_attn.models import describe_model, model_line, plan_checkpoint
    from tests.hf_families import IMAGE_TOKEN, hf_greedy, prompt

    hf, path = saved(family)
    text = prompt(3, length=20).tolist()
    wrapper = family in ("gemma3", "llama4")
    prompts = [text, text[:5] + [IMAGE_TOKEN] + text[5:9]] if wrapper else [text]
    code, out, err = run(capsys, "--model", str(path), "--json", "--max-tokens", "6", "--ignore-eos",
                         "--prompt-token-ids", json.dumps(prompts), "--max-model-len", "32", "--max-num-seqs", "2",
                         "--max-num-batched-tokens", "8", "--block-size", "4")  # fmt: skip
    assert code == 0, err
    payload = json.loads(out)
    assert payload["outputs"][0]["output_token_ids"] == hf_greedy(hf, text, 6)
    if wrapper:
        assert f"image token {IMAGE_TOKEN}" in payload["outputs"][1]["error"]
    plan = plan_checkpoint(path)
    served = payload["metrics"]["model"]
    assert served == describe_model(plan.config, plan=plan) and model_line(served) in err
    assert served["model_type"] == family and served["language_model_type"] == ({"gemma3": "gemma3_text",
                                                                                "llama4": "llama4_text"}.get(family))  # fmt: skip
    assert served["tensors"] == {"read": len(plan.reads), "skipped": len(plan.skipped)}
    assert (served["tensors"]["skipped"] > 0) == wrapper  # the vision tower and projector


def test_a_batch_of_image_prompts_is_refused_before_the_weights_load(capsys, saved, monkeypatch):
    import jax_hybrid_attn.engine_options as engine_options
    from tests.hf_families import IMAGE_TOKEN

    _, path = saved("gemma3")
    monkeypatch.setattr(engine_options, "load", lambda *args, **kwargs: pytest.fail("the weights were loaded"))
    code, out, err = run(capsys, "--model", str(path), "--prompt-token-ids", json.dumps([[5, IMAGE_TOKEN, 6], [IMAGE_TOKEN]]))
    assert code == 2 and out == ""
    assert "every prompt would be refused (2)" in err and "images are not supported" in err


@pytest.mark.parametrize(
    ("variable", "xdg", "want"),
    [(None, "/xdg", "/xdg/jax_hybrid_attn"), ("/mine", "/xdg", "/mine"), ("off", "/xdg", None), ("", None, None),
     (None, None, "~/.cache/jax_hybrid_attn")],
)  # fmt: skip
def test_the_compilation_cache_defaults_to_the_users_cache_directory(monkeypatch, variable, xdg, want):
    from jax_hybrid_attn.engine_options import COMPILATION_CACHE_VARIABLE, default_compilation_cache

    for name, value in ((COMPILATION_CACHE_VARIABLE, variable), ("XDG_CACHE_HOME", xdg)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.setenv("HOME", "/home/someone")
    assert default_compilation_cache() == (want and want.replace("~", "/home/someone"))


def test_the_compilation_cache_is_enabled_where_it_can_be_written(monkeypatch, tmp_path, capsys):
    from jax_hybrid_attn.cli import build_parser
    from jax_hybrid_attn.engine_options import COMPILATION_CACHE_VARIABLE, enable_compilation_cache
    from jax_hybrid_attn.engine import step_cache

    enabled = []
    monkeypatch.setattr(step_cache, "use_compilation_cache", enabled.append)  # not for the rest of the process
    parse = build_parser().parse_args
    monkeypatch.setenv(COMPILATION_CACHE_VARIABLE, str(tmp_path / "default"))
    args = parse(["generate"])
    enable_compilation_cache(args)
    assert args.compilation_cache == str(tmp_path / "default") and (tmp_path / "default").is_dir()
    args = parse(["generate", "--compilation-cache", str(tmp_path / "given")])
    enable_compilation_cache(args)
    assert args.compilation_cache == str(tmp_path / "given")
    args = parse(["generate", "--no-compilation-cache"])
    enable_compilation_cache(args)
    assert args.compilation_cache is None
    assert enabled == [str(tmp_path / "default"), str(tmp_path / "given")]

    blocked = tmp_path / "a file"
    blocked.write_text("")
    monkeypatch.setenv(COMPILATION_CACHE_VARIABLE, str(blocked / "cache"))
    args = parse(["generate"])
    enable_compilation_cache(args)  # the default directory: a warning, and no cache
    assert args.compilation_cache is None and "cannot be written" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--compilation-cache="):
        enable_compilation_cache(parse(["generate", "--compilation-cache", str(blocked / "cache")]))
    assert len(enabled) == 2
    with pytest.raises(SystemExit):
        parse(["generate", "--compilation-cache", str(tmp_path), "--no-compilation-cache"])


def test_save_embedded_writes_the_embedded_model_as_a_checkpoint(capsys, tmp_path):
    import numpy as np
    from flax import nnx

    from jax_hybrid_attn.models import embedded_config, load_model, load_tokenizer, random_model
    from jax_hybrid_attn.serve.chat_template import load_chat_template

    assert main(["save-embedded", str(tmp_path / "tiny"), "--seed", "3"]) == 0
    config, loaded = load_model(tmp_path / "tiny")
    assert config == embedded_config()
    expected = dict(nnx.to_flat_state(nnx.state(random_model(config, seed=3))))
    for name, variable in nnx.to_flat_state(nnx.state(loaded)):
        np.testing.assert_array_equal(variable[...], expected[name][...])
    assert load_tokenizer(tmp_path / "tiny").source.startswith("UTF-8 bytes")
    assert load_chat_template(tmp_path / "tiny") is not None
    capsys.readouterr()
    assert main(["save-embedded", str(tmp_path / "tiny")]) == 2  # nothing is overwritten
    assert "exists and is not an empty directory" in capsys.readouterr().err


def test_a_damaged_checkpoint_stops_jha_serve_with_exit_2(capsys, tmp_path, mistral_checkpoint):
    """The engine process plans the checkpoint before it reads a weight; its error reaches the user as one line."""
    import shutil

    pytest.importorskip("fastapi")
    shutil.copytree(mistral_checkpoint, tmp_path, dirs_exist_ok=True)
    (tmp_path / "model.safetensors").write_bytes(b"")
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    assert main(["serve", "--model", str(tmp_path), "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert "jha serve: error: " in err and "model.safetensors' is not a readable safetensors file" in err
