"""Property tests: generated MoE spellings fuse to the right node, and broken ones are refused.

(1) Every equivalent layer drawn from the supported spellings fuses (``onnx_moe_fuse.fuse``)
into exactly the op and attributes its case records (one com.microsoft node), and the fused
model matches both ORT CPU on the original layer and the independent numpy reference within
1e-5 of max |output|; one test per routing and weight kind (float or quantized).
(2) Every mutant (one place broken) leaves the model byte-identical and gets a near miss whose
reason names the broken part; one test per mutation and routing family (bases the fused ops
route themselves, or bases that need the routing construction). Both draw from
``strategies.SUPPORTED`` only; the long run (``scripts/spelling_long_run.py``) measures
everything else. Fixed examples (hypothesis profile ``spellings-ci``, derandomized): rerunning
gives the same cases.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import event, given, settings

from onnx_moe_fuse import fuse

from .build import build_case
from .outcomes import check_equivalent, check_mutant, relative_error, session, token_shape
from .reference import reference, routing
from .strategies import (
    MUTATIONS,
    ROUTINGS,
    SMALL_BASE,
    SUPPORTED,
    UNSUPPORTED_COMBINATIONS,
    LayerCase,
    expected,
    is_supported,
    is_valid,
    layer_cases,
    multi_block_8bit,
    mutation_applies,
    supported_cases,
    supported_mutants,
    unmutated,
)

CI = settings.get_profile("spellings-ci")
LAYER_EXAMPLES = 20  # per supported routing and weight kind (float, quantized)
MUTANT_EXAMPLES = 8  # per supported mutation and routing family

# Property 1's draws, one test per routing and weight kind: a refused routing fails alone.
LAYER_KINDS = [
    pytest.param(routing, quantized, id=f"{routing}-{'quantized' if quantized else 'float'}")
    for routing in ROUTINGS
    if routing in SUPPORTED["routing"]
    for quantized in (False, True)
]
# Property 2's, one test per mutation and routing family (the bases the fused ops route
# themselves, "direct", and those that need the routing construction, "constructed").
MUTANT_KINDS = [
    pytest.param(
        mutation, constructed, id=f"{mutation}-{'constructed' if constructed else 'direct'}"
    )
    for mutation in MUTATIONS
    if mutation in SUPPORTED["mutation"]
    for constructed in (False, True)
    if mutation_applies(mutation, constructed)
]


@pytest.mark.parametrize(("routing", "quantized"), LAYER_KINDS)
def test_equivalent_layer_fuses_to_recorded_op(routing: str, quantized: bool) -> None:
    """Property 1: the recorded op and attributes, and the same numbers as ORT and numpy."""

    @settings(CI, max_examples=LAYER_EXAMPLES)
    @given(supported_cases(routing, quantized))
    def fuses(case: LayerCase) -> None:
        event(f"experts={case.experts}")
        event(f"activation={case.activation}")
        outcome = check_equivalent(case)
        assert outcome.kind == "fused", f"{case.label()}: {outcome}"

    fuses()


@pytest.mark.parametrize(("mutation", "constructed"), MUTANT_KINDS)
def test_mutant_is_refused_and_named(mutation: str, constructed: bool) -> None:
    """Property 2: byte-identical output and a near miss naming the broken part."""

    @settings(CI, max_examples=MUTANT_EXAMPLES)
    @given(supported_mutants(mutation, constructed))
    def refused(case: LayerCase) -> None:
        outcome = check_mutant(case)
        assert outcome.kind == "refused", f"{case.label()}: {outcome}"

    refused()


def refused_8bit_case(case: LayerCase) -> bool:
    """Several 8-bit blocks, in spellings that otherwise fuse (rows: see the long run)."""
    others = [p for name, p, _ in UNSUPPORTED_COMBINATIONS if p is not multi_block_8bit]
    return (
        multi_block_8bit(case)
        and case.experts != "rows_gathernd"
        and not any(p(case) for p in others)
    )


@pytest.mark.parametrize("constructed", [False, True], ids=["direct", "constructed"])
def test_multi_block_8bit_is_refused_because_ort_computes_it_inexactly(constructed: bool) -> None:
    """ORT CPU's block-wise 8-bit QMoE quantises activations: fusing would change the numbers."""

    @settings(CI, max_examples=10)
    @given(
        layer_cases(SUPPORTED)
        .filter(refused_8bit_case)
        .filter(lambda case: case.constructed == constructed)
    )
    def refused(case: LayerCase) -> None:
        built = build_case(case)
        source = built.model.SerializeToString()
        result = fuse(built.model)
        assert not result.report.fusions, case.label()
        assert result.model.SerializeToString() == source
        reasons = [m["reason"] for m in result.report.near_misses if m["part"] == "target"]
        assert any("8-bit" in r and "blocks" in r for r in reasons), result.report.near_misses
        # the layer is named: no TopK of it (Switch's twin beside its ArgMax) reads unrecognised
        every = [m["reason"] for m in result.report.near_misses]
        assert not any(r.startswith("not recognised") for r in every), every

    refused()


# -- the generator's own checks: a property is only as good as the layers it is fed ----------


@settings(CI, max_examples=80)
@given(supported_cases())
def test_built_layer_matches_numpy_reference(case: LayerCase) -> None:
    """The built ONNX layer itself computes what the reference says (before any fusion)."""
    built = build_case(case)
    sess = session(built.model)
    rng = np.random.default_rng(case.seed)
    x = rng.standard_normal(token_shape(case, rng)).astype(np.float32)
    err = relative_error(sess.run(None, {"x": x})[0], reference(case, built.params, x))
    assert err <= 1e-5, f"{case.label()}: built layer off the reference by {err:.1e}"


# Mutants that ORT can run with the base layer's feeds (no new input, no broken shapes).
RUNNABLE_MUTATIONS = frozenset(MUTATIONS) - {
    "topk_axis",
    "router_second_input",
    "weight_graph_input",
}


@settings(CI, max_examples=80)
@given(supported_mutants().filter(lambda c: c.mutation in RUNNABLE_MUTATIONS))
def test_mutant_computes_something_else(case: LayerCase) -> None:
    """A mutant breaks equivalence: ORT tells it from its base layer at the 1e-5 tolerance.

    On some inputs a mutant may agree with its base (a k = 1 layer that picks the same expert
    either way): one of eight fresh inputs must tell them apart.
    """
    base, mutant = (session(build_case(c).model) for c in (unmutated(case), case))
    rng = np.random.default_rng(case.seed)
    errors = []
    for _ in range(8):
        x = rng.standard_normal(token_shape(case, rng)).astype(np.float32)
        outs = [s.run(None, {"x": x})[0] for s in (base, mutant)]
        errors.append(relative_error(outs[1], outs[0].astype(np.float64)))
        if errors[-1] > 1e-5:
            return
    raise AssertionError(f"{case.label()}: the mutant computes its base's numbers: {errors}")


def test_every_supported_mutation_can_be_drawn() -> None:
    """Each supported mutation has a supported base to apply to (else property 2 skips it)."""
    seen: set[str] = set()

    @settings(CI, max_examples=400)
    @given(supported_mutants())
    def draw(case: LayerCase) -> None:
        assert case.mutation is not None and is_supported(case)
        assert is_valid(unmutated(case)) and expected(unmutated(case)).op in ("MoE", "QMoE")
        assert expected(case).op is None
        seen.add(case.mutation)

    draw()
    assert seen == {m for m in MUTATIONS if m in SUPPORTED["mutation"]}


def test_every_supported_spelling_can_be_drawn() -> None:
    """Property 1's strategy reaches every supported spelling of every axis."""
    seen: dict[str, set] = {axis: set() for axis in SUPPORTED if axis != "mutation"}

    @settings(CI, max_examples=500)
    @given(supported_cases())
    def draw(case: LayerCase) -> None:
        assert is_valid(case) and is_supported(case) and expected(case).op in ("MoE", "QMoE")
        for axis, value in case.axis_values().items():
            if axis in seen and value is not None:
                seen[axis].add(value)

    draw()
    assert seen == {axis: set(SUPPORTED[axis]) for axis in seen}


def test_reference_routing_renormalises() -> None:
    """The reference's renormalised routing sums to 1 per token; raw top-k does not."""
    base = LayerCase(
        router="matmul",
        routing="softmax_topk_div",
        experts="gather_expand",
        activation="relu",
        combine="mul_reducesum",
        weight_dtype="float32",
        granularity="channel",
        zero_point="absent",
        rank=2,
        shapes="static",
        hidden=16,
        inter=16,
        experts_count=6,
        top_k=3,
        token_dims=(4,),
        seed=0,
    )
    logits = np.random.default_rng(7).standard_normal((5, 6))
    for spelling in ("softmax_topk_div", "softmax_topk_reciprocal", "topk_softmax"):
        w, _ = routing(replace(base, routing=spelling), logits)
        np.testing.assert_allclose(w.sum(axis=-1), 1.0, rtol=1e-12)
    raw, idx = routing(replace(base, routing="softmax_topk_raw"), logits)
    assert (raw.sum(axis=-1) < 1.0).all() and (np.diff(raw, axis=-1) <= 0).all()
    assert idx.shape == (5, 3)


def _reference_case(routing: str, **changes: object) -> LayerCase:
    return replace(SMALL_BASE, **{"routing": routing, "experts_count": 8, "top_k": 3, **changes})


def test_reference_constructed_routings() -> None:
    """The reference's constructed routings: factors, the biased and the group-limited choice."""
    logits = np.random.default_rng(11).standard_normal((6, 8))
    params = {"routing_factor": np.array(2.5), "selection_bias": np.linspace(-0.3, 0.3, 8)}
    sigmoid = 1.0 / (1.0 + np.exp(-logits))
    for spelling in ("sigmoid_topk_renorm_scaled", "softmax_topk_scaled", "biased_selection"):
        w, _ = routing(_reference_case(spelling), logits, params)
        np.testing.assert_allclose(w.sum(axis=-1), 2.5, rtol=1e-12)
    w, idx = routing(_reference_case("sigmoid_topk"), logits)
    np.testing.assert_array_equal(w, np.sort(sigmoid, axis=-1)[:, ::-1][:, :3])
    w, idx = routing(_reference_case("argmax_top1", top_k=1), logits)
    np.testing.assert_array_equal(idx[:, 0], logits.argmax(axis=-1))
    assert (w < 1.0).all()
    w, idx = routing(_reference_case("biased_selection"), logits, params)
    chosen = np.argsort(-(sigmoid + params["selection_bias"]), axis=-1, kind="stable")[:, :3]
    np.testing.assert_array_equal(idx, chosen)  # chosen by the biased scores ...
    unbiased = np.take_along_axis(sigmoid, idx, axis=-1)
    np.testing.assert_allclose(w, 2.5 * unbiased / unbiased.sum(axis=-1, keepdims=True))
    w, idx = routing(_reference_case("softmax_bias_clamp"), logits, params)
    np.testing.assert_allclose(w.sum(axis=-1), 1.0, rtol=1e-12)
    grouped = _reference_case("grouped_topk", groups=4, topk_group=2)
    w, idx = routing(grouped, logits, params)
    assert all(len(set(row // 2)) <= 2 for row in idx)  # within 2 of the 4 groups of 2
    np.testing.assert_allclose(w.sum(axis=-1), 2.5, rtol=1e-12)
