"""The analysis of meaning names the router or the weights where an operand it never reached decides.

``rewrites/canonical/experts/meaning/undescribed.py``: on bases that only the analysis of
meaning fuses (k = 1 squeezed, Tile rows, Range rows), a router reading other rows than the
experts is refused as part ``routing`` ("the router reads other rows than the experts") and
FC1 weights that are a graph input as part ``weights`` ("expert weights not constant"), each
at the node where the experts read them; the model stays byte-identical.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from onnx_moe_fuse import fuse

from .build import build_case
from .case import SMALL_BASE
from .outcomes import check_equivalent, fused_nodes

# SMALL_BASE at k = 1 in spellings only the analysis of meaning fuses (squeezed rows, a SiLU
# written out)
BASE = replace(
    SMALL_BASE,
    experts="top1_squeezed",
    activation="silu_exp",
    inter=16,
    top_k=1,
    token_dims=(3,),
    seed=7,
)
BASES = {
    "top1_squeezed": BASE,
    "rows_tile": replace(BASE, experts="rows_tile", top_k=2),
    "rows_range_int4": replace(BASE, experts="rows_range", top_k=2, weight_dtype="int4"),
}
WORDS = {
    "router_token_slice": ("routing", "the router reads other rows than the experts"),
    "router_second_input": ("routing", "the router reads other rows than the experts"),
    "weight_graph_input": ("weights", "expert weights not constant"),
}


@pytest.mark.parametrize("base", sorted(BASES))
@pytest.mark.parametrize("mutation", sorted(WORDS))
def test_departure_names_the_router_or_the_weights(base: str, mutation: str) -> None:
    case = BASES[base]
    assert check_equivalent(case).kind == "fused", case.label()  # the base fuses
    model = build_case(replace(case, mutation=mutation)).model
    source = model.SerializeToString()
    result = fuse(model)
    assert not fused_nodes(result.model) and result.model.SerializeToString() == source
    part, words = WORDS[mutation]
    named = [m for m in result.report.near_misses if m["part"] == part and words in m["reason"]]
    assert named, result.report.near_misses
    assert all(m["node"] for m in named)


def test_a_switch_layer_refused_for_the_target_has_no_unrecognised_twin() -> None:
    """Switch's ReduceMax TopK beside its ArgMax's is the same selection: one near miss, named."""
    case = replace(
        BASE, routing="argmax_top1", experts="dense_equal", activation="swiglu_split",
        combine="einsum", weight_dtype="int8", granularity="block32", hidden=32, inter=64,
    )  # fmt: skip
    result = fuse(build_case(case).model)
    reasons = [m["reason"] for m in result.report.near_misses]
    assert any("8-bit" in r for r in reasons), reasons
    assert not any(r.startswith("not recognised") for r in reasons), reasons
