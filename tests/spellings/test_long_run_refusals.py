"""Equivalent layers the long run found refused: each fuses now and matches its reference.

``scripts/spelling_long_run.py --examples 300 --mutants 0 --seed 18`` (2026-12-02, main) refused
equivalent layers for reasons the analysis of meaning (or a part recogniser) did not read. Each
case below is one of them (or the smallest layer with its spellings), written out as a
:class:`~.case.LayerCase`; ``check_equivalent`` fuses it and requires the expected op and
attributes and the fused model's numbers to match ORT CPU on the original and the numpy
reference (``reference.py``) on fresh random inputs within 1e-5 scale-aware. A layer refused
on purpose names its part, with no second near miss that reads "not recognised".
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from onnx_moe_fuse import fuse

from .build import build_case
from .outcomes import check_equivalent, check_mutant
from .strategies import SMALL_BASE, LayerCase, mutant_of, with_routing

RANK3 = {"rank": 3, "token_dims": (2, 3)}

CASES: list[tuple[str, LayerCase]] = [
    # GatherElements of the ids from [B, S, E] router values: the weights of a biased choice
    # on rank-3 router rows (the bias makes the rules refuse first, the analysis reads it)
    (
        "gather_elements_rank3_biased",
        replace(with_routing(SMALL_BASE, "biased_selection"), bias="e1n", **RANK3),
    ),
    (
        "gather_elements_rank3_long_run",
        LayerCase(
            router="matmul_bias",
            routing="biased_selection",
            experts="gather_reshape",
            activation="gelu_tanh_hand",
            combine="matmul_row",
            weight_dtype="float32",
            granularity="block32",
            zero_point="absent",
            rank=3,
            shapes="static",
            hidden=48,
            inter=16,
            experts_count=5,
            top_k=2,
            token_dims=(3, 3),
            seed=148,
            bias="e1n",
        ),
    ),  # fmt: skip
    # routing weights of [B, S, k] layout through renormalising arithmetic (rank-3 biases)
    ("bias_en_unsqueeze_rank3", replace(SMALL_BASE, bias="en_unsqueeze", **RANK3)),
    ("bias_e1n_rank3_relu", replace(SMALL_BASE, bias="e1n", activation="relu", **RANK3)),
    # the up projection's gathered bias is the SwiGLU's linear operand, not its beta (the
    # rank-3 per-slot form adds the biases after the unit axis is dropped)
    ("bias_after_reshape_separate_up_rank3", replace(SMALL_BASE, bias="after_reshape", **RANK3)),
    # Switch's top-1 (ArgMax and ReduceMax: twin TopKs on the copy) with biases on rank-3
    # rows: the biases are gathered by the same indices as the weights (the twin's)
    (
        "biases_argmax_top1_rank3",
        replace(with_routing(SMALL_BASE, "argmax_top1"), bias="e1n", **RANK3),
    ),
    (
        "biases_argmax_top1_rank3_split",
        replace(
            with_routing(SMALL_BASE, "argmax_top1"),
            bias="en_unsqueeze",
            activation="swiglu_split",
            **RANK3,
        ),
    ),  # fmt: skip
    # one static token at k = 1: Range(T*k) // k gathers the one row of a unit axis
    (
        "rows_range_one_token_k1",
        LayerCase(
            router="matmul",
            routing="biased_selection",
            experts="rows_range",
            activation="swiglu_exp",
            combine="einsum",
            weight_dtype="float32",
            granularity="channel",
            zero_point="explicit",
            rank=3,
            shapes="static",
            hidden=48,
            inter=48,
            experts_count=2,
            top_k=1,
            token_dims=(1, 1),
            seed=220,
            opset_version=23,
        ),
    ),  # fmt: skip
    # one static token, k = 3: the scatter's zeros accumulator has no token index either
    (
        "scatter_elements_one_token_k3",
        LayerCase(
            router="matmul_bias",
            routing="biased_selection",
            experts="rows_gathernd",
            activation="swiglu_split",
            combine="scatter_elements",
            weight_dtype="uint8",
            granularity="channel",
            zero_point="asymmetric",
            rank=2,
            shapes="static",
            hidden=48,
            inter=48,
            experts_count=3,
            top_k=3,
            token_dims=(1,),
            seed=2641,
        ),
    ),  # fmt: skip
    (
        "scatter_nd_one_token_k2",
        replace(
            SMALL_BASE,
            experts="rows_gathernd",
            combine="scatter_nd",
            shapes="static",
            token_dims=(1,),
        ),
    ),  # fmt: skip
]


@pytest.mark.parametrize("case", [c for _, c in CASES], ids=[name for name, _ in CASES])
def test_equivalent_layer_fuses_and_matches(case: LayerCase) -> None:
    outcome = check_equivalent(case, runs=3)
    assert outcome.kind == "fused", f"{case.label()}: {outcome}"


@pytest.mark.parametrize("rank", [RANK3, {}], ids=["rank3", "rank2"])
def test_top1_biases_at_other_ids_are_refused(rank: dict) -> None:
    base = replace(with_routing(SMALL_BASE, "argmax_top1"), bias="e1n", **rank)
    mutant = mutant_of(base, "bias_other_ids")
    assert mutant is not None
    outcome = check_mutant(mutant)
    assert outcome.kind == "refused", f"{mutant.label()}: {outcome}"


def test_a_refused_top1_layer_has_no_unrecognised_twin() -> None:
    # Switch's ArgMax and ReduceMax are two TopK(1) on the working copy: the layer refused on
    # purpose (8-bit in several blocks) names its target; its twin TopK is the same router
    case = replace(
        with_routing(SMALL_BASE, "argmax_top1"), weight_dtype="int8", granularity="block32",
        hidden=64, inter=32,
    )  # fmt: skip
    built = build_case(case)
    result = fuse(built.model)
    assert not result.report.fusions
    reasons = [m["reason"] for m in result.report.near_misses]
    assert reasons and all(not r.startswith("not recognised") for r in reasons), reasons
    assert any(m["part"] == "target" for m in result.report.near_misses), reasons
    assert result.model.SerializeToString() == built.model.SerializeToString()
