"""The spelling axes of a generated MoE layer, its mutations, and which spellings each one needs.

Data (split out of ``strategies.py``, which re-exports every name): one tuple of
spellings per part of the layer, the :data:`MUTATIONS` that break a layer in one place, the part
each breaks (:data:`MUTATION_PART`), the spellings each applies to (:data:`MUTATION_NEEDS`)
and the sizes it needs to change a layer (:data:`NEEDS_TWO_TOKENS`, :func:`needs_two_slots`).
``build.py`` / ``build_routing.py`` / ``build_experts.py`` write each spelling;
``reference.py`` computes it.
"""

from __future__ import annotations

ROUTERS = ("matmul", "matmul_bias", "gemm_transb", "einsum")

#: Routings ORT's MoE/QMoE softmax computes itself (softmax over E, top-k, renormalised or not).
SOFTMAX_ROUTINGS = (
    "softmax_topk_div",  # Softmax, TopK, Div by the ReduceSum of the k values
    "softmax_topk_reciprocal",  # the same, Mul by the Reciprocal of the sum
    "topk_softmax",  # TopK of the logits, Softmax of the k values
    "softmax_topk_raw",  # Softmax, TopK, the k values as they are
)
#: Routings the fused node takes through the routing construction (``docs/routing.md``): the
#: router stays in the graph, the node is fed routing inputs built from its TopK ids and weights.
#: Those weighing by the TopK's values:
VALUE_ROUTINGS = (
    "sigmoid_topk",  # Sigmoid, TopK, the k values as they are (Llama4-style scores)
    "sigmoid_topk_renorm_scaled",  # Sigmoid, TopK, values / (ReduceSum + 1e-20) * factor
    "softmax_topk_scaled",  # Softmax, TopK, values / ReduceSum * factor
    "argmax_top1",  # Switch: TopK(k=1) of the Softmax, the max probability as it is
)
#: ... and those weighing by ``GatherElements(scores, ids)`` of unbiased scores, the ids chosen
#: on biased ones:
GATHER_ROUTINGS = (
    "biased_selection",  # DeepSeek-V3 / GLM-4.5 without groups: Sigmoid; TopK(scores + bias)
    "grouped_topk",  # DeepSeek-V3 / Dots1: the biased choice limited to the top groups
    "softmax_bias_clamp",  # ERNIE-4.5: Softmax; TopK(probs + bias); / Clip(ReduceSum, 1e-12)
)
CONSTRUCTED_ROUTINGS = VALUE_ROUTINGS + GATHER_ROUTINGS
ROUTINGS = SOFTMAX_ROUTINGS + CONSTRUCTED_ROUTINGS
#: Routings whose weights are the top-k scores as they are (no renormalisation, no factor).
UNNORMALISED_ROUTINGS = frozenset({"softmax_topk_raw", "sigmoid_topk", "argmax_top1"})
#: Routings that read a Softmax of the logits (the rest: a Sigmoid, or topk_softmax's after).
SOFTMAX_SCORED = frozenset(
    {
        "softmax_topk_div",
        "softmax_topk_reciprocal",
        "topk_softmax",
        "softmax_topk_raw",
        "softmax_topk_scaled",
        "argmax_top1",
        "softmax_bias_clamp",
    }
)

EXPERTS = (
    "gather_expand",  # Gather(W, idx), Unsqueeze + Expand the tokens, MatMul, Squeeze
    "gather_reshape",  # the same, the unit axis dropped by Reshape
    "transpose_weights",  # output-major [E, N, K] weights, Transpose in the graph
    "einsum",  # Einsum of the tokens with the gathered weights
    "rows_gathernd",  # torch batched_mm export: T*k rows, GatherND by flat ids, batched MatMul
    "dense_onehot",  # every expert on every token, combine masked by OneHot
    "dense_equal",  # every expert on every token, combine masked by Equal/Cast
    # the T*k rows of rows_gathernd repeated other ways (issue 18's row layouts):
    "rows_tile",  # Tile(x, [1, k]) then Reshape [-1, H]
    "rows_range",  # Gather(x, Range(T*k) // k)
    "rows_concat",  # Concat of k copies of x (axis 1) then Reshape [-1, H]
    "top1_squeezed",  # k = 1 with the slot axis squeezed away: ids [T], weights Gather-ed [T, K, N]
)
#: The flattened-rows layouts (T*k rows, GatherND of the weights by the flat ids).
ROW_EXPERTS = frozenset({"rows_gathernd", "rows_tile", "rows_range", "rows_concat"})
#: The per-slot layouts: ``[*, k, N]`` projections of the tokens broadcast to the k slots.
PER_SLOT_EXPERTS = frozenset({"gather_expand", "gather_reshape", "transpose_weights", "einsum"})
#: The per-slot layouts a bias of any rank is written for (``BIASES``).
BIAS_EXPERTS = frozenset({"gather_expand", "gather_reshape", "transpose_weights"})
ACTIVATIONS = (
    "swiglu_separate",  # gate and up from separate experts
    "swiglu_split",  # one FC1, Split into halves
    "swiglu_slice",  # one FC1, Slice halves
    "swiglu_strided",  # one FC1, step-2 Slices (interleaved)
    "swish",  # the Swish op (opset 24)
    "silu_x_sigmoid",  # Mul(x, Sigmoid(x))
    "silu_sigmoid_x",  # Mul(Sigmoid(x), x)
    "relu",
    "gelu_tanh",  # Gelu(approximate="tanh")
    "swiglu_oss",  # gpt-oss: strided, clamp 7, alpha 1.702, +1 on the linear side
    # written out by hand in elementary ops (issue 18):
    "silu_exp",  # h / (1 + Exp(-h))
    "swiglu_exp",  # one FC1 Split into halves, gate / (1 + Exp(-gate)) * up
    "gelu_tanh_hand",  # 0.5 h (1 + Tanh(sqrt(2/pi) (h + 0.044715 Pow(h, 3))))
)
#: The activations written out by hand with Exp (the ``silu_off`` mutation's bases).
COMBINES = (
    "mul_reducesum",
    "matmul_row",
    "einsum",
    # [B, S] tokens flattened for the experts, the mix split back: over [E, B, S, H] (dense,
    # optimum's dense gpt-oss) or [B, S, k, H] (per slot)
    "split_rows",
    # the weighted rows summed into their tokens (index_add_ exports), rows layouts only:
    "scatter_elements",  # ScatterElements(zeros, token_of_row, rows, axis 0, reduction add)
    "scatter_nd",  # ScatterND(zeros, token_of_row[:, None], rows, reduction add)
)
SCATTERS = frozenset({"scatter_elements", "scatter_nd"})
#: Combines that only some layouts write: combine -> (the experts, the ranks) it needs.
COMBINE_NEEDS = {
    "split_rows": (
        frozenset({"dense_onehot", "dense_equal", "gather_expand", "gather_reshape",
                   "transpose_weights", "einsum"}),
        frozenset({3}),
    ),
    "scatter_elements": (ROW_EXPERTS, frozenset({2, 3})),
    "scatter_nd": (ROW_EXPERTS, frozenset({2, 3})),
}  # fmt: skip
#: Per-expert FC1/FC2 biases (issue 18's bias ranks): none, ``[E, N]`` gathered by the ids
#: then Unsqueeze-d to ``[*, k, 1, N]``, stored ``[E, 1, N]`` (gathered to ``[*, k, 1, N]``),
#: or ``[E, N]`` gathered and added after the unit axis is dropped (``[*, k, N]``).
BIASES = ("none", "en_unsqueeze", "e1n", "after_reshape")
WEIGHT_DTYPES = ("float32", "int4", "uint4", "int8", "uint8")
GRANULARITIES = ("channel", "block32")  # scales per output channel, or per block of 32 along K
# explicit: 0 signed, 8 uint4, 128 uint8 (the symmetric point); asymmetric: one below it in a
# random half of the blocks (the codes shifted with it: the same weights), so the fused QMoE
# needs zero-point inputs (ort-cpu takes them)
ZERO_POINTS = ("absent", "explicit", "asymmetric")
RANKS = (2, 3)
OPSETS = (21, 22, 23)
SHAPES = ("static", "symbolic")

MUTATIONS = (
    "softmax_axis",  # the router Softmax normalises over another axis than the experts
    "topk_axis",  # TopK selects along another axis than the experts
    # the SiLU's factor is the up projection (up * sigmoid(gate) * up); gpt-oss's sigmoid reads
    # the clamped up instead of the gate (its other terms make that no swapped SwiGLU either)
    "swap_gate_up",
    "fc2_other_indices",  # FC2 gathers experts by other indices than FC1
    "erf_gelu",  # exact (erf) GELU where MoE's gelu is the tanh approximation
    "dropped_clamp",  # gpt-oss SwiGLU with the gate clamp removed (the linear clamp kept)
    "router_second_input",  # the router reads a second graph input, not the tokens
    "router_token_slice",  # the router reads the tokens reversed along the token axis
    "weight_graph_input",  # FC1's weights (or codes) are a graph input, not a constant
    # the routing weights are not the per-selected non-negative weights of this TopK:
    "weights_other_experts",  # taken at other experts than the ids FC1/FC2 gather
    "weights_other_token",  # taken from the next token's row (rolled along the token axis)
    "negative_weight",  # can be negative (raw logits, or the weights minus 0.5)
    "capacity_drop",  # zeroed past an expert capacity of 1 token (Switch/GShard dropping)
    "silu_off",  # the hand-written SiLU off by a constant: h / (1 + Exp(-1.1 h))
    "scatter_other_token",  # the scatter adds each row into the next row's token (slot k-1: t+1)
    "rows_other_token",  # the rows gathered by Range(T*k) % T: slot j of token t reads another
    "bias_other_ids",  # the biases gathered by (ids + 1) mod E, not by each slot's expert
)

# The part each mutation breaks; the fuser's near miss must name it (outcomes.PART_WORDS).
MUTATION_PART = {
    "softmax_axis": "routing",
    "topk_axis": "routing",
    "swap_gate_up": "activation",
    "fc2_other_indices": "experts",
    "erf_gelu": "activation",
    "dropped_clamp": "activation",
    "router_second_input": "router",
    "router_token_slice": "router",
    "weight_graph_input": "weights",
    "weights_other_experts": "routing",
    "weights_other_token": "routing",
    "negative_weight": "routing",
    "capacity_drop": "routing",
    "silu_off": "activation",
    "scatter_other_token": "combine",
    "rows_other_token": "tokens",
    "bias_other_ids": "experts",
}

#: Mutations that tell their layer from its base only with two or more tokens (on a token axis
#: they read across: reversed, rolled, softmaxed or counted over tokens).
NEEDS_TWO_TOKENS = frozenset(
    {
        "router_token_slice",
        "softmax_axis",
        "weights_other_token",
        "capacity_drop",
        "scatter_other_token",
        "rows_other_token",
    }
)


def needs_two_slots(mutation: str | None, routing: str) -> bool:
    """Whether ``mutation`` on ``routing`` changes the layer only with two or more slots.

    Reversing the k slots of one is no change, and neither is taking another token's weight
    where the routing renormalises the k weights (one renormalised weight is 1, or the factor).
    """
    # k = 1: row r is token r, and a scatter only permutes the finished rows
    if mutation in ("weights_other_experts", "rows_other_token", "scatter_other_token"):
        return True
    return mutation == "weights_other_token" and routing not in UNNORMALISED_ROUTINGS


SWIGLU = frozenset(a for a in ACTIVATIONS if a.startswith("swiglu"))
GATHERED = frozenset(e for e in EXPERTS if not e.startswith("dense"))
QUANTIZED = frozenset(WEIGHT_DTYPES) - {"float32"}

# Mutations that only make sense on some spellings: axis -> the spellings they need.
MUTATION_NEEDS: dict[str, dict[str, frozenset]] = {
    "softmax_axis": {"routing": SOFTMAX_SCORED},
    "swap_gate_up": {"activation": SWIGLU},
    "fc2_other_indices": {"experts": GATHERED},
    "erf_gelu": {"activation": frozenset({"gelu_tanh"}), "weight_dtype": frozenset({"float32"})},
    "dropped_clamp": {"activation": frozenset({"swiglu_oss"})},
    "weights_other_experts": {"routing": frozenset(ROUTINGS) - {"argmax_top1"}},
    # SiLU only: SwiGLU's gate / (1 + Exp(-a gate)) is the fused swiglu with alpha a (1.01 fused
    # exactly, measured 1e-7); the fused silu has no alpha
    "silu_off": {"activation": frozenset({"silu_exp"})},
    "scatter_other_token": {"combine": SCATTERS},
    "rows_other_token": {"experts": ROW_EXPERTS},
    "bias_other_ids": {"bias": frozenset(BIASES) - {"none"}},
}
