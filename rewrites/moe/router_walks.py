"""The graph walks behind :mod:`.routers`: what a TopK's selection reads, what becomes of its outputs.

Backward from what the selection reads (:func:`_trace_selection`: through reshapes, casts,
masks and constant biases, to the Softmax/Sigmoid or the router projection), forward from the
values and indices (:func:`_trace_weights`: the softmax/sigmoid of the k values, a
GatherElements that takes the weights from another tensor, renormalisation, a constant
factor), and the group-limited top-k of DeepSeek-V3 (:func:`_group_limit`). Every walk is
bounded by :data:`_STEPS` and only reads the graph; :func:`.routers.classify_router` turns
what they find into a :class:`~.routers.RouterForm`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.facts import attr_int, default_opset, is_real

# ops that move or re-type a tensor without changing which expert holds which value
_TRANSPARENT = frozenset(
    {"Reshape", "Flatten", "Squeeze", "Unsqueeze", "Cast", "Identity", "Expand"}
)
# consumers of expert ids that gather the chosen experts' weights (a one-hot or equality mask
# may pick experts too, or groups: see _classify)
_GATHERING = frozenset({"Gather", "GatherND", "GroupedMatMul"})
# where a router walk stops: the projections that compute logits or expert outputs
_PROJECTIONS = frozenset({"MatMul", "Gemm", "MatMulNBits", "FusedMatMul", "GroupedMatMul"})
_COMPARE = frozenset({"Greater", "Less", "GreaterOrEqual", "LessOrEqual"})
SELECTORS = frozenset({"TopK", "ArgMax"})
_STEPS = 48  # bound on every walk: a router is a few dozen nodes at most


# -- small graph facts ---------------------------------------------------------------------------


def _const_tensor(value: ir.Value) -> ir.TensorProtocol | np.ndarray | None:
    """The constant ``value`` holds (initializer or Constant node), without touching the graph.

    ``ir.convenience.get_const_tensor`` renames a Constant's tensor after its value, and the
    working copy shares tensors with the user's model: this reads only.
    """
    if value.is_graph_input():
        return None
    if value.const_value is not None:
        return value.const_value
    node = value.producer()
    if node is None or node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
        return None
    if len(node.attributes) != 1:
        return None
    name, attr = next(iter(node.attributes.items()))
    if attr.is_ref():
        return None
    if name == "value":
        return attr.value
    if name in ("value_float", "value_floats"):
        return np.asarray(attr.value, dtype=np.float32)
    if name in ("value_int", "value_ints"):
        return np.asarray(attr.value, dtype=np.int64)
    return None


def _small_const(value: ir.Value | None) -> np.ndarray | None:
    """A constant of at most 64 elements (never reads a weight), else None."""
    tensor = _const_tensor(value) if value is not None else None
    if tensor is None or tensor.size > 64:
        return None
    try:
        return np.asarray(tensor if isinstance(tensor, np.ndarray) else tensor.numpy())
    except Exception:  # an element type numpy cannot hold
        return None


def const_like(value: ir.Value | None) -> bool:
    """True for a value fixed before run time (a constant, possibly broadcast or re-typed)."""
    for _ in range(8):
        if value is None:
            return False
        if _const_tensor(value) is not None:
            return True
        node = value.producer()
        if node is None or not node.inputs:
            return node is not None and node.op_type == "Constant"
        if node.op_type == "ConstantOfShape":
            return True
        if node.op_type not in _TRANSPARENT:
            return False
        value = node.inputs[0]
    return False


def scalar(value: ir.Value | None) -> float | None:
    arr = _small_const(value)
    if arr is None or arr.size != 1 or not is_real(arr.dtype):
        return None
    return float(arr.astype(np.float64).reshape(-1)[0])


def skip_back(value: ir.Value | None) -> ir.Value | None:
    """``value`` before any reshapes/casts."""
    for _ in range(_STEPS):
        node = value.producer() if value is not None else None
        if node is None or node.op_type not in _TRANSPARENT or not node.inputs:
            return value
        value = node.inputs[0]
    return value


def _uses(value: ir.Value) -> Iterator[tuple[ir.Node, ir.Value]]:
    """The consumers of ``value`` past reshapes/casts, with the value each one reads."""
    todo, seen = [value], 0
    while todo and seen < _STEPS:
        v = todo.pop()
        seen += 1
        for user, _ in v.uses():
            if user.op_type in _TRANSPARENT and user.inputs and user.inputs[0] is v:
                todo.extend(user.outputs)
            else:
                yield user, v


def topk_k(node: ir.Node) -> int | None:
    if node.op_type == "ArgMax":
        return 1
    arr = _small_const(node.inputs[1]) if len(node.inputs) > 1 else None
    return int(arr.reshape(-1)[0]) if arr is not None and arr.size == 1 else None


def on_last_axis(node: ir.Node) -> bool:
    """True when a Softmax / TopK / ArgMax works along the last axis (the experts'), or Sigmoid."""
    if node.op_type == "Sigmoid":
        return True
    default = 0 if node.op_type == "ArgMax" else -1
    if node.op_type == "Softmax" and default_opset(node.graph) < 13:
        default = 1  # before opset 13 Softmax flattens from axis 1: the last axis only in 2-D
    axis = attr_int(node, "axis", default)
    rank = _rank(node.inputs[0] if node.inputs else None)
    return axis == -1 or (rank is not None and axis == rank - 1)


_SAME_RANK = frozenset({"Softmax", "Sigmoid", "Cast", "Identity", "Add", "Sub", "Mul", "Div"})


def _rank(value: ir.Value | None, depth: int = 0) -> int | None:
    """The rank of ``value`` from its shape or a few producers, else None.

    Not ``graph.facts.static_rank``: it reads constants through ``get_const_tensor``, which
    renames the (shared) tensor of a Constant node.
    """
    if value is None or depth > 16:
        return None
    if value.shape is not None:
        return len(value.shape)
    node = value.producer()
    if node is None or not node.inputs:
        return None
    ins = node.inputs
    if node.op_type == "Gemm":
        return 2
    if node.op_type in _SAME_RANK or node.op_type == "MatMul":
        ranks = [_rank(v, depth + 1) for v in ins[:2] if v is not None]
        return max(ranks) if ranks and None not in ranks else None
    if node.op_type == "Reshape" and len(ins) > 1:
        target = _small_const(ins[1])
        return None if target is None else target.size
    return None


def _indices(node: ir.Node) -> ir.Value | None:
    if node.op_type == "ArgMax":
        return node.outputs[0] if node.outputs else None
    return node.outputs[1] if len(node.outputs) > 1 else None


def backward_cone(values: Iterable[ir.Value | None]) -> list[ir.Node]:
    """The nodes behind ``values``, not past a projection, at most ``_STEPS`` of them."""
    todo = [v for v in values if v is not None]
    seen: dict[int, ir.Node] = {}
    while todo and len(seen) < _STEPS:
        node = todo.pop().producer()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        if node.op_type not in _PROJECTIONS and node.op_type not in ("Shape", "Size"):
            todo.extend(v for v in node.inputs if v is not None)
    return list(seen.values())


def feeds_selection(node: ir.Node) -> ir.Node | None:
    """Another TopK/ArgMax that ``node``'s outputs reach (not past a projection), or None."""
    todo, seen = list(node.outputs), 0
    while todo and seen < _STEPS:
        v = todo.pop()
        seen += 1
        for user, _ in v.uses():
            if user.op_type in SELECTORS and user is not node and user.inputs[0] is v:
                return user
            if user.op_type not in _PROJECTIONS and user.op_type not in _GATHERING:
                todo.extend(user.outputs)
    return None


def gathers_experts(node: ir.Node) -> bool:
    """True when ``node``'s indices gather experts' weights (or are sorted: an argsort)."""
    todo, seen = [_indices(node)], 0
    while todo and seen < 16:
        v = todo.pop()
        seen += 1
        if v is None:
            continue
        for user, _ in _uses(v):
            if user.op_type in _GATHERING or user.op_type in SELECTORS:
                return True
            if user.op_type == "Concat":
                todo.extend(user.outputs)
    return False


def is_argsort(node: ir.Node) -> bool:
    """A TopK that sorts another TopK's (or ArgMax's) indices ascending: not a router."""
    if node.op_type != "TopK" or attr_int(node, "largest", 1) != 0:
        return False
    return _are_expert_ids(node.inputs[0], 4)


def _are_expert_ids(value: ir.Value | None, depth: int) -> bool:
    """True for a selector's indices, possibly reshaped or concatenated (two top-1 rounds)."""
    source = skip_back(value)
    producer = source.producer() if source is not None else None
    if producer is None or depth == 0:
        return False
    if producer.op_type == "Concat":
        return bool(producer.inputs) and all(_are_expert_ids(v, depth - 1) for v in producer.inputs)
    return producer.op_type in SELECTORS and _indices(producer) is source


# -- what the selection reads --------------------------------------------------------------------


@dataclass
class Selection:
    """The walk back from the selection's input to the router's score function."""

    score: ir.Node | None = None  # Softmax/Sigmoid of the logits before the selection
    stop: ir.Node | None = None  # where the walk ended without one (projection, other op)
    biases: list[ir.Node] = field(default_factory=list)  # Add/Sub of a constant after ``score``
    masks: list[ir.Value] = field(default_factory=list)  # Where conditions, scatter indices


def trace_selection(value: ir.Value | None) -> Selection:
    sel, pending = Selection(), []
    for _ in range(_STEPS):
        node = value.producer() if value is not None else None
        if node is None:
            return sel
        op, ins = node.op_type, node.inputs
        if op in _TRANSPARENT and ins:
            value = ins[0]
        elif op == "Where" and len(ins) == 3 and const_like(ins[1]) != const_like(ins[2]):
            sel.masks.append(ins[0])
            value = ins[2] if const_like(ins[1]) else ins[1]
        elif op in ("ScatterElements", "ScatterND") and len(ins) == 3:
            sel.masks.append(ins[1])
            value = ins[0]
        elif op == "Mul" and len(ins) == 2 and _mask_operand(ins) is not None:
            mask = _mask_operand(ins)  # scores * a 0/1 mask built from another selection
            sel.masks.append(ins[mask])
            value = ins[1 - mask]
        elif op in ("Add", "Sub") and len(ins) == 2 and const_like(ins[0]) != const_like(ins[1]):
            pending.append(node)  # a selection bias if a score function lies behind it
            value = ins[0] if const_like(ins[1]) else ins[1]
        elif op in ("Softmax", "Sigmoid"):
            sel.score, sel.biases = node, pending
            return sel
        else:
            sel.stop = node
            return sel
    return sel


def _mask_operand(operands: Sequence[ir.Value | None]) -> int | None:
    """Which of two operands is built from another TopK/ArgMax (a mask), if exactly one is."""
    built = [
        v is not None and any(n.op_type in SELECTORS for n in backward_cone([v])) for v in operands
    ]
    return built.index(True) if built.count(True) == 1 else None


@dataclass
class Groups:
    """A group-limited top-k: the TopK over group scores and how each group is scored."""

    topk: ir.Node
    groups: int | None
    per_group: str


def group_limit(masks: list[ir.Value]) -> Groups | None:
    """The group-selection TopK behind a selection's masks, if the masks come from one."""
    for node in backward_cone(masks):
        if node.op_type != "TopK":
            continue
        scored = skip_back(node.inputs[0])
        reduce = scored.producer() if scored is not None else None
        if reduce is None or not reduce.op_type.startswith("Reduce"):
            continue
        inner = skip_back(reduce.inputs[0])
        inner_node = inner.producer() if inner is not None else None
        how = reduce.op_type.removeprefix("Reduce").lower()
        per_group, grouped = f"the {how} of its scores", inner
        if (
            inner_node is not None
            and inner_node.op_type == "TopK"
            and inner is inner_node.outputs[0]
        ):
            per_group = f"the {how} of its top {topk_k(inner_node) or 'k'}"
            grouped = inner_node.inputs[0]
        return Groups(node, _group_count(grouped), per_group)
    return None


def _group_count(grouped: ir.Value | None) -> int | None:
    """G of scores reshaped to ``[..., G, E/G]``, from the shape or the Reshape target."""
    if grouped is None:
        return None
    if grouped.shape is not None and len(grouped.shape) >= 2:
        dim = grouped.shape[-2]
        if isinstance(dim, int):
            return dim
    node = grouped.producer()
    if node is not None and node.op_type == "Reshape" and len(node.inputs) > 1:
        target = _small_const(node.inputs[1])
        if target is not None and target.size >= 2 and int(target.reshape(-1)[-2]) > 0:
            return int(target.reshape(-1)[-2])
    return None


# -- what becomes of the values and indices ------------------------------------------------------


@dataclass
class Weights:
    """The walk forward from the selection to the routing weights."""

    post: ir.Node | None = None  # Softmax/Sigmoid of the k selected values
    gathered: ir.Node | None = None  # GatherElements taking the weights from another tensor
    source: ir.Node | None = None  # the Softmax/Sigmoid that tensor comes from
    threshold: ir.Node | None = None  # sparse mixer: the comparison masking that softmax
    renorm: ir.Node | None = None  # division by the sum of the k weights
    scale: tuple[ir.Node, float] | None = None  # a constant factor on the weights
    prescale: ir.Node | None = None  # the weights scale the expert inputs, not outputs
    scattered: ir.Node | None = None  # the k values scattered into a dense [..., E] tensor


def _post_fn(value: ir.Value) -> ir.Node | None:
    """A Softmax/Sigmoid over the last axis that reads ``value`` (past reshapes), or None."""
    for user, _ in _uses(value):
        if user.op_type in ("Softmax", "Sigmoid") and on_last_axis(user):
            return user
    return None


def _scatter_back(values: ir.Value, indices: ir.Value | None) -> ir.Node | None:
    """``ScatterElements(fill, indices, values)`` into a constant (dense routing), or None."""
    for user, read in _uses(values):
        ins = user.inputs
        if user.op_type == "ScatterElements" and len(ins) == 3 and ins[2] is read:
            if const_like(ins[0]) and skip_back(ins[1]) is indices:
                return user
    return None


def trace_weights(node: ir.Node, selected: ir.Value | None) -> Weights:
    w, start = Weights(), None
    indices = _indices(node)
    if node.op_type == "TopK" and node.outputs and node.outputs[0].uses():
        start = node.outputs[0]
        w.scattered = _scatter_back(start, indices)  # Llama4: a dense [T, E] of the k values
        if w.scattered is not None:
            start = w.scattered.outputs[0]
        w.post = _post_fn(start)
        start = w.post.outputs[0] if w.post is not None else start
    for user, read in _uses(indices) if indices is not None else ():
        if user.op_type != "GatherElements" or len(user.inputs) < 2 or user.inputs[1] is not read:
            continue
        data = skip_back(user.inputs[0])
        if w.post is None:
            start = user.outputs[0]
            w.post = _post_fn(start)  # a softmax/sigmoid of the gathered values
            start = w.post.outputs[0] if w.post is not None else start
        if data is selected:
            break  # the top-k values again
        w.gathered = user
        w.source = data.producer() if data is not None else None
        if w.source is not None and w.source.op_type not in ("Softmax", "Sigmoid"):
            w.source = None
        w.threshold = _threshold(w.source)
        break
    if start is not None:
        _follow_weights(start, w)
    return w


def _threshold(softmax: ir.Node | None) -> ir.Node | None:
    """The comparison behind ``Softmax(Where(compare, -inf, scores))`` (sparse mixer), or None."""
    if softmax is None or softmax.op_type != "Softmax":
        return None
    masked = skip_back(softmax.inputs[0])
    where = masked.producer() if masked is not None else None
    if where is None or where.op_type != "Where":
        return None
    cond = skip_back(where.inputs[0])
    for _ in range(4):
        test = cond.producer() if cond is not None else None
        if test is None:
            return None
        if test.op_type in _COMPARE:
            return test
        if test.op_type != "Not":
            return None
        cond = skip_back(test.inputs[0])
    return None


def _follow_weights(start: ir.Value, w: Weights) -> None:
    """Walk the weights forward: renormalisation, a constant factor, the combine."""
    chain, todo, seen = {id(start)}, [start], 0
    while todo and seen < _STEPS:
        v = todo.pop(0)
        seen += 1
        for user, _ in v.uses():
            op = user.op_type
            others = [x for x in user.inputs if x is not None and id(x) not in chain]
            follow = op in _TRANSPARENT or op in ("Concat", "Transpose")
            if op in ("Mul", "Div") and len(others) == 1:
                factor = scalar(others[0])
                if factor is not None and (op == "Mul" or user.inputs[1] is others[0]):
                    factor = factor if op == "Mul" else 1.0 / factor if factor else None
                    if factor is not None and factor != 1.0 and w.scale is None:
                        w.scale = (user, factor)
                    follow = True
                elif _sum_of(others[0], chain, reciprocal=op == "Mul"):
                    w.renorm, follow = user, True
                elif op == "Mul" and _reaches_projection(user.outputs[0]):
                    w.prescale = user
            if follow:
                chain.update(id(o) for o in user.outputs)
                todo.extend(user.outputs)


def _sum_of(value: ir.Value, chain: set[int], reciprocal: bool) -> bool:
    """True for ``ReduceSum(c) [+ eps]`` of a chain value (``1 / that`` when ``reciprocal``)."""
    value = skip_back(value)
    node = value.producer() if value is not None else None
    if reciprocal:
        if node is None or node.op_type != "Reciprocal":
            return False
        value = skip_back(node.inputs[0])
        node = value.producer() if value is not None else None
    if node is not None and node.op_type in ("Add", "Max", "Clip") and node.inputs:
        value = skip_back(node.inputs[0])  # + eps, or clamped away from zero
        node = value.producer() if value is not None else None
    return node is not None and node.op_type == "ReduceSum" and id(node.inputs[0]) in chain


def _reaches_projection(value: ir.Value) -> bool:
    return any(user.op_type in _PROJECTIONS for user, _ in _uses(value))
