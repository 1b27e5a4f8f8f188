"""`compare_with_transformers` and `jha compare`: each family's tiny random checkpoint (saved with
`save_pretrained`) matches transformers layer by layer within the float32 tolerance, with the same greedy tokens; a
checkpoint whose layer 2 was altered for our side only is reported with layer 2 as the first bad one; the CLI
prints the table or one JSON object and exits 1 on a failure; bad arguments and an unsupported model type are
refused by name, and a missing torch says which extra to install."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file, save_file

from jax_hybrid_attn.cli import main
from jax_hybrid_attn.models import SUPPORTED_ARCHITECTURES, ModelConfig, compare_with_transformers
from jax_hybrid_attn.models import compare as compare_module
from jax_hybrid_attn.models.compare import (
    DTYPE_TOLERANCES,
    FLOAT32_TOLERANCE,
    TRANSFORMERS_CLASSES,
    default_prompt_lengths,
)

from tests.hf_families import FAMILIES, TEXT_TOKENS, hf_model

STEPS = 2
BROKEN_LAYER = 2
PERTURBATION = 1.01
"""Layer 2's tensor times this on our side: a subtle error (1%), far beyond the float32 tolerance."""


def _saved(family: str, path):
    hf_model(family).save_pretrained(path)
    return path


def _config_only(family: str, path):
    """A checkpoint directory with a config.json and no weights: what the argument checks read."""
    FAMILIES[family][0]().save_pretrained(path)
    return path


def _prompt(length: int, seed: int = 0) -> list[int]:
    return np.random.RandomState(seed).randint(3, TEXT_TOKENS, size=length).tolist()


def test_every_supported_model_type_has_the_transformers_class_the_family_tests_use():
    assert set(TRANSFORMERS_CLASSES) == set(SUPPORTED_ARCHITECTURES) == set(FAMILIES)
    assert all(TRANSFORMERS_CLASSES[family] == class_name for family, (_, class_name) in FAMILIES.items())


@pytest.mark.parametrize(
    "family, steps, lengths",
    [
        ("gemma3_text", 8, (5, 7, 9, 17)),  # window 8: just inside, just past, past two windows
        ("llama4_text", 8, (5, 15, 17, 33)),  # chunk 16
        ("mistral", 230, (5, 7, 9, 17)),
        ("mistral", 240, (5, 7, 9, 16)),  # 256 positions: at most 256 - 240
    ],
)
def test_default_prompts_straddle_every_window_and_chunk(family, steps, lengths):
    config = ModelConfig.from_hf(FAMILIES[family][0]().to_dict())
    assert default_prompt_lengths(config, greedy_steps=steps) == lengths


def test_default_prompts_without_windows():
    config = ModelConfig.from_hf(FAMILIES["mistral"][0]().to_dict() | {"sliding_window": None})
    assert set(config.layer_types) == {"full_attention"}
    assert default_prompt_lengths(config, greedy_steps=8) == (5, 33)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_matches_transformers_layer_by_layer(family, tmp_path):
    report = compare_with_transformers(_saved(family, tmp_path / family), dtype="float32", greedy_steps=STEPS)
    (run,) = report.runs
    config = ModelConfig.from_dir(tmp_path / family)
    assert report.model_type == family and report.transformers_class == FAMILIES[family][1]
    assert report.prompt_lengths == default_prompt_lengths(config, greedy_steps=STEPS)
    assert run.dtype == "float32" and run.tolerance == FLOAT32_TOLERANCE
    assert [row.layer for row in run.layers] == list(range(config.num_layers))
    assert [row.layer_type for row in run.layers] == list(config.layer_types)
    for row in run.layers:
        assert row.hidden.within(FLOAT32_TOLERANCE) and row.attention.within(FLOAT32_TOLERANCE), row
        assert row.hidden.scale > 0.1 and row.attention.scale > 0.01, row  # real signal compared
    assert run.logits.scale > 1.0 and run.logits.within(FLOAT32_TOLERANCE), run.logits
    assert [len(g.ours) for g in run.greedy] == [STEPS] * len(report.prompt_lengths)
    assert run.greedy_agrees, run.greedy
    assert report.passed and report.first_bad is None and report.first_bad_layer is None


def test_the_bfloat16_run_follows_the_float32_one(tmp_path):
    report = compare_with_transformers(_saved("gemma3_text", tmp_path / "m"), prompts=[_prompt(12)],
                                       dtype="bfloat16", greedy_steps=STEPS)  # fmt: skip
    f32, bf16 = report.runs
    assert (f32.dtype, bf16.dtype) == ("float32", "bfloat16") and bf16.tolerance == DTYPE_TOLERANCES["bfloat16"]
    assert f32.greedy_required and not bf16.greedy_required
    # bfloat16 on both sides: rounding differences far above float32's, and within the run's tolerance
    assert bf16.layers[-1].hidden.max_abs > 100 * f32.layers[-1].hidden.max_abs
    assert bf16.first_bad is None and report.passed, report.table()


def _broken(source, path, tensor: str):
    """A copy of the checkpoint `source` with `tensor` of layer `BROKEN_LAYER` times `PERTURBATION`."""
    shutil.copytree(source, path)
    (weights,) = path.glob("*.safetensors")
    tensors = load_file(weights)
    name = f"model.layers.{BROKEN_LAYER}.{tensor}.weight"
    tensors[name] = tensors[name] * np.float32(PERTURBATION)
    save_file(tensors, weights, metadata={"format": "pt"})
    return path


def _our_side_reads(monkeypatch, path):
    """Our model loads from `path` (transformers still from the directory compared)."""
    load = compare_module.load_model
    monkeypatch.setattr(compare_module, "load_model", lambda _, **kwargs: load(path, **kwargs))


def test_a_broken_attention_weight_is_named_as_the_first_bad_layer(tmp_path, monkeypatch):
    model_dir = _saved("qwen3", tmp_path / "qwen3")
    _our_side_reads(monkeypatch, _broken(model_dir, tmp_path / "broken", "self_attn.o_proj"))
    report = compare_with_transformers(model_dir, prompts=[_prompt(12)], dtype="float32", greedy_steps=STEPS)
    (run,) = report.runs
    assert not report.passed
    assert report.first_bad_layer == BROKEN_LAYER and run.first_bad == f"layer {BROKEN_LAYER} (attention)"
    assert report.first_bad == f"float32: layer {BROKEN_LAYER} (attention)"
    assert all(not row.beyond(FLOAT32_TOLERANCE) for row in run.layers[:BROKEN_LAYER])
    assert run.layers[BROKEN_LAYER].attention.relative > 10 * FLOAT32_TOLERANCE
    assert run.layers[BROKEN_LAYER].hidden.relative > FLOAT32_TOLERANCE


def test_the_cli_names_a_broken_mlp_weight_and_exits_1(tmp_path, monkeypatch, capsys):
    model_dir = _saved("qwen3", tmp_path / "qwen3")
    _our_side_reads(monkeypatch, _broken(model_dir, tmp_path / "broken", "mlp.down_proj"))
    code = main(["compare", "--model", str(model_dir), "--dtype", "float32", "--steps", str(STEPS),
                 "--prompt-ids", ",".join(map(str, _prompt(12)))])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 1
    assert out.splitlines()[-1] == f"FAIL: float32: layer {BROKEN_LAYER} (hidden)"
    marks = {line[3:10].strip(): line[:2].strip() for line in out.splitlines() if line[3:4].isdigit()}
    assert marks == {"0": "", "1": "", "2": "!", "3": "!"}  # the table marks the layers beyond tolerance


def test_the_cli_prints_the_table_or_one_json_object(tmp_path, capsys):
    model_dir = _saved("gemma2", tmp_path / "gemma2")
    args = ["compare", "--model", str(model_dir), "--dtype", "float32", "--steps", str(STEPS),
            "--prompt-ids", ",".join(map(str, _prompt(10))), "--prompt-ids", "[3, 4, 5]"]  # fmt: skip
    assert main([*args, "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)  # nothing else on stdout
    assert payload["passed"] is True and payload["first_bad_layer"] is None
    assert payload["model_type"] == "gemma2" and payload["prompt_lengths"] == [10, 3]
    (run,) = payload["runs"]
    assert [row["layer"] for row in run["layers"]] == [0, 1, 2, 3]
    assert run["layers"][0]["hidden"]["max_abs"] <= FLOAT32_TOLERANCE * max(run["layers"][0]["hidden"]["scale"], 1)
    assert [len(g["ours"]) for g in run["greedy"]] == [STEPS, STEPS] and run["greedy_agrees"] is True
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("gemma2: jax_hybrid_attn against transformers") and lines[-1] == "PASS"
    assert [line.split()[:2] for line in lines if line[3:4].isdigit()] == [  # no "!" mark
        ["0", "sliding"], ["1", "full"], ["2", "sliding"], ["3", "full"]]  # fmt: skip


def test_an_unsupported_model_type_is_refused_by_name(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "vocab_size": 10}))
    with pytest.raises(NotImplementedError, match="model_type='bert'"):
        compare_with_transformers(tmp_path)
    assert main(["compare", "--model", str(tmp_path)]) == 2
    assert "jha compare: error: model_type='bert'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"dtype": "float16"}, "dtype='float16'"),
        ({"greedy_steps": -1}, "greedy_steps=-1"),
        ({"greedy_steps": 1.5}, "greedy_steps=1.5"),
        ({"seed": -2}, "seed=-2"),
        ({"torch_device": 0}, "torch_device=0"),
        ({"prompts": []}, r"prompts=\[\]"),
        ({"prompts": "hello"}, "prompts='hello'"),
        ({"prompts": [[3, 4], []]}, r"prompts\[1\]=\[\] has no tokens"),
        ({"prompts": [[3, 160]]}, r"prompts\[0\] token=160 must be an int in \[0, 159\]"),
        ({"prompts": [[3, -1]]}, r"prompts\[0\] token=-1"),
        ({"prompts": [3]}, r"prompts\[0\]=3 must be a string or a list of token ids"),
        ({"prompts": [[3] * 250], "greedy_steps": 7}, r"prompts\[0\] has 250 tokens: with greedy_steps=7"),
    ],
)
def test_bad_arguments_are_refused_by_name(kwargs, error, tmp_path):
    with pytest.raises(ValueError, match=error):
        compare_with_transformers(_config_only("mistral", tmp_path), **kwargs)


def test_a_prompt_with_the_image_token_is_refused(tmp_path):
    config = ModelConfig.from_dir(_config_only("gemma3", tmp_path))
    with pytest.raises(ValueError, match=rf"prompts\[0\] holds the image token {config.image_token_id}"):
        compare_with_transformers(tmp_path, prompts=[[3, config.image_token_id]])


def test_without_torch_the_error_names_the_extra(tmp_path, monkeypatch, capsys):
    model_dir = _config_only("mistral", tmp_path)
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'jax-hybrid-attn\[torch\]'"):
        compare_with_transformers(model_dir, prompts=[[3, 4]])
    assert main(["compare", "--model", str(model_dir), "--prompt-ids", "3,4"]) == 2
    assert "jax-hybrid-attn[torch]" in capsys.readouterr().err


def test_the_cli_refuses_malformed_prompt_ids(capsys):
    with pytest.raises(SystemExit):
        main(["compare", "--model", "x", "--prompt-ids", "1,a"])
    assert "--prompt-ids='1,a' must be token ids" in capsys.readouterr().err


def test_importing_compare_and_the_cli_imports_no_torch():
    code = "import sys, jax_hybrid_attn.models.compare, jax_hybrid_attn.cli; print('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_the_parser_imports_no_model_code_and_its_help_gives_the_functions_defaults():
    from jax_hybrid_attn.models.compare import DEFAULT_DTYPE, DEFAULT_GREEDY_STEPS

    code = ("import sys\nfrom jax_hybrid_attn.cli import build_parser\nbuild_parser().parse_args(['compare', "
            "'--model', 'x'])\nprint('jax_hybrid_attn.models' in sys.modules)")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
    from jax_hybrid_attn.cli import build_parser

    compare_parser = build_parser()._subparsers._group_actions[0].choices["compare"]
    help_text = " ".join(compare_parser.format_help().split())
    assert f"{DEFAULT_DTYPE} (the default)" in help_text and f"(default: {DEFAULT_GREEDY_STEPS};" in help_text
