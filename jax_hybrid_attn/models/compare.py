"""Check a port against transformers: the same checkpoint in our `Decoder` and in transformers, layer by layer.

`compare_with_transformers(DIR)` loads a transformers checkpoint directory twice: into our `Decoder`
(`load_model`) and into the transformers class of its ``model_type`` (`TRANSFORMERS_CLASSES`, eager attention,
on the CPU unless `torch_device` says otherwise). It runs the same prompts through both and reports, for each
decoder layer, the largest and the mean |difference| of the layer's output (the hidden state it passes on) and of
its attention block's output (after ``o_proj``), then of the embeddings and of the final logits; and whether the
two generate the same greedy tokens. It runs in float32 always, and once more in `dtype` when that is not float32.
The report names the first layer whose difference exceeds the run's tolerance, so that a wrongly read or wrongly
used weight is pointed at.

The report and its tolerances (`FLOAT32_TOLERANCE`, `DTYPE_TOLERANCES`, relative to each tensor's largest value)
are in `comparison_report`.

transformers' side: the hidden states come from forward hooks on its decoder layers (``output_hidden_states``
gives the embeddings; its last entry is after the final norm), the attention outputs from forward hooks on each
layer's ``self_attn``. Our side: `Decoder.with_intermediates`, the dense forward (`DenseAttention`). Greedy
tokens: transformers' ``generate(do_sample=False)`` (no EOS stop) against our dense forward re-run over the whole
sequence for each new token (one compiled shape: the sequences padded to one length; every layer is causal, so
the padding never reaches a real row); the serving engine is not involved.

torch and transformers (the ``torch`` extra) are imported when a comparison runs, never at import.

Shape letters: T tokens · D hidden size · V vocabulary · L layers.
"""

import os
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..extras import require_extra
from ..integers import check_int
from .attention_cache import DenseAttention
from .comparison_report import (
    DTYPE_TOLERANCES,
    FLOAT32_TOLERANCE,
    SCALE_FLOOR,
    ComparisonReport,
    Difference,
    DtypeRun,
    GreedyAgreement,
    LayerDifference,
)
from .config import ModelConfig
from .checkpoint_plan import plan_checkpoint
from .loading import load_model

__all__ = [
    "DEFAULT_DTYPE",
    "DEFAULT_GREEDY_STEPS",
    "DTYPE_TOLERANCES",
    "FLOAT32_TOLERANCE",
    "SCALE_FLOOR",
    "TRANSFORMERS_CLASSES",
    "ComparisonReport",
    "Difference",
    "DtypeRun",
    "GreedyAgreement",
    "LayerDifference",
    "compare_with_transformers",
    "default_prompt_lengths",
]

DEFAULT_DTYPE = "bfloat16"
"""The second run's dtype by default (the first is always float32)."""

DEFAULT_GREEDY_STEPS = 8
"""Greedy tokens generated per prompt by default."""

SHORT_PROMPT_LENGTH = 5
"""The default prompts always include one this short (all of it inside any window or chunk)."""

FULL_ATTENTION_PROMPT_LENGTH = 33
"""The default prompts' longer length for a model without windows or chunks."""


TRANSFORMERS_CLASSES = {
    "mistral": "MistralForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "gpt_oss": "GptOssForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "llama4": "Llama4ForConditionalGeneration",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
"""The transformers class each supported ``model_type`` is compared with (`SUPPORTED_ARCHITECTURES`)."""


# --- prompts --------------------------------------------------------------------------------------------------


def default_prompt_lengths(config: ModelConfig, *, greedy_steps: int = DEFAULT_GREEDY_STEPS) -> tuple[int, ...]:
    """The default prompts' lengths: `SHORT_PROMPT_LENGTH`, and for each window and chunk X of the config's
    layers X - 1, X + 1 and 2X + 1 (just inside one, just past one, past two); `FULL_ATTENTION_PROMPT_LENGTH`
    without windows or chunks. Each at most ``max_position_embeddings - greedy_steps``."""
    limit = config.max_position_embeddings - greedy_steps
    spans = set()
    if "sliding_attention" in config.layer_types:
        spans.add(config.sliding_window)
    if "chunked_attention" in config.layer_types:
        spans.add(config.attention_chunk_size)
    wanted = {SHORT_PROMPT_LENGTH} | {n for x in spans for n in (x - 1, x + 1, 2 * x + 1)}
    if not spans:
        wanted.add(FULL_ATTENTION_PROMPT_LENGTH)
    return tuple(sorted({min(n, limit) for n in wanted if n >= 1}))


def _special_ids(config: ModelConfig) -> set[int]:
    ids = {config.bos_token_id, config.pad_token_id, config.image_token_id, *config.eos_token_ids}
    return {i for i in ids if i is not None}


def _default_prompts(config: ModelConfig, *, greedy_steps: int, seed: int) -> list[list[int]]:
    """Random token ids (`seed`), none of them a special token, of the `default_prompt_lengths`."""
    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(config.vocab_size), np.fromiter(_special_ids(config), int))
    return [rng.choice(allowed, size=n).tolist() for n in default_prompt_lengths(config, greedy_steps=greedy_steps)]


def _token_lists(prompts, config: ModelConfig, model_dir, *, greedy_steps: int) -> list[list[int]]:
    """`prompts` as token id lists (a string through the checkpoint's tokenizer), each checked."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError(f"prompts={prompts!r} must be a non-empty list of strings or of token id lists")
    token_lists, tokenizer = [], None
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            from .tokenizer import load_tokenizer

            tokenizer = tokenizer or load_tokenizer(model_dir)
            p = tokenizer.encode(p)
        elif isinstance(p, (bytes, np.ndarray)) or not isinstance(p, Sequence):
            raise ValueError(f"prompts[{i}]={p!r} must be a string or a list of token ids")
        ids = [check_int(f"prompts[{i}] token", t, minimum=0, maximum=config.vocab_size - 1) for t in p]
        if not ids:
            raise ValueError(f"prompts[{i}]={p!r} has no tokens")
        if len(ids) + greedy_steps > config.max_position_embeddings:
            raise ValueError(f"prompts[{i}] has {len(ids)} tokens: with greedy_steps={greedy_steps} beyond "
                             f"max_position_embeddings={config.max_position_embeddings}")  # fmt: skip
        if config.image_token_id is not None and config.image_token_id in ids:
            raise ValueError(f"prompts[{i}] holds the image token {config.image_token_id} (images are not supported)")
        token_lists.append(ids)
    return token_lists


# --- the two sides --------------------------------------------------------------------------------------------


def _import_torch():
    """torch and transformers, or a `MissingExtraError` that says how to install them."""
    require_extra("torch", needed_for="comparing with transformers")
    import torch
    import transformers

    return torch, transformers


def _check_torch_device(torch, torch_device: str) -> None:
    """`ValueError` unless torch can run on `torch_device` here ("cpu", "cuda", "cuda:1", ...)."""
    try:
        device = torch.device(torch_device)
    except RuntimeError as error:
        raise ValueError(f"{torch_device=} is not a torch device: {error}") from None
    backend = getattr(torch, device.type, None) if device.type != "cpu" else None
    if backend is not None and hasattr(backend, "is_available") and not backend.is_available():
        raise ValueError(
            f"{torch_device=}: torch has no {device.type} device here ({backend.__name__}.is_available() is "
            "False); --torch-device cpu runs transformers on the CPU"
        )
    count = getattr(backend, "device_count", lambda: None)()
    if device.index is not None and count is not None and device.index >= count:
        raise ValueError(f"{torch_device=}: torch sees {count} {device.type} device(s)")


def _as_array(x) -> np.ndarray:
    return np.asarray(jnp.asarray(x, jnp.float32))


class _Tensors(NamedTuple):
    """One prompt's tensors from one side, in float32."""

    embeddings: np.ndarray  # [T, D]
    hidden: np.ndarray  # [L, T, D]
    attention: np.ndarray  # [L, T, D]
    logits: np.ndarray  # [T, V]


def _ours(model, token_lists: list[list[int]], *, greedy_steps: int):
    """Our side: per prompt its `_Tensors`, and the greedy tokens."""
    graphdef, state = nnx.split(model)
    length = max(map(len, token_lists)) + greedy_steps  # one padded length: one compiled shape

    @jax.jit
    def forward(state, token_ids, row):  # the greedy steps use the same function: one compiled shape
        logits, inter, _ = nnx.merge(graphdef, state).with_intermediates(token_ids, DenseAttention(length))
        return inter.embeddings, inter.hidden, inter.attention, logits, jnp.argmax(logits[row])

    tensors, greedy = [], []
    with jax.default_matmul_precision("highest"):
        for ids in token_lists:
            padded = np.zeros(length, np.int32)
            padded[: len(ids)] = ids
            n = len(ids)
            embeddings, hidden, attention, logits, _ = forward(state, padded, np.int32(n - 1))
            tensors.append(_Tensors(_as_array(embeddings[:n]), _as_array(hidden[:, :n]), _as_array(attention[:, :n]),
                                    _as_array(logits[:n])))  # fmt: skip
            tokens = []
            for step in range(greedy_steps):
                padded[n + step] = int(forward(state, padded, np.int32(n + step - 1))[-1])
                tokens.append(int(padded[n + step]))
            greedy.append(tokens)
    return tensors, greedy


def _text_layers(torch, hf_model, num_layers: int):
    """The decoder layers of transformers' text model (a wrapper's vision tower has layers too)."""
    found = [(name, m) for name, m in hf_model.named_modules()
             if name.split(".")[-1] == "layers" and isinstance(m, torch.nn.ModuleList) and len(m) == num_layers
             and "vision" not in name]  # fmt: skip
    if len(found) != 1:
        raise NotImplementedError(f"{type(hf_model).__name__} has {len(found)} decoder layer lists of "
                                  f"{num_layers} layers ({[n for n, _ in found]}), not one")  # fmt: skip
    return found[0][1]


def _theirs(torch, hf_model, token_lists: list[list[int]], *, num_layers: int, greedy_steps: int, pad_token_id: int):
    """transformers' side, as `_ours` returns it."""
    layers = _text_layers(torch, hf_model, num_layers)
    captured: dict = {}

    def keep(kind, index):
        def hook(module, args, output):
            captured[kind, index] = output[0] if isinstance(output, tuple) else output

        return hook

    hooks = [layer.register_forward_hook(keep("hidden", i)) for i, layer in enumerate(layers)]
    hooks += [layer.self_attn.register_forward_hook(keep("attention", i)) for i, layer in enumerate(layers)]
    device = next(hf_model.parameters()).device
    numpy = lambda t: t.detach().to("cpu", torch.float32).numpy()[0]
    tensors, greedy = [], []
    try:
        with torch.no_grad():
            for ids in token_lists:
                captured.clear()
                out = hf_model(input_ids=torch.tensor([ids], device=device), output_hidden_states=True)
                hidden = np.stack([numpy(captured["hidden", i]) for i in range(num_layers)])
                attention = np.stack([numpy(captured["attention", i]) for i in range(num_layers)])
                tensors.append(_Tensors(numpy(out.hidden_states[0]), hidden, attention, numpy(out.logits)))
    finally:
        for hook in hooks:
            hook.remove()
    with torch.no_grad():
        for ids in token_lists if greedy_steps else ():
            input_ids = torch.tensor([ids], device=device)
            out = hf_model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                    max_new_tokens=greedy_steps, eos_token_id=None, pad_token_id=pad_token_id)
            greedy.append(out[0, len(ids) :].tolist())
    return tensors, greedy


def _difference(ours: list[_Tensors], theirs: list[_Tensors], field: str, layer: int | None = None) -> Difference:
    """Of the tensors `field` (of `layer` for "hidden" and "attention") over every prompt."""
    pick = lambda side: [getattr(t, field) if layer is None else getattr(t, field)[layer] for t in side]
    ours, theirs = pick(ours), pick(theirs)
    diffs = [np.abs(a - b) for a, b in zip(ours, theirs, strict=True)]
    total = sum(d.size for d in diffs)
    return Difference(max_abs=float(max(d.max() for d in diffs)), mean_abs=float(sum(d.sum() for d in diffs) / total),
                      scale=float(max(np.abs(b).max() for b in theirs)))  # fmt: skip


def _run(model_dir, config: ModelConfig, class_name: str, token_lists, *, dtype: str, greedy_steps: int,
         torch_device: str) -> DtypeRun:  # fmt: skip
    torch, transformers = _import_torch()
    _, model = load_model(model_dir, dtype=jnp.dtype(dtype))
    ours, our_greedy = _ours(model, token_lists, greedy_steps=greedy_steps)
    del model
    hf_model = getattr(transformers, class_name).from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation="eager"
    )
    hf_model = hf_model.to(torch_device).eval()
    pad = config.pad_token_id if config.pad_token_id is not None else (config.eos_token_ids or (0,))[0]
    theirs, their_greedy = _theirs(torch, hf_model, token_lists, num_layers=config.num_layers,
                                   greedy_steps=greedy_steps, pad_token_id=pad)  # fmt: skip
    del hf_model
    layers = tuple(
        LayerDifference(layer=i, layer_type=config.layer_types[i], hidden=_difference(ours, theirs, "hidden", i),
                        attention=_difference(ours, theirs, "attention", i))
        for i in range(config.num_layers)
    )  # fmt: skip
    greedy = tuple(GreedyAgreement(prompt=i, ours=tuple(a), theirs=tuple(b))
                   for i, (a, b) in enumerate(zip(our_greedy, their_greedy, strict=True)))  # fmt: skip
    return DtypeRun(dtype=dtype, tolerance=DTYPE_TOLERANCES[dtype], embeddings=_difference(ours, theirs, "embeddings"),
                    layers=layers, logits=_difference(ours, theirs, "logits"), greedy=greedy,
                    greedy_required=dtype == "float32")  # fmt: skip


def compare_with_transformers(
    model_dir: str | os.PathLike,
    *,
    prompts: Sequence[str | Sequence[int]] | None = None,
    dtype: str = DEFAULT_DTYPE,
    greedy_steps: int = DEFAULT_GREEDY_STEPS,
    seed: int = 0,
    torch_device: str = "cpu",
) -> ComparisonReport:
    """Our `Decoder` of the checkpoint directory `model_dir` against transformers' model of it, layer by layer.

    Args:
      model_dir: a transformers checkpoint directory of a supported ``model_type`` (`TRANSFORMERS_CLASSES`).
      prompts: token id lists, or strings (encoded with the checkpoint's tokenizer); None: random token ids drawn
        from `seed`, of the `default_prompt_lengths` (around each window and chunk of the config).
      dtype: the second run's dtype, one of `DTYPE_TOLERANCES` (the float32 run is always made; "float32" makes
        only that one).
      greedy_steps: greedy tokens generated per prompt on both sides (0: none compared).
      seed: the default prompts' seed.
      torch_device: where transformers runs ("cpu", "cuda").

    Returns: the `ComparisonReport`: per run (dtype), per layer, the hidden-state and attention-output
      differences, the embeddings' and logits', the greedy tokens; `passed`, `first_bad`, `first_bad_layer`.

    Raises: `NotImplementedError` for an unsupported ``model_type``; `ValueError` naming a bad argument;
      `MissingExtraError` (an `ImportError`) when torch or transformers is missing (the ``torch`` extra)."""
    if dtype not in DTYPE_TOLERANCES:
        raise ValueError(f"dtype={dtype!r} is not supported (supported: {tuple(DTYPE_TOLERANCES)})")
    greedy_steps = check_int("greedy_steps", greedy_steps, minimum=0)
    seed = check_int("seed", seed, minimum=0, maximum=None)
    if not isinstance(torch_device, str):
        raise ValueError(f"torch_device={torch_device!r} must be a string such as 'cpu' or 'cuda'")
    config = ModelConfig.from_dir(model_dir)  # an unsupported model_type is refused here, by name
    class_name = TRANSFORMERS_CLASSES[config.model_type]
    if prompts is None:
        token_lists = _default_prompts(config, greedy_steps=greedy_steps, seed=seed)
    else:
        token_lists = _token_lists(prompts, config, model_dir, greedy_steps=greedy_steps)
    torch, transformers = _import_torch()
    _check_torch_device(torch, torch_device)
    plan_checkpoint(model_dir)  # every weight file's header read: a damaged one is named before anything loads
    dtypes = ["float32"] + ([dtype] if dtype != "float32" else [])
    runs = tuple(_run(model_dir, config, class_name, token_lists, dtype=d, greedy_steps=greedy_steps,
                      torch_device=torch_device) for d in dtypes)  # fmt: skip
    return ComparisonReport(
        model_dir=os.fspath(model_dir), model_type=config.model_type, transformers_class=class_name,
        transformers_version=transformers.__version__, prompt_lengths=tuple(map(len, token_lists)),
        greedy_steps=greedy_steps, runs=runs,
    )  # fmt: skip
