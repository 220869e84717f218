"""The dense forms of :mod:`dense_forms_models` through ``fuse``: each fuses, or its trap is refused.

For every layer: the model run in ORT CPU equals its numpy reference on fresh random tokens;
an accepted layer fuses into one ``MoE`` that matches ORT CPU on the original within 1e-5
(relative to the output's scale); a trap computes something else than what the fused node
would (so refusing it matters), is left byte-identical, and a near miss names its part.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from dense_forms_models import (
    Llama4Spec,
    SplitDenseSpec,
    llama4_dense,
    llama4_reference,
    llama4_selected_reference,
    split_dense,
    split_dense_reference,
)
from dense_forms_shared import (
    SharedLoopSpec,
    shared_loop,
    shared_loop_fused_reference,
    shared_loop_reference,
)

from onnx_moe_fuse import fuse
from onnx_moe_fuse.pipeline import fuse_moe_layers
from onnx_moe_fuse.rewrites.canonical.experts.meaning.meaning_pass import CanonicalMeaningPass
from onnx_moe_fuse.verify.ort_nodes import session

RTOL = 1e-5
TOKENS = (1, 5, 12)


def run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return session(model).run(None, {"x": x})[0]


def rel(got: np.ndarray, want: np.ndarray) -> float:
    scale = float(np.abs(want).max())
    assert scale > 0, "an all-zero reference proves nothing"
    return float(np.abs(got.astype(np.float64) - want).max() / scale)


def fused_ops(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node if n.domain == "com.microsoft"]


def assert_fuses(model: onnx.ModelProto, rng: np.random.Generator, hidden: int) -> None:
    result = fuse(model)
    assert fused_ops(result.model) == ["MoE"], result.report.near_misses
    for t in TOKENS:
        x = rng.standard_normal((t, hidden)).astype(np.float32)
        assert rel(run(result.model, x), run(model, x).astype(np.float64)) <= RTOL


def assert_refused(model: onnx.ModelProto, part: str) -> None:
    original = model.SerializeToString()
    result = fuse(model)
    assert not fused_ops(result.model)
    assert result.model.SerializeToString() == original
    misses = result.report.near_misses
    assert any(m.get("part") == part and m.get("node") for m in misses), misses
    assert not any("not recognised" in m["reason"] for m in misses), misses


LLAMA4 = [Llama4Spec(), Llama4Spec(torchscript=True, seed=8)]
LLAMA4_TRAPS = {
    "top2": (Llama4Spec(k=2), "routing"),
    "biased_experts": (Llama4Spec(bias=True), "activation"),
    "regrouped_tokens_first": (Llama4Spec(regroup_tokens_first=True), "fc2"),
}


@pytest.mark.parametrize("spec", LLAMA4 + [s for s, _ in LLAMA4_TRAPS.values()], ids=repr)
def test_llama4_matches_numpy(spec: Llama4Spec, rng: np.random.Generator) -> None:
    x = rng.standard_normal((7, spec.hidden)).astype(np.float32)
    assert rel(run(llama4_dense(spec), x), llama4_reference(spec, x)) <= RTOL


@pytest.mark.parametrize("spec", LLAMA4, ids=["dynamo", "torchscript"])
def test_llama4_top1_fuses(spec: Llama4Spec, rng: np.random.Generator) -> None:
    x = rng.standard_normal((7, spec.hidden)).astype(np.float32)
    # the dense layer is the selected expert on the scaled token (what one fused node computes)
    assert rel(llama4_reference(spec, x), llama4_selected_reference(spec, x)) <= 1e-12
    assert_fuses(llama4_dense(spec), rng, spec.hidden)


@pytest.mark.parametrize("name", LLAMA4_TRAPS)
def test_llama4_trap_refused(name: str, rng: np.random.Generator) -> None:
    spec, part = LLAMA4_TRAPS[name]
    x = rng.standard_normal((7, spec.hidden)).astype(np.float32)
    if spec.k == 1:  # the trap is not what a fused top-1 node computes
        assert rel(llama4_reference(spec, x), llama4_selected_reference(spec, x)) > 1e-3
    assert_refused(llama4_dense(spec), part)


SHARED = {
    "product_of_sum": SharedLoopSpec(),
    "sum_of_products": SharedLoopSpec(split_products=True),
}
SHARED_TRAPS = {
    "shared_at_slots": (SharedLoopSpec(shared_at_slots=True), "combine"),
    "shared_in_first_only": (SharedLoopSpec(shared_in_first_only=True), "combine"),
}


@pytest.mark.parametrize(
    "spec", [*SHARED.values(), *(s for s, _ in SHARED_TRAPS.values())], ids=repr
)
def test_shared_loop_matches_numpy(spec: SharedLoopSpec, rng: np.random.Generator) -> None:
    x = rng.standard_normal((7, spec.hidden)).astype(np.float32)
    assert rel(run(shared_loop(spec), x), shared_loop_reference(spec, x)) <= RTOL


@pytest.mark.parametrize("name", SHARED)
def test_shared_inside_combine_fuses(name: str, rng: np.random.Generator) -> None:
    spec = SHARED[name]
    x = rng.standard_normal((7, spec.hidden)).astype(np.float32)
    # the layer is the routed sum plus (sum_j w) * S: what the fused node and the term compute
    assert rel(shared_loop_reference(spec, x), shared_loop_fused_reference(spec, x)) <= 1e-12
    assert_fuses(shared_loop(spec), rng, spec.hidden)


@pytest.mark.parametrize("name", SHARED_TRAPS)
def test_shared_trap_refused(name: str, rng: np.random.Generator) -> None:
    spec, part = SHARED_TRAPS[name]
    x = rng.standard_normal((7, spec.hidden)).astype(np.float32)
    assert rel(shared_loop_reference(spec, x), shared_loop_fused_reference(spec, x)) > 1e-3
    assert_refused(shared_loop(spec), part)


SPLIT = SplitDenseSpec()
SPLIT_TRAP = SplitDenseSpec(weights_split_swapped=True)
SPLIT_SHAPES = ((2, 3), (1, 5), (3, 1), (4, 4))


@pytest.mark.parametrize("spec", [SPLIT, SPLIT_TRAP], ids=["layer", "trap"])
def test_split_dense_matches_numpy(spec: SplitDenseSpec, rng: np.random.Generator) -> None:
    x = rng.standard_normal((2, 3, spec.hidden)).astype(np.float32)
    assert rel(run(split_dense(spec), x), split_dense_reference(spec, x)) <= RTOL


def test_split_dense_fuses(rng: np.random.Generator) -> None:
    model = split_dense(SPLIT)
    result = fuse(model)
    assert fused_ops(result.model) == ["MoE"], result.report.near_misses
    for b, s in SPLIT_SHAPES:
        x = rng.standard_normal((b, s, SPLIT.hidden)).astype(np.float32)
        assert rel(run(result.model, x), run(model, x).astype(np.float64)) <= RTOL


def test_split_dense_is_read_by_the_dense_form(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the meaning pass: the dense canonicalisation proves the split itself."""

    class NoMeaning(CanonicalMeaningPass):
        def call(self, model: ir.Model) -> ir.passes.PassResult:
            return ir.passes.PassResult(model, False)

    monkeypatch.setattr(fuse_moe_layers, "CanonicalMeaningPass", NoMeaning)
    assert fused_ops(fuse(split_dense(SPLIT)).model) == ["MoE"]


def test_split_dense_trap_refused(rng: np.random.Generator) -> None:
    x = rng.standard_normal((2, 3, SPLIT.hidden)).astype(np.float32)
    assert rel(split_dense_reference(SPLIT_TRAP, x), split_dense_reference(SPLIT, x)) > 1e-3
    assert_refused(split_dense(SPLIT_TRAP), "combine")
