"""Run the fuser on a generated case and say what happened, in one short outcome.

Shared by the properties (``test_properties.py``, which assert the right outcome) and the long
run (``scripts/spelling_long_run.py``, which counts outcomes per spelling). Equivalent layers
must come out ``fused``; mutants ``refused``. Everything else carries the detail that explains
it (the fuser's reason, the wrong attribute, the error size).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper

from onnx_moe_fuse import fuse

from .build import build_case
from .reference import reference
from .strategies import Expected, LayerCase, expected

TOLERANCE = 1e-5  # relative to max |output|
MS_DOMAIN = "com.microsoft"

# Words a near miss must contain to name the part at fault (lower case, regular expressions).
PART_WORDS = {
    "routing": r"routing|softmax|top-?k|renormalis",
    "router": r"router|logits",
    "experts": r"expert ids|indices|gather|fc2|projection",
    "activation": r"activation|swiglu|gelu|clamp|gate|sigmoid|silu",
    "weights": r"zero point|weights not constant|quantized weights|dequantiz",
    "combine": r"combine|scatter|sum of the|weighted",
    "tokens": r"token rows|rows of the tokens|repeat|the tokens",
}


@dataclass(frozen=True)
class Outcome:
    """``kind`` is fused / refused / wrong-op / wrong-numbers / modified / error."""

    kind: str
    detail: str = ""

    def __str__(self) -> str:
        return self.kind if not self.detail else f"{self.kind}: {self.detail}"


def _unquoted(reason: str) -> str:
    """A reason with its quoted value and node names blanked."""
    return re.sub(r"'[^'\s]*'", "'_'", reason)  # names hold no spaces; "TopK's x" stays


def short_reason(reason: str) -> str:
    """A reason with its value names and numbers blanked, so equal reasons count together."""
    text = _unquoted(reason)
    text = re.sub(r"\d+(\.\d+)?", "N", text)
    return text[:140]


def session(model: onnx.ModelProto) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def token_shape(case: LayerCase, rng: np.random.Generator) -> tuple[int, ...]:
    """The shape of fresh tokens: the static one, or random sizes for symbolic dims."""
    if case.shapes == "static":
        return (*case.token_dims, case.hidden)
    dims = (
        (int(rng.integers(1, 8)),)
        if case.rank == 2
        else tuple(int(d) for d in rng.integers(1, 4, 2))
    )
    return (*dims, case.hidden)


def _attribute_mismatch(want: Expected, got: dict[str, object]) -> str | None:
    for key, value in want.attributes.items():
        if key not in got:
            return f"{key} missing"
        actual = got[key]
        allowed = value if isinstance(value, set) else {value}
        ok = any(
            (
                isinstance(a, float)
                and isinstance(actual, float)
                and (a == actual or math.isclose(a, actual, rel_tol=1e-6))
            )
            or a == actual
            for a in allowed
        )
        if not ok:
            return f"{key}={actual!r}, expected {value!r}"
    return None


def fused_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The fused ops of ``model``: its com.microsoft nodes.

    The standard nodes a fusion adds (the routing construction's inputs, its rescale ``Mul``
    after the node) are not fused ops; the numbers are compared on the whole model.
    """
    return [n for n in model.graph.node if n.domain == MS_DOMAIN]


def node_attributes(node: onnx.NodeProto) -> dict[str, object]:
    """``node``'s attributes as plain values (strings decoded, floats as Python floats)."""
    values = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    return {k: v.decode() if isinstance(v, bytes) else v for k, v in values.items()}


def relative_error(out: np.ndarray, ref: np.ndarray) -> float:
    """max |out - ref| relative to max |ref| (scale-aware)."""
    scale = max(float(np.abs(ref).max()), 1e-30)
    return float(np.abs(out.astype(np.float64) - ref).max()) / scale


def check_equivalent(case: LayerCase, runs: int = 2) -> Outcome:
    """Fuse an equivalent layer; ``fused`` only when op, attributes and numbers are right.

    The op and attributes are those of the one com.microsoft node of the fused model
    (:func:`fused_nodes`); the numbers those of the whole fused model, against ORT on the
    original and the numpy reference.
    """
    want = expected(case)
    built = build_case(case)
    try:
        result = fuse(built.model)
    except Exception as exc:  # the fuser must never raise on a valid model
        return Outcome("error", f"fuse raised {type(exc).__name__}: {exc}")
    nodes = fused_nodes(result.model)
    ops = [n.op_type for n in nodes]
    if not ops:
        reasons = sorted({m["reason"] for m in result.report.near_misses}) or ["no near miss"]
        return Outcome("refused", " | ".join(short_reason(r) for r in reasons))
    if ops != [want.op]:
        return Outcome("wrong-op", f"fused {ops}, expected {want.op}")
    mismatch = _attribute_mismatch(want, node_attributes(nodes[0]))
    if mismatch:
        return Outcome("wrong-op", mismatch)
    rng = np.random.default_rng(case.seed + 1)
    try:
        original, fused = session(built.model), session(result.model)
        for _ in range(runs):
            x = rng.standard_normal(token_shape(case, rng)).astype(np.float32)
            ref = reference(case, built.params, x)
            source_out, fused_out = original.run(None, {"x": x})[0], fused.run(None, {"x": x})[0]
            err_source = relative_error(source_out, ref)
            if err_source > TOLERANCE:
                return Outcome("error", f"the built layer is off the reference by {err_source:.1e}")
            err_fused = max(relative_error(fused_out, ref), relative_error(fused_out, source_out))
            if err_fused > TOLERANCE:
                return Outcome(
                    "wrong-numbers",
                    f"fused {ops[0]} off the source and reference by {err_fused:.1e}",
                )
    except Exception as exc:
        return Outcome("error", f"ORT: {type(exc).__name__}: {str(exc)[:200]}")
    return Outcome("fused")


def check_mutant(case: LayerCase) -> Outcome:
    """Fuse a broken layer: ``refused`` only when untouched and a near miss names the part."""
    want = expected(case)
    built = build_case(case)
    source = built.model.SerializeToString()
    try:
        result = fuse(built.model)
    except Exception as exc:
        return Outcome("error", f"fuse raised {type(exc).__name__}: {exc}")
    if result.report.fusions or fused_nodes(result.model):
        ops = [n.op_type for n in fused_nodes(result.model)]
        return Outcome("fused", f"fused {ops} (must be refused)")
    if result.model.SerializeToString() != source:
        return Outcome("modified", "nothing fused but the model changed")
    # "not recognised" says that no rule matched at all: it names no part, whatever its words.
    # Match the words outside quoted value names ('fc2_ids' names nothing).
    reasons = [
        _unquoted(m["reason"])
        for m in result.report.near_misses
        if not m["reason"].startswith("not recognised")
    ]
    words = PART_WORDS[want.part]
    naming = [r for r in reasons if re.search(words, r.lower())]
    if not naming:
        every = [m["reason"] for m in result.report.near_misses]
        shown = " | ".join(sorted({short_reason(r) for r in every})) or "no near miss"
        return Outcome("unnamed", f"no reason names the {want.part}: {shown}")
    return Outcome("refused", short_reason(naming[0]))
