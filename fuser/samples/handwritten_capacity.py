"""Hand-written DeepSpeed top-2 layers: a capacity dispatch that drops no token, and its traps.

DeepSpeed's ``top2gating`` (``deepspeed/moe/sharded_moe.py``) written with plain ``onnx.helper``
nodes as TorchScript spells it: two ``ArgMax`` rounds (the second over the logits with the first
choice ``masked_fill``-ed to ``-inf``), ``OneHot`` masks, ``CumSum`` locations, einsums into an
``[E, C, H]`` capacity buffer, one ReLU MLP per expert on its ``Split`` chunk, an einsum combine.
With ``C >= T`` no token is dropped and the layer is the top-2 MoE with renormalised weights;
each trap below is a near-identical layer that is not:

* ``trap_drop``: ``drop_tokens=True``, the masks times ``locations < C`` with ``C = ceil(2T/E)``;
* ``trap_small_capacity``: a constant capacity ``C = T // 2``, below the token count;
* ``trap_no_offset``: the second choice's locations not shifted past the first choice's, so a
  first-choice and a second-choice token share a capacity slot;
* ``trap_fill_zero``: the first choice masked with 0 instead of ``-inf`` (a row whose other
  logits are negative picks the same expert twice);
* ``trap_other_slot``: the second choice's combine reads the first choice's slot (another
  token's row, or an empty slot);
* ``trap_other_weight``: the second choice weighted by the first choice's weight;
* ``trap_fixed_capacity_dynamic``: a symbolic token count with a constant ``C = 2 * 16`` (as
  dynamo's dynamic export keeps the example's): more than ``C`` tokens can overflow an expert.

``dynamic`` writes a symbolic token count with ``C = 2 * Shape(logits)[0]`` (the honest layer
only). Weights are ``weights(seed)``; the tests' numpy reference reads them from the model.
"""

from __future__ import annotations

import numpy as np
import onnx

from onnx_moe_fuse.samples.handwritten_graph import Fused, Graph, HandwrittenLayer, Refused, normal

__all__ = ["CAPACITY", "deepspeed_top2"]

E, H, I_DIM = 4, 8, 12
TOKENS = 16
_FLOAT, _BOOL, _INT = onnx.TensorProto.FLOAT, onnx.TensorProto.BOOL, onnx.TensorProto.INT64

#: Each variant: what a correct fuser does.
CAPACITY = {
    "nodrop": Fused("MoE", {"k": 2, "normalize_routing_weights": 1}),
    "nodrop_dynamic": Fused("MoE", {"k": 2, "normalize_routing_weights": 1}),
    "nodrop_tight": Fused("MoE", {"k": 2, "normalize_routing_weights": 1}),
    "trap_drop": Refused("routing", "drops the tokens"),
    "trap_small_capacity": Refused("routing", "capacity C"),
    "trap_no_offset": Refused("combine", "first-choice tokens"),
    "trap_fill_zero": Refused("routing", "-inf"),
    "trap_other_slot": Refused("combine", "slots as [T, 1, C]"),
    "trap_other_weight": Refused("combine", "weight as [T, 1]"),
    "trap_fixed_capacity_dynamic": Refused("routing", "is a constant while the token count"),
}


def _locations(g: Graph, mask: str, name: str, offset: str | None) -> str:
    cum = g.op("CumSum", [mask, g.const(f"{name}_axis", np.array(0, np.int64))], f"{name}_cum")
    loc = g.op("Sub", [cum, g.const(f"{name}_one", np.array(1, np.int64))], f"{name}_loc")
    return g.op("Add", [loc, offset], f"{name}_after") if offset else loc


def deepspeed_top2(variant: str = "nodrop", seed: int = 0) -> HandwrittenLayer:
    """The DeepSpeed top-2 layer ``variant`` (a key of :data:`CAPACITY`)."""
    rng = np.random.default_rng(seed)
    dynamic = variant in ("nodrop_dynamic", "trap_fixed_capacity_dynamic")
    g = Graph(f"deepspeed_{variant}")
    x = g.input("x", ["T" if dynamic else TOKENS, H])
    logits = g.op("MatMul", [x, g.init("wg", normal(rng, [H, E], H))], "logits")
    probs = g.op("Softmax", [logits], "probs", axis=1)
    depth_e = g.const("experts", np.array(E, np.int64))
    hot = g.const("hot", np.array([0, 1], np.int64))
    idx0 = g.op("ArgMax", [probs], "idx0", axis=1, keepdims=0)
    mask0 = g.op("OneHot", [idx0, depth_e, hot], "mask0", axis=-1)
    fill = np.array(0.0 if variant == "trap_fill_zero" else -np.inf, np.float32)
    cond = g.op("Cast", [mask0], "mask0_bool", to=_BOOL)
    masked = g.op("Where", [cond, g.const("fill", fill), logits], "masked_logits")
    idx1 = g.op("ArgMax", [masked], "idx1", axis=1, keepdims=0)
    mask1 = g.op("OneHot", [idx1, depth_e, hot], "mask1", axis=-1)
    loc0 = _locations(g, mask0, "loc0", None)
    firsts = g.op("ReduceSum", [mask0, g.const("tok_axis", [0])], "firsts", keepdims=1)
    loc1 = _locations(g, mask1, "loc1", None if variant == "trap_no_offset" else firsts)
    if variant == "nodrop_dynamic":
        shape = g.op("Shape", [logits], "logits_shape")
        count = g.op("Gather", [shape, g.const("zero", np.array(0, np.int64))], "count", axis=0)
        capacity = g.op("Mul", [count, g.const("two", np.array(2, np.int64))], "capacity")
    else:
        c = {"trap_small_capacity": TOKENS // 2, "nodrop_tight": TOKENS}.get(variant, 2 * TOKENS)
        c = -(-2 * TOKENS // E) if variant == "trap_drop" else c
        capacity = g.const("capacity", np.array(c, np.int64))
    if variant == "trap_drop":
        for j, loc in enumerate((loc0, loc1)):
            keep = g.op("Less", [loc, capacity], f"keep{j}")
            keep_i = g.op("Cast", [keep], f"keep{j}_int", to=_INT)
            new = g.op("Mul", [(mask0, mask1)[j], keep_i], f"kept{j}")
            mask0, mask1 = (new, mask1) if j == 0 else (mask0, new)
    gates, slots = [], []
    for j, (mask, loc) in enumerate(((mask0, loc0), (mask1, loc1))):
        at = g.op("Mul", [loc, mask], f"loc{j}_at")
        slot = g.op("ReduceSum", [at, g.const(f"e_axis{j}", [1])], f"slot{j}", keepdims=0)
        mask_f = g.op("Cast", [mask], f"mask{j}_f", to=_FLOAT)
        gates.append((g.op("Einsum", [probs, mask_f], f"gate{j}", equation="se,se->s"), mask_f))
        slot_hot = g.op("OneHot", [slot, capacity, hot], f"slot{j}_hot")
        slots.append(g.op("Cast", [slot_hot], f"slot{j}_f", to=_FLOAT))
    total = g.op("Add", [gates[0][0], gates[1][0]], "gates_sum")
    eps = g.const("eps", np.array(np.finfo(np.float32).eps, np.float32))
    denom = g.op("Clip", [total, eps], "denom")
    combine = []
    if variant == "trap_other_slot":
        slots[1] = slots[0]
    w0 = None
    for j, ((gate, mask_f), slot_f) in enumerate(zip(gates, slots, strict=True)):
        w = g.op("Div", [gate, denom], f"w{j}")
        w0 = w0 or w
        w = w0 if variant == "trap_other_weight" else w
        spread = g.op("Einsum", [w, mask_f], f"spread{j}", equation="s,se->se")
        combine.append(g.op("Einsum", [spread, slot_f], f"combine{j}", equation="se,sc->sec"))
    weights = g.op("Add", combine, "combine_weights")
    dispatch = g.op(
        "Cast", [g.op("Cast", [weights], "dispatch_b", to=_BOOL)], "dispatch", to=_FLOAT
    )
    buffer = g.op("Einsum", [dispatch, x], "buffer", equation="sec,sm->ecm")
    chunks = g.op_multi("Split", [buffer], [f"chunk{e}" for e in range(E)], axis=0, num_outputs=E)
    outs = []
    for e, chunk in enumerate(chunks):
        w1, b1 = normal(rng, [H, I_DIM], H), normal(rng, [I_DIM], H)
        w2, b2 = normal(rng, [I_DIM, H], I_DIM), normal(rng, [H], I_DIM)
        h = g.op("MatMul", [chunk, g.init(f"w1_{e}", w1)], f"e{e}_fc1")
        h = g.op("Add", [h, g.init(f"b1_{e}", b1)], f"e{e}_fc1_b")
        a = g.op("Relu", [h], f"e{e}_act")
        y = g.op("MatMul", [a, g.init(f"w2_{e}", w2)], f"e{e}_fc2")
        outs.append(g.op("Add", [y, g.init(f"b2_{e}", b2)], f"e{e}_out"))
    stacked = g.op("Concat", outs, "expert_outputs", axis=0)
    g.op("Einsum", [weights, stacked], "y", equation="sec,ecm->sm")
    g.output("y", ["T" if dynamic else TOKENS, H])
    what = f"DeepSpeed top2gating ({variant}): argmax rounds, cumsum locations, capacity einsums"
    return HandwrittenLayer(g.model(18), what, CAPACITY[variant])
