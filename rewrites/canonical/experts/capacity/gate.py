"""Read DeepSpeed's ``top2gating`` (``deepspeed/moe/sharded_moe.py``), proving what it computes.

Used by :mod:`.capacity_dispatch`. The gate, as the spelling passes leave it (``ArgMax`` is a
``TopK(·, 1)``, the einsums are lowered)::

    P      = Softmax(L)                       L: router logits, a projection of the tokens
    idx_0  = TopK(P, 1)                       mask_0 = one_hot(idx_0, E)      (int)
    idx_1  = TopK(Where(mask_0, -inf, L), 1)  mask_1 = one_hot(idx_1, E)
    loc_0  = sum_e (CumSum(mask_0, 0) - 1) * mask_0
    loc_1  = sum_e (CumSum(mask_1, 0) - 1 + sum_t mask_0) * mask_1
    g_j    = sum_e P * mask_j                 (einsum "se,se->s")
    w_j    = g_j / Clip(g_0 + g_1, eps)
    W      = sum_j (w_j * mask_j)[t, e] * one_hot(loc_j, C)[t, c]       [T, E, C]

What is proved, and why it is the per-slot top-2 layer:

* rounds: ``idx_0`` is column 0 and ``idx_1`` column 1 of ``TopK(P, 2)``. Round 0 is TopK's
  first column (both take the largest, lowest index on ties). Round 1 is the argmax of the
  logits with expert ``idx_0`` at ``-inf``; ``L`` is a projection of finite tokens, so with
  ``E >= 2`` it is the largest remaining logit, which is the second largest probability
  because Softmax is monotone. Ties: an exact tie of two logits picks the lower index in both;
  a tie that only the rounding of Softmax makes (two logits a few ulps apart giving one
  probability) can pick differently, as every fused top-k does (docs: routing ties).
* weights: ``g_j`` is ``P`` at ``idx_j`` (a sum of one product by 1 and exact zeros), so
  ``w_j`` is ``v_j / (v_0 + v_1)`` with ``v = TopK(P, 2).values``: ``Clip`` never binds, since
  the two largest of ``E`` probabilities summing to 1 add up to at least ``2 / E``, and the
  clip's min must be at most ``1 / E``.
* capacity: for each expert, the first-choice tokens get locations ``0..n0_e - 1`` in token
  order (a cumulative sum of a 0/1 mask minus 1 grows by one at each token it selects), the
  second-choice tokens ``n0_e..n0_e + n1_e - 1``: distinct. A token picks an expert at most
  once (``idx_1 != idx_0``), so ``n0_e + n1_e <= T``: every location is below ``T``. The
  one-hot of the locations has a column for it when the capacity ``C >= T`` (a constant at
  least the static token count, or ``k * T`` read from the scores' shape): no token is
  dropped. A gate that masks the one-hots by ``locations < capacity`` (``drop_tokens=True``)
  does not read as this and is refused, naming the node.

Every structural constant (axes, depth, one-hot values, ranges, the fill, the clip) is
checked; a failed proof raises a :class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal` naming
the part and node.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.capacity.reads import (
    cast_of,
    lowered_dot,
    one_hot_of,
    single,
    unsqueeze_of,
    users_of,
)
from onnx_moe_fuse.rewrites.canonical.experts.dense.consts import is_op, other_operand
from onnx_moe_fuse.rewrites.graph.facts import (
    attr_float,
    attr_int,
    const_array,
    const_float,
    label,
    node_axes,
)
from onnx_moe_fuse.rewrites.graph.refusals import Refusal, part
from onnx_moe_fuse.rewrites.graph.selection_rounds import is_router_projection
from onnx_moe_fuse.rewrites.graph.symbolic_dims import value_dims

__all__ = ["Top2Gate", "first_round", "read_gate"]


@dataclass
class Top2Gate:
    """A proved DeepSpeed top-2 gate: what the rewrite reads and what it replaces."""

    logits: ir.Value  # L [T, E]
    probs: ir.Value  # P = Softmax(L)
    rounds: tuple[ir.Node, ir.Node]  # the two TopK(·, 1)
    combine: ir.Value  # W [T, E, C]
    experts: int
    capacity: ir.Value | int  # the one-hot depth of the locations (or the range's size)


def _top1(node: ir.Node | None) -> bool:
    if not is_op(node, "TopK") or len(node.inputs) < 2 or len(node.outputs) < 2:
        return False
    k = const_array(node.inputs[1])
    rank = len(value_dims(node.inputs[0]) or ())
    axis = attr_int(node, "axis", -1)
    return (
        k is not None
        and k.size == 1
        and int(k.reshape(-1)[0]) == 1
        and attr_int(node, "largest", 1) == 1
        and rank == 2
        and axis is not None
        and axis % 2 == 1
    )


def first_round(topk: ir.Node) -> ir.Value | None:
    """The logits ``L`` when ``topk`` is ``TopK(Softmax(L), 1)`` over the experts, else None."""
    if not _top1(topk):
        return None
    softmax = topk.inputs[0].producer()
    if not is_op(softmax, "Softmax") or attr_int(softmax, "axis", -1) % 2 != 1:
        return None
    logits = softmax.inputs[0]
    return logits if is_router_projection(logits) else None


def _all_minus_inf(value: ir.Value | None) -> bool:
    arr = const_array(value)
    return arr is not None and arr.size > 0 and bool(np.all(np.isneginf(arr.astype(np.float64))))


def _second_round(mask0: ir.Value, bool0: ir.Value | None, logits: ir.Value, e: int) -> ir.Node:
    """The ``TopK(Where(mask_0, -inf, L), 1)`` of round 1 (the masked_fill of the logits)."""
    conds = [v for v in (bool0,) if v is not None]
    conds += [n.outputs[0] for n in users_of(mask0) if cast_of(n, ir.DataType.BOOL)]
    wheres = [n for c in conds for n in users_of(c) if is_op(n, "Where") and n.inputs[0] is c]
    where = single(wheres, mask0, "the first choice's mask masks no logits (a Where)")
    if where.inputs[2] is not logits or not _all_minus_inf(where.inputs[1]):
        raise Refusal(f"{label(where)}: not the router logits with the first choice at -inf", where)
    if e < 2:
        raise Refusal(f"{label(where)}: a second choice among {e} experts", where)
    topk = single([n for n in users_of(where.outputs[0]) if _top1(n)], where, "no argmax")
    return topk


def _clip_never_binds(clip: ir.Node, experts: int) -> bool:
    low = const_float(clip.inputs[1]) if len(clip.inputs) > 1 and clip.inputs[1] else None
    if low is None:
        low = attr_float(clip, "min", None)
    high = clip.inputs[2] if len(clip.inputs) > 2 else None
    if high is not None or clip.attributes.get("max") is not None:
        return False
    return low is not None and low <= 1.0 / experts


def _weights(mask_f: tuple[ir.Value, ir.Value], probs: ir.Value, experts: int):
    """``w_j = g_j / Clip(g_0 + g_1, eps)`` with ``g_j = sum_e P * mask_j``: the two ``w_j``."""
    sums = []
    for j, m in enumerate(mask_f):
        found = [s for s in lowered_dot(probs, m)]
        sums.append(single(found, m, f"choice {j}'s probability (sum_e P * mask) is not read"))
    adds = [
        n for n in users_of(sums[0]) if is_op(n, "Add") and other_operand(n, sums[0]) is sums[1]
    ]
    add = single(adds, sums[0], "the two choices' probabilities are not added")
    clip = single(users_of(add.outputs[0]), add, "the sum of the two probabilities")
    if not is_op(clip, "Clip") or not _clip_never_binds(clip, experts):
        raise Refusal(
            f"{label(clip)}: not a clamp at a min of at most 1/E = {1 / experts:.3g} "
            "(the sum of the top-2 probabilities is at least 2/E)",
            clip,
        )
    out = []
    for j, s in enumerate(sums):
        divs = [
            n
            for n in users_of(s)
            if is_op(n, "Div") and n.inputs[0] is s and n.inputs[1] is clip.outputs[0]
        ]
        out.append(
            single(divs, s, f"choice {j}'s probability is not divided by the sum").outputs[0]
        )
    return out


def _locations(mask: ir.Value, offset_mask: ir.Value | None, t: ir.Node) -> ir.Value:
    """``sum_e (CumSum(mask, 0) - 1 (+ sum_t offset_mask)) * mask`` over the experts' axis."""
    cums = [n for n in users_of(mask) if is_op(n, "CumSum")]
    cum = single(cums, mask, "the mask is not numbered by a CumSum over the tokens")
    axis = const_array(cum.inputs[1])
    if axis is None or int(axis.reshape(-1)[0]) % 2 != 0 or attr_int(cum, "exclusive", 0):
        raise Refusal(f"{label(cum)}: not an inclusive CumSum over the tokens", cum)
    if attr_int(cum, "reverse", 0):
        raise Refusal(f"{label(cum)}: a reversed CumSum", cum)
    sub = single(users_of(cum.outputs[0]), cum, "the count")
    if (
        not is_op(sub, "Sub")
        or sub.inputs[0] is not cum.outputs[0]
        or const_float(sub.inputs[1]) != 1
    ):
        raise Refusal(f"{label(sub)}: the count minus 1 is not the location", sub)
    located = sub.outputs[0]
    if offset_mask is not None:
        add = single(users_of(located), sub, "the second choice's locations")
        col = other_operand(add, located) if is_op(add, "Add") else None
        red = col.producer() if col is not None else None
        if (
            not is_op(red, "ReduceSum")
            or red.inputs[0] is not offset_mask
            or node_axes(red) not in ([0], [-2])
            or attr_int(red, "keepdims", 1) != 1
        ):
            raise Refusal(
                f"{label(add)}: the second choice's locations do not start after every "
                "expert's first-choice tokens (+ sum over the tokens of mask_0)",
                add,
            )
        located = add.outputs[0]
    muls = [n for n in users_of(located) if is_op(n, "Mul") and other_operand(n, located) is mask]
    mul = single(muls, located, "the locations are not taken at the chosen expert (* mask)")
    red = single(users_of(mul.outputs[0]), mul, "the chosen expert's location")
    if (
        not is_op(red, "ReduceSum")
        or node_axes(red) not in ([1], [-1])
        or attr_int(red, "keepdims", 1)
    ):
        raise Refusal(f"{label(red)}: not the sum over the experts of the located mask", red)
    return red.outputs[0]


def _capacity_holds(depth: ir.Value | int, tokens: ir.Value, at: ir.Node) -> None:
    """The capacity ``C`` (the one-hot depth) is at least the token count ``T``."""
    dims = value_dims(tokens)
    t_dim = dims[0] if dims else None
    c = depth if isinstance(depth, int) else const_array(depth)
    if c is not None:
        c = int(np.asarray(c).reshape(-1)[0])
        if t_dim is not None and not t_dim.syms and c >= t_dim.coef:
            return
        raise Refusal(
            f"{label(at)}: the capacity C = {c} is a constant while the "
            f"token count is {t_dim}; a location reaches T - 1, so tokens past C would be "
            "dropped (a capacity limit)",
            at,
            part="routing",
        )
    mul = depth.producer() if isinstance(depth, ir.Value) else None
    if is_op(mul, "Mul"):
        for a, b in (mul.inputs, mul.inputs[::-1]):
            k = const_array(b)
            if (
                k is not None
                and k.size == 1
                and int(k.reshape(-1)[0]) >= 1
                and _token_count(a, tokens)
            ):
                return
    raise Refusal(
        f"{label(at)}: the capacity is not proved at least the token count", at, part="routing"
    )


def _static(depth: ir.Value | int) -> int | None:
    arr = np.asarray(depth) if isinstance(depth, int) else const_array(depth)
    return None if arr is None else int(arr.reshape(-1)[0])


def _token_count(value: ir.Value, tokens: ir.Value) -> bool:
    """``value`` is ``Shape(v)[0]`` of a value ``v`` whose leading dim is the tokens'."""
    gather = value.producer()
    if not is_op(gather, "Gather") or attr_int(gather, "axis", 0) != 0:
        return False
    index = const_array(gather.inputs[1])
    shape = gather.inputs[0].producer()
    if (
        index is None
        or index.size != 1
        or int(index.reshape(-1)[0]) != 0
        or not is_op(shape, "Shape")
    ):
        return False
    if attr_int(shape, "start", 0) != 0:
        return False
    src = value_dims(shape.inputs[0])
    want = value_dims(tokens)
    return bool(src and want) and src[0] == want[0]


def read_gate(round0: ir.Node, logits: ir.Value) -> Top2Gate:
    """Prove the top-2 gate from round 0 ``TopK(Softmax(L), 1)`` to the combine tensor ``W``."""
    probs = round0.inputs[0]
    dims = value_dims(logits)
    experts = dims[1].coef if dims and len(dims) == 2 and not dims[1].syms else None
    if experts is None:
        raise Refusal(f"{label(round0)}: the experts' count is not static", round0, part="routing")
    with part("routing"):
        mask0, bool0 = one_hot_of(round0.outputs[1], experts)
        round1 = _second_round(mask0, bool0, logits, experts)
        mask1, _ = one_hot_of(round1.outputs[1], experts)
    with part("combine"):
        for m in (mask0, mask1):
            _refuse_capacity_drop(m)
        mask_f = tuple(
            single(
                [n.outputs[0] for n in users_of(m) if cast_of(n, ir.DataType.FLOAT)],
                m,
                f"choice {j}'s mask as float",
            )
            for j, m in enumerate((mask0, mask1))
        )
        weights = _weights(mask_f, probs, experts)  # type: ignore[arg-type]
        locations = (_locations(mask0, None, round0), _locations(mask1, mask0, round1))
        terms, depths = [], []
        for j in range(2):
            row = single(
                unsqueeze_of(weights[j], 1, 1), weights[j], f"choice {j}'s weight as [T, 1]"
            )
            muls = [
                n for n in users_of(row) if is_op(n, "Mul") and other_operand(n, row) is mask_f[j]
            ]
            gates = single(muls, row, f"choice {j}'s weight times its mask").outputs[0]
            loc_hot, depth, hot = _location_one_hot(locations[j])
            depths.append((depth, hot))
            gates_3 = single(unsqueeze_of(gates, 2, 2), gates, f"choice {j}'s gates as [T, E, 1]")
            loc_3 = single(unsqueeze_of(loc_hot, 2, 1), loc_hot, f"choice {j}'s slots as [T, 1, C]")
            muls = [
                n
                for n in users_of(gates_3)
                if is_op(n, "Mul") and other_operand(n, gates_3) is loc_3
            ]
            terms.append(single(muls, gates_3, f"choice {j}'s combine (gates x location one-hot)"))
        adds = [n for n in users_of(terms[0].outputs[0]) if is_op(n, "Add")]
        add = single(adds, terms[0], "the two choices' combine tensors are not added")
        if other_operand(add, terms[0].outputs[0]) is not terms[1].outputs[0]:
            raise Refusal(f"{label(add)}: adds something other than the two choices", add)
        (c0, _), (c1, _) = depths
        if c0 is not c1 and (_static(c0) is None or _static(c0) != _static(c1)):
            raise Refusal(f"{label(add)}: the two choices' capacities differ", add)
        for c, hot in depths:
            _capacity_holds(c, probs, hot)
    return Top2Gate(logits, probs, (round0, round1), add.outputs[0], experts, c0)


def _refuse_capacity_drop(mask: ir.Value) -> None:
    """A mask multiplied by ``locations < C`` (``drop_tokens=True``) drops tokens: refused."""
    for mul in users_of(mask):
        if not is_op(mul, "Mul"):
            continue
        keep = other_operand(mul, mask)
        node = keep.producer() if keep is not None else None
        if is_op(node, "Cast"):
            node = node.inputs[0].producer()
        if is_op(node, "Less"):
            raise Refusal(
                f"{label(mul)}: the mask is multiplied by (locations < capacity) "
                f"('{label(node)}'): a capacity limit that drops the tokens past it "
                "(drop_tokens=True), which no fused node computes",
                mul,
                part="routing",
            )


def _location_one_hot(loc: ir.Value) -> tuple[ir.Value, ir.Value | int, ir.Node]:
    """``Cast(one_hot(loc, C), float)`` of the locations, ``C`` and the one-hot node.

    ``C`` is the OneHot's depth value, or the size of the range the locations are compared with.
    """
    for n in users_of(loc):
        if is_op(n, "OneHot"):
            values = const_array(n.inputs[2])
            if (
                values is None
                or values.reshape(-1).tolist() != [0, 1]
                or attr_int(n, "axis", -1) not in (-1, 1)
            ):
                raise Refusal(f"{label(n)}: not a one-hot of the locations", n)
            cast = single(
                [c for c in users_of(n.outputs[0]) if cast_of(c, ir.DataType.FLOAT)], n, "as float"
            )
            return cast.outputs[0], n.inputs[1], n
    for n in users_of(loc):
        if is_op(n, "Unsqueeze") and node_axes(n) in ([1], [-1]):
            for eq in users_of(n.outputs[0]):
                arange = other_operand(eq, n.outputs[0]) if is_op(eq, "Equal") else None
                arr = const_array(arange)
                if arr is not None and arr.ndim == 1 and np.array_equal(arr, np.arange(arr.size)):
                    cast = single(
                        [c for c in users_of(eq.outputs[0]) if cast_of(c, ir.DataType.FLOAT)],
                        eq,
                        "as float",
                    )
                    return cast.outputs[0], int(arr.size), eq
    raise Refusal(f"{loc.name}: the locations are not one-hot encoded over a capacity", loc)
