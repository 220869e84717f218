"""Hand-written MoE layers for every spelling issue 18 names: the "meaning" set.

Issue 18 ("recognise MoE layers by what they compute") lists the spellings a new user writes that
the form-matching rules did not know: activations and router softmaxes written out in elementary
ops, other ways of repeating the token rows, scatter combines, biases of other ranks, k = 1,
8-bit per-channel weights with FC3, the plain Qwen3-30B-A3B int4 decomposition, and an opset-29
``GroupedMatMul`` layer with ``Swish * FC3``. :data:`MEANING` holds one hand-written layer for
each (same writer and outcome records as :mod:`onnx_moe_fuse.samples.handwritten`: plain
``onnx.helper`` nodes, no project builder), and beside each family a trap that computes something
else (``trap_*``) which a correct fuser must refuse, leaving the model byte-identical and naming
the part.

``expected`` is what a correct fuser does, not what today's does; the tests
(``tests/pipeline/test_meaning_layers.py``) mark the layers today's fuser does not reach with
``xfail(strict=True)`` from one dict, ``KNOWN_UNFUSED``, with today's near miss.

.. code-block:: python

    from onnx_moe_fuse.samples.handwritten_meaning import MEANING, qwen3_flat_int4
    from onnx_moe_fuse.samples.handwritten_dense import QWEN3_30B_A3B

    model, description, expected = MEANING["rows_tile"]()
    big = qwen3_flat_int4(QWEN3_30B_A3B).model   # full size, for benchmarks (not committed)
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from onnx_moe_fuse.samples.handwritten_graph import HandwrittenLayer
from onnx_moe_fuse.samples.handwritten_meaning_act import (
    gelu_erf_by_hand,
    gelu_tanh_by_hand,
    silu_by_hand,
    softmax_by_hand,
    swiglu_by_hand,
    trap_silu_off,
    trap_softmax_token_axis,
)
from onnx_moe_fuse.samples.handwritten_meaning_pairs import (
    pair_rows_index_put,
    trap_pair_rows_expert_missing,
)
from onnx_moe_fuse.samples.handwritten_meaning_rows import (
    rows_layout,
    scatter_combine,
    split_router_flat_experts,
    top1_split,
    top1_squeezed,
    trap_rows_wrong_token,
    trap_scatter_wrong_token,
    trap_split_router_swapped,
    trap_top1_one_minus,
    trap_top1_split_one_minus,
    trap_top1_split_reversed,
)
from onnx_moe_fuse.samples.handwritten_meaning_weights import (
    bias_rank,
    gmm_swish_fc3,
    int8_channel_fc3,
    qwen3_flat_int4,
    trap_bias_other_ids,
    trap_gmm_down_other_slot,
    trap_int8_up_other_slot,
    trap_qwen3_weights_slot_major,
)

__all__ = ["MEANING", "FAMILIES", "qwen3_flat_int4", "meaning_layer"]

#: Every layer of the meaning set by name, grouped by the family of issue 18's "Why" it tests.
MEANING: dict[str, Callable[[], HandwrittenLayer]] = {
    # activations and the router softmax written out by hand
    "act_silu_by_hand": silu_by_hand,
    "act_swiglu_by_hand": swiglu_by_hand,
    "act_gelu_erf_by_hand": gelu_erf_by_hand,
    "act_gelu_tanh_by_hand": gelu_tanh_by_hand,
    "trap_act_silu_off": trap_silu_off,
    "softmax_by_hand_max": partial(softmax_by_hand, True),
    "softmax_by_hand_nomax": partial(softmax_by_hand, False),
    "trap_softmax_token_axis": trap_softmax_token_axis,
    # token rows repeated before the experts
    "rows_tile": partial(rows_layout, "tile"),
    "rows_gather_range": partial(rows_layout, "gather_range"),
    "rows_concat": partial(rows_layout, "concat"),
    "rows_expand": partial(rows_layout, "expand"),
    "trap_rows_wrong_token": trap_rows_wrong_token,
    # scatter combines
    "combine_scatter_elements": partial(scatter_combine, "scatter_elements"),
    "combine_scatter_nd": partial(scatter_combine, "scatter_nd"),
    "trap_scatter_wrong_token": trap_scatter_wrong_token,
    # bias ranks
    "bias_en_unsqueeze": partial(bias_rank, "en_unsqueeze"),
    "bias_e1n": partial(bias_rank, "e1n"),
    "bias_after_reshape": partial(bias_rank, "after_reshape"),
    "trap_bias_other_ids": trap_bias_other_ids,
    # k = 1
    "top1_squeezed": top1_squeezed,
    "trap_top1_one_minus": trap_top1_one_minus,
    "top1_split": top1_split,
    "trap_top1_split_one_minus": trap_top1_split_one_minus,
    "trap_top1_split_reversed": trap_top1_split_reversed,
    "split_router_flat_experts": split_router_flat_experts,
    "trap_split_router_swapped": trap_split_router_swapped,
    # expert rows written back by a boolean index_put (element-wise ScatterND)
    "pair_rows_index_put": pair_rows_index_put,
    "trap_pair_rows_expert_missing": trap_pair_rows_expert_missing,
    # 8-bit per-channel weights with FC3
    "int8_channel_fc3": int8_channel_fc3,
    "trap_int8_up_other_slot": trap_int8_up_other_slot,
    # the plain Qwen3-30B-A3B int4 decomposition (tiny dims)
    "qwen3_flat_int4": qwen3_flat_int4,
    "trap_qwen3_weights_slot_major": trap_qwen3_weights_slot_major,
    # opset 29: GroupedMatMul + Swish * FC3
    "gmm_swish_fc3": gmm_swish_fc3,
    "trap_gmm_down_other_slot": trap_gmm_down_other_slot,
}

#: Each family of issue 18's "Why" and the layers (traps included) that test it.
FAMILIES: dict[str, tuple[str, ...]] = {
    "activation": ("act_silu_by_hand", "act_swiglu_by_hand", "act_gelu_erf_by_hand",
                   "act_gelu_tanh_by_hand", "trap_act_silu_off"),
    "softmax": ("softmax_by_hand_max", "softmax_by_hand_nomax", "trap_softmax_token_axis"),
    "rows": ("rows_tile", "rows_gather_range", "rows_concat", "rows_expand",
             "trap_rows_wrong_token"),
    "scatter": ("combine_scatter_elements", "combine_scatter_nd", "trap_scatter_wrong_token"),
    "bias": ("bias_en_unsqueeze", "bias_e1n", "bias_after_reshape", "trap_bias_other_ids"),
    "k1": ("top1_squeezed", "trap_top1_one_minus", "top1_split", "trap_top1_split_one_minus",
           "trap_top1_split_reversed"),
    "split_router": ("split_router_flat_experts", "trap_split_router_swapped"),
    "pair_rows": ("pair_rows_index_put", "trap_pair_rows_expert_missing"),
    "int8_fc3": ("int8_channel_fc3", "trap_int8_up_other_slot"),
    "qwen3_flat": ("qwen3_flat_int4", "trap_qwen3_weights_slot_major"),
    "opset29": ("gmm_swish_fc3", "trap_gmm_down_other_slot"),
}  # fmt: skip


def meaning_layer(name: str) -> HandwrittenLayer:
    """Build the meaning-set layer ``name`` (a key of :data:`MEANING`)."""
    try:
        return MEANING[name]()
    except KeyError:
        raise KeyError(f"no meaning-set layer {name!r}; choose among {list(MEANING)}") from None
