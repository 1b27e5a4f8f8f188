"""What `compare_with_transformers` reports: per dtype run, per decoder layer, the differences between our model
and transformers' of the same checkpoint, the greedy tokens of both, and the tolerances they are judged by.

A difference is within tolerance when ``max |ours - theirs| <= tolerance * max(max |theirs|, SCALE_FLOOR)``:
relative to the largest value of the tensor compared, absolute below `SCALE_FLOOR`.
"""

import dataclasses

__all__ = [
    "BFLOAT16_TOLERANCE", "DTYPE_TOLERANCES", "FLOAT32_TOLERANCE", "SCALE_FLOOR", "ComparisonReport", "Difference",
    "DtypeRun", "GreedyAgreement", "LayerDifference",
]  # fmt: skip

FLOAT32_TOLERANCE = 1e-4
"""The float32 run's tolerance, relative to each tensor's largest |value| (`Difference.within`): the two
frameworks' float32 roundings differ by about 1e-6 of the scale per few layers (1e-6 after the 2 to 6 layers of the
tiny test models); a weight 1% off is beyond it by far."""

BFLOAT16_TOLERANCE = 1e-1
"""The bfloat16 run's: bfloat16 keeps 8 significant bits (a rounding step of 2**-8 = 0.4%), and transformers and
XLA round at different places, so that differences grow through the layers to a few percent of the scale (2% after
the 6 layers of the tiny test models). A coarse check: a wrong weight is found by the float32 run."""

DTYPE_TOLERANCES = {"float32": FLOAT32_TOLERANCE, "bfloat16": BFLOAT16_TOLERANCE}
"""The dtypes a comparison runs in, and each run's tolerance."""

SCALE_FLOOR = 1.0
"""Below this largest |value|, a tolerance is absolute (a tensor of tiny values is never judged relative to them)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Difference:
    """|ours - theirs| of one tensor over every prompt's tokens (compared in float32).

    Attributes:
      max_abs: the largest |difference|.
      mean_abs: the mean |difference| over every element.
      scale: the largest |value| of transformers' tensor.
    """

    max_abs: float
    mean_abs: float
    scale: float

    @property
    def relative(self) -> float:
        """`max_abs` relative to `scale` (to `SCALE_FLOOR` where the scale is smaller)."""
        return self.max_abs / max(self.scale, SCALE_FLOOR)

    def within(self, tolerance: float) -> bool:
        return bool(self.relative <= tolerance)  # NaN is never within

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "relative": self.relative}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LayerDifference:
    """One decoder layer's differences.

    Attributes:
      layer: the layer's index.
      layer_type: its attention type (``"sliding_attention"``, ``"full_attention"``, ``"chunked_attention"``).
      hidden: of the layer's output, the hidden state it passes on.
      attention: of its attention block's output, after ``o_proj``.
    """

    layer: int
    layer_type: str
    hidden: Difference
    attention: Difference

    def beyond(self, tolerance: float) -> list[str]:
        """What of the layer exceeds `tolerance`: ``"attention"`` and/or ``"hidden"`` (none: [])."""
        return [name for name in ("attention", "hidden") if not getattr(self, name).within(tolerance)]

    def to_dict(self) -> dict:
        return {"layer": self.layer, "layer_type": self.layer_type, "hidden": self.hidden.to_dict(),
                "attention": self.attention.to_dict()}  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class GreedyAgreement:
    """One prompt's greedy tokens from both sides.

    Attributes:
      prompt: the prompt's index.
      ours, theirs: the tokens our dense forward and transformers' ``generate`` chose.
    """

    prompt: int
    ours: tuple[int, ...]
    theirs: tuple[int, ...]

    @property
    def agreed(self) -> int:
        """How many tokens agree before the first that differs."""
        return next((i for i, (a, b) in enumerate(zip(self.ours, self.theirs)) if a != b), len(self.ours))

    @property
    def agrees(self) -> bool:
        return self.ours == self.theirs

    def to_dict(self) -> dict:
        return {"prompt": self.prompt, "ours": list(self.ours), "theirs": list(self.theirs), "agreed": self.agreed}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DtypeRun:
    """Both models in one dtype, on every prompt.

    Attributes:
      dtype: the weights' and activations' dtype on both sides.
      tolerance: the run's tolerance (`DTYPE_TOLERANCES`).
      embeddings: of the first layer's input.
      layers: per decoder layer.
      logits: of the final logits.
      greedy: per prompt (empty with no greedy steps).
      greedy_required: whether the tokens must agree for the run to pass (float32 only: in a lower precision
        the two frameworks round differently and may break a near-tie either way).
    """

    dtype: str
    tolerance: float
    embeddings: Difference
    layers: tuple[LayerDifference, ...]
    logits: Difference
    greedy: tuple[GreedyAgreement, ...]
    greedy_required: bool

    @property
    def first_bad(self) -> str | None:
        """The first place beyond tolerance, in the order the model computes: ``"embeddings"``, ``"layer 3
        (attention)"``, ``"layer 3 (hidden)"`` (the attention block within, the rest of the layer not), ``"logits"``;
        None when every difference is within."""
        if not self.embeddings.within(self.tolerance):
            return "embeddings"
        for row in self.layers:
            if beyond := row.beyond(self.tolerance):
                return f"layer {row.layer} ({beyond[0]})"
        return None if self.logits.within(self.tolerance) else "logits"

    @property
    def first_bad_layer(self) -> int | None:
        """The index of the first decoder layer beyond tolerance (None: none is)."""
        return next((row.layer for row in self.layers if row.beyond(self.tolerance)), None)

    @property
    def greedy_agrees(self) -> bool:
        return all(g.agrees for g in self.greedy)

    @property
    def passed(self) -> bool:
        return self.first_bad is None and (self.greedy_agrees or not self.greedy_required)

    def to_dict(self) -> dict:
        return {
            "dtype": self.dtype, "tolerance": self.tolerance, "passed": self.passed, "first_bad": self.first_bad,
            "first_bad_layer": self.first_bad_layer, "embeddings": self.embeddings.to_dict(),
            "layers": [row.to_dict() for row in self.layers], "logits": self.logits.to_dict(),
            "greedy": [g.to_dict() for g in self.greedy], "greedy_agrees": self.greedy_agrees,
            "greedy_required": self.greedy_required,
        }  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class ComparisonReport:
    """What `compare_with_transformers` found.

    Attributes:
      model_dir: the checkpoint directory.
      model_type: its ``model_type``.
      transformers_class: the transformers class it was compared with.
      transformers_version: the installed transformers'.
      prompt_lengths: the prompts' lengths in tokens.
      greedy_steps: greedy tokens per prompt.
      runs: the float32 run, then the other dtype's where there is one.
    """

    model_dir: str
    model_type: str
    transformers_class: str
    transformers_version: str
    prompt_lengths: tuple[int, ...]
    greedy_steps: int
    runs: tuple[DtypeRun, ...]

    @property
    def passed(self) -> bool:
        """Every run passed: each difference within its run's tolerance, and the float32 greedy tokens equal."""
        return all(run.passed for run in self.runs)

    @property
    def first_bad(self) -> str | None:
        """The first failure of the first run that failed, with its dtype (``"float32: layer 2 (attention)"``)."""
        for run in self.runs:
            if run.first_bad is not None:
                return f"{run.dtype}: {run.first_bad}"
            if not run.passed:
                return f"{run.dtype}: greedy tokens"
        return None

    @property
    def first_bad_layer(self) -> int | None:
        """The first decoder layer beyond tolerance in the float32 run, else in the other run (None: none)."""
        return next((run.first_bad_layer for run in self.runs if run.first_bad_layer is not None), None)

    def to_dict(self) -> dict:
        """The report as JSON-ready data."""
        return {
            "model_dir": self.model_dir, "model_type": self.model_type, "transformers_class": self.transformers_class,
            "transformers_version": self.transformers_version, "prompt_lengths": list(self.prompt_lengths),
            "greedy_steps": self.greedy_steps, "passed": self.passed, "first_bad": self.first_bad,
            "first_bad_layer": self.first_bad_layer, "runs": [run.to_dict() for run in self.runs],
        }  # fmt: skip

    def table(self) -> str:
        """The report as a text table: one block per dtype, a row per layer, then the verdict."""
        lengths = ", ".join(map(str, self.prompt_lengths))
        lines = [f"{self.model_type}: jax_hybrid_attn against transformers {self.transformers_version} "
                 f"{self.transformers_class}; {len(self.prompt_lengths)} prompts of {lengths} tokens, "
                 f"{self.greedy_steps} greedy steps"]  # fmt: skip
        header = f"{'':>2} {'layer':<7}{'type':<18}{'hidden max':>12}{'mean':>10}{'attn max':>12}{'mean':>10}"
        header += f"{'max/scale':>11}"
        for run in self.runs:
            tolerance = run.tolerance
            lines += ["", f"{run.dtype} (tolerance {tolerance:.0e} of each tensor's max |value|, "
                      f"at least {SCALE_FLOOR:g})", header]  # fmt: skip

            def row(name, kind, hidden, attention=None):
                worst = max(d.relative for d in (hidden, attention) if d is not None)
                mark = "!" if worst > tolerance or worst != worst else ""
                attn = f"{attention.max_abs:>12.2e}{attention.mean_abs:>10.1e}" if attention else f"{'':>22}"
                return (f"{mark:>2} {name:<7}{kind:<18}{hidden.max_abs:>12.2e}{hidden.mean_abs:>10.1e}{attn}"
                        f"{worst:>11.1e}")  # fmt: skip

            lines.append(row("embed", "", run.embeddings))
            for layer in run.layers:
                kind = layer.layer_type.removesuffix("_attention")
                lines.append(row(str(layer.layer), kind, layer.hidden, layer.attention))
            lines.append(row("logits", "", run.logits))
            if run.greedy:
                agreed = sum(g.agreed for g in run.greedy)
                total = sum(len(g.ours) for g in run.greedy)
                note = "" if run.greedy_required else " (reported, not required)"
                lines.append(f"greedy: {agreed}/{total} tokens agree before any difference{note}")
                for g in run.greedy:
                    if not g.agrees:
                        step = g.agreed
                        lines.append(f"  prompt {g.prompt} ({self.prompt_lengths[g.prompt]} tokens): step {step} "
                                     f"ours {g.ours[step]}, transformers {g.theirs[step]}")  # fmt: skip
            lines.append(f"first beyond tolerance: {run.first_bad or 'none'}")
        lines += ["", "PASS" if self.passed else f"FAIL: {self.first_bad}"]
        return "\n".join(lines)
