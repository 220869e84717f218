"""Routers whose selection or weights are not a plain TopK's values, read by the analysis.

PhiMoE's argmax rounds (the weights a Concat of per-round gathers) and DeepSeek-V3's grouped
gate (reshaped, masked with ``Where``, the weights gathered from other scores) must fuse into one
MoE and match the original in ORT CPU within 1e-5 scale-aware on fresh random tokens at two
token counts; each trap must be left byte-identical with a near miss naming a part and a node.
"""

from __future__ import annotations

import pytest

import onnx_moe_fuse
from tests.rewrites.canonical.experts.meaning_checks import assert_fuses, assert_refused
from tests.rewrites.canonical.experts.round_models import (
    GROUPED_TRAPS,
    ROUND_TRAPS,
    grouped_layer,
    rounds_layer,
)


def test_argmax_rounds_fuse() -> None:
    assert_fuses(rounds_layer(seed=11), seed=11)


@pytest.mark.parametrize("trap", ROUND_TRAPS)
def test_argmax_round_traps_refused(trap: str) -> None:
    assert_refused(rounds_layer(trap=trap, seed=12))
    misses = onnx_moe_fuse.fuse(rounds_layer(trap=trap, seed=12)).report.near_misses
    if trap == "weights_swapped":  # the rounds are a selection; the weights are not its slots
        assert any(m["part"] == "combine" and m["node"].startswith("Mul") for m in misses)
    else:  # the rounds' indices joined, but round 2 is not column 2 of a top-k
        named = [m for m in misses if m["part"] == "routing" and m["node"].startswith("Concat")]
        assert named and "not the columns of one top-k" in named[0]["reason"], misses


def test_grouped_router_with_expert_loop_fuses() -> None:
    assert_fuses(grouped_layer(seed=13), seed=13)


def test_static_zeros_accumulator_with_as_many_tokens_as_experts() -> None:
    """``zeros_like(x)`` of T = E = 4 rows is the accumulator, not a stack of expert biases."""
    assert_fuses(grouped_layer(seed=14, static_tokens=4), seed=14, token_counts=(4,))


@pytest.mark.parametrize("trap", GROUPED_TRAPS)
def test_grouped_router_traps_refused(trap: str) -> None:
    miss = assert_refused(grouped_layer(trap=trap, seed=15))
    assert miss["part"] == "routing", miss
