"""Read the capacity dispatch and combine around a proved top-2 gate (DeepSpeed's MOELayer).

Used by :mod:`.capacity_dispatch`, after :mod:`.gate` proved the combine tensor ``W [T, E, C]``::

    X_d  = MatMul(Transpose(Cast(Cast(W, bool), float), [1, 2, 0]), x)   einsum "sec,sm->ecm"
    y_e  = expert_e(chunk e of X_d along axis 0)                          [1, C, M] each
    out  = ReduceSum(MatMul(Transpose(W, [1, 0, 2]), Concat(y_0..y_{E-1}, 0)), [0])
                                                                          einsum "sec,ecm->sm"

with ``x`` the rows the router projects. With the gate's locations distinct per expert and
below C, each capacity slot ``(e, c)`` holds at most one token's row, and every token's
non-zero combine weight ``W[t, e, c]`` reads back the slot that holds its own row, so
``out[t] = sum_e (sum_c W[t, e, c]) expert_e(x[t])`` (finite rows: the empty slots' outputs are
multiplied by exact zeros) ``= sum_e dense[t, e] expert_e(x[t])``: the dense all-experts layer.
That needs each expert to act on every row alone, so every node from a chunk to ``y_e`` is
checked to be row-wise (a MatMul by a 2-D constant, element-wise ops with constants of at most
one axis); the chunks must be ``[e, e + 1)`` of the expert axis in order (a ``Split`` in E, or
``Slice`` bounds evaluated from the buffer's shape).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.capacity.reads import cast_of, single, users_of
from onnx_moe_fuse.rewrites.canonical.experts.dense.consts import is_op
from onnx_moe_fuse.rewrites.graph.facts import attr_int, const_array, label, node_axes
from onnx_moe_fuse.rewrites.graph.refusals import Refusal, part

__all__ = ["CapacityDispatch", "read_dispatch", "router_rows"]

#: Ops that compute each row from that row alone (with constants of at most one axis).
_ROWWISE = (
    "Add", "Sub", "Mul", "Div", "Pow", "Tanh", "Erf", "Sigmoid", "Relu", "Gelu", "Exp",
    "Sqrt", "Neg", "Identity", "Cast", "Softplus", "Abs", "Max", "Min",
)  # fmt: skip
_MAX_EXPERT_NODES = 64


@dataclass
class CapacityDispatch:
    """The proved dispatch: the tokens, each expert's pipeline, and the layer output."""

    tokens: ir.Value  # x [T, M]
    chunks: list[ir.Value]  # chunk e of the capacity buffer, read by expert e
    pipelines: list[list[ir.Node]]  # expert e's nodes, chunk to y_e, in graph order
    outputs: list[ir.Value]  # y_e
    output: ir.Value  # out [T, M]
    buffer: ir.Value  # X_d


def router_rows(logits: ir.Value) -> ir.Value | None:
    """The rows ``x`` the router ``MatMul``/``Gemm`` behind ``logits`` projects."""
    node = logits.producer()
    if is_op(node, "Add"):
        var = [v for v in node.inputs if v is not None and const_array(v) is None]
        node = var[0].producer() if len(var) == 1 else None
    if node is None or node.op_type not in ("MatMul", "Gemm") or attr_int(node, "transA", 0):
        return None
    return node.inputs[0]


def _through(value: ir.Value, op: str, what: str, test=lambda n: True) -> ir.Value:
    found = [n for n in users_of(value) if is_op(n, op) and test(n)]
    return single(found, value, what).outputs[0]


def _perm_is(perm: list[int]):
    def test(node: ir.Node) -> bool:
        attr = node.attributes.get("perm")
        return attr is not None and [int(p) for p in attr.value] == perm

    return test


def _int_value(value: ir.Value | None, shapes: dict[int, list[int | None]], depth: int = 0):
    """The small integer tensor ``value`` holds, with ``Shape`` of known values read; or None."""
    if value is None or depth > 16:
        return None
    arr = const_array(value)
    if arr is not None:
        return arr.astype(np.int64)
    node = value.producer()
    if node is None:
        return None
    if is_op(node, "Shape"):
        picked = _shape_dims(node, shapes)
        return None if picked is None or None in picked else np.array(picked, np.int64)
    source = node.inputs[0].producer() if node.inputs and node.inputs[0] is not None else None
    if is_op(node, "Gather") and is_op(source, "Shape") and attr_int(node, "axis", 0) == 0:
        dims, index = _shape_dims(source, shapes), const_array(node.inputs[1])
        if dims is None or index is None:
            return None
        picked = np.asarray(dims, dtype=object)[index.astype(np.int64)]
        return None if None in np.ravel(picked).tolist() else picked.astype(np.int64)
    args = [_int_value(v, shapes, depth + 1) for v in node.inputs]
    if any(a is None for a in args):
        return None
    ops = {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply, "Div": np.floor_divide}
    if node.op_type in ops and node.domain in ("", "ai.onnx") and len(args) == 2:
        if node.op_type == "Div" and (np.any(args[1] <= 0) or np.any(args[0] < 0)):
            return None  # floor and truncation differ below zero
        return ops[node.op_type](args[0], args[1])
    if is_op(node, "Gather") and attr_int(node, "axis", 0) == 0 and args[0].ndim == 1:
        return args[0][args[1]]
    if is_op(node, "Cast") or is_op(node, "Identity"):
        return args[0]
    if is_op(node, "Concat"):
        return np.concatenate([np.atleast_1d(a) for a in args])
    if is_op(node, "Unsqueeze") or is_op(node, "Squeeze"):
        return args[0].reshape(-1) if is_op(node, "Unsqueeze") else args[0].reshape(())
    return None


def _shape_dims(shape: ir.Node, shapes: dict[int, list[int | None]]) -> list[int | None] | None:
    """The dims a ``Shape`` node reads of a value in ``shapes`` (None: unknown dims)."""
    dims = shapes.get(id(shape.inputs[0]))
    start, end = attr_int(shape, "start", 0), attr_int(shape, "end", None)
    return None if dims is None else dims[start:end]


def _chunks(buffer: ir.Value, experts: int) -> list[ir.Value]:
    """Chunk ``e`` of the buffer along axis 0, for ``e`` in ``0..E-1``: ``[e, e + 1)`` each."""
    users = [n for n in users_of(buffer) if not is_op(n, "Shape")]  # (read by the bounds)
    shapes = {id(buffer): [experts, None, None]}
    if len(users) == 1 and is_op(users[0], "Split"):
        split = users[0]
        sizes = _int_value(split.inputs[1], shapes) if len(split.inputs) > 1 else None
        count = attr_int(split, "num_outputs", None)
        even = sizes is None and len(split.inputs) < 2 and count == experts
        if (sizes is not None and sizes.tolist() == [1] * experts) or even:
            if attr_int(split, "axis", 0) == 0 and len(split.outputs) == experts:
                return list(split.outputs)
        raise Refusal(f"{label(split)}: not a split of the expert axis into E chunks", split)
    by_start: dict[int, ir.Value] = {}
    for s in users:
        if not is_op(s, "Slice") or s.inputs[0] is not buffer or len(s.inputs) < 4:
            raise Refusal(f"{label(s)}: reads the capacity buffer other than by chunk", s)
        start, end = (_int_value(v, shapes) for v in s.inputs[1:3])
        axes = const_array(s.inputs[3])
        steps = const_array(s.inputs[4]) if len(s.inputs) > 4 and s.inputs[4] else None
        if start is None or end is None or axes is None or axes.reshape(-1).tolist() != [0]:
            raise Refusal(f"{label(s)}: a chunk whose bounds are not read", s)
        if steps is not None and steps.reshape(-1).tolist() != [1]:
            raise Refusal(f"{label(s)}: a strided chunk", s)
        a, b = int(start.reshape(-1)[0]), min(int(end.reshape(-1)[0]), experts)
        if b != a + 1 or a in by_start:
            raise Refusal(f"{label(s)}: chunk [{a}, {b}) is not one expert's", s)
        by_start[a] = s.outputs[0]
    if sorted(by_start) != list(range(experts)):
        raise Refusal(f"{buffer.name}: the chunks do not cover the E experts once each", buffer)
    return [by_start[e] for e in range(experts)]


def _rowwise_operand(node: ir.Node, value: ir.Value, inside: set[int]) -> bool:
    if id(value) in inside:
        return True
    arr = const_array(value)
    if arr is None:
        return False
    if is_op(node, "MatMul"):
        return node.inputs[1] is value and arr.ndim == 2
    return arr.ndim <= 1


def _pipeline(chunk: ir.Value, concat: ir.Node, e: int) -> tuple[list[ir.Node], ir.Value]:
    """Expert ``e``'s nodes from its chunk to the Concat input, proved row-wise."""
    inside, nodes, todo = {id(chunk)}, [], [chunk]
    out = concat.inputs[e]
    while todo:
        v = todo.pop()
        for n in users_of(v):
            if n is concat:
                if v is not out:
                    raise Refusal(f"{label(concat)}: expert {e}'s output is not input {e}", concat)
                continue
            if n in nodes:
                continue
            if n.op_type not in _ROWWISE + ("MatMul",) or n.domain not in ("", "ai.onnx"):
                raise Refusal(f"{label(n)}: expert {e} computes a {n.op_type}, not row-wise", n)
            if is_op(n, "MatMul") and id(n.inputs[0]) not in inside:
                raise Refusal(f"{label(n)}: expert {e}'s MatMul does not project its rows", n)
            nodes.append(n)
            inside |= {id(o) for o in n.outputs}
            todo.extend(n.outputs)
            if len(nodes) > _MAX_EXPERT_NODES:
                raise Refusal(f"{label(n)}: expert {e} is not a small MLP", n)
    for n in nodes:
        bad = [v for v in n.inputs if v is not None and not _rowwise_operand(n, v, inside)]
        if bad:
            raise Refusal(f"{label(n)}: expert {e} reads '{bad[0].name}' beside its rows", n)
        if is_op(n, "Cast") and not cast_of(n, (ir.DataType.FLOAT, ir.DataType.FLOAT16)):
            raise Refusal(f"{label(n)}: expert {e} casts to another kind of number", n)
        for o in n.outputs:
            if o.is_graph_output() or any(u is not concat and u not in nodes for u in users_of(o)):
                raise Refusal(f"{label(n)}: expert {e}'s value '{o.name}' is read outside", n)
    if id(out) not in inside:
        raise Refusal(f"{label(concat)}: input {e} is not computed from chunk {e}", concat)
    return nodes, out


def read_dispatch(combine: ir.Value, logits: ir.Value, experts: int) -> CapacityDispatch:
    """Prove the einsum dispatch into ``[E, C, M]``, the chunked experts and the combine."""
    tokens = router_rows(logits)
    if tokens is None:
        raise Refusal(
            f"{logits.name}: the router does not project token rows", logits, part="tokens"
        )
    with part("fc1"):
        as_bool = _through(
            combine, "Cast", "the dispatch mask (bool)", lambda n: cast_of(n, ir.DataType.BOOL)
        )
        mask = _through(
            as_bool, "Cast", "the dispatch mask as float", lambda n: cast_of(n, ir.DataType.FLOAT)
        )
        moved = _through(mask, "Transpose", "the dispatch mask as [E, C, T]", _perm_is([1, 2, 0]))
        mm = single([n for n in users_of(moved) if is_op(n, "MatMul")], moved, "the dispatch")
        if mm.inputs[0] is not moved or mm.inputs[1] is not tokens:
            raise Refusal(f"{label(mm)}: does not dispatch the router's token rows", mm)
        buffer = mm.outputs[0]
        chunks = _chunks(buffer, experts)
    with part("combine"):
        moved_w = _through(
            combine, "Transpose", "the combine weights as [E, T, C]", _perm_is([1, 0, 2])
        )
        cmm = single([n for n in users_of(moved_w) if is_op(n, "MatMul")], moved_w, "the combine")
        stacked = cmm.inputs[1] if cmm.inputs[0] is moved_w else None
        concat = stacked.producer() if stacked is not None else None
        if (
            not is_op(concat, "Concat")
            or attr_int(concat, "axis", 0) != 0
            or len(concat.inputs) != experts
        ):
            raise Refusal(
                f"{label(cmm)}: the combine does not read the E experts' outputs stacked", cmm
            )
        if stacked.is_graph_output() or users_of(stacked) != [cmm]:
            # the experts will read every row: the stack would change for another reader
            raise Refusal(f"{label(concat)}: the stacked expert outputs are read elsewhere", concat)
        red = single(users_of(cmm.outputs[0]), cmm, "the combine's sum over the experts")
        if not is_op(red, "ReduceSum") or node_axes(red) != [0] or attr_int(red, "keepdims", 1):
            raise Refusal(f"{label(red)}: not the sum over the experts", red)
    with part("fc1"):
        pipelines, outputs = [], []
        for e, chunk in enumerate(chunks):
            nodes, out = _pipeline(chunk, concat, e)
            pipelines.append(nodes)
            outputs.append(out)
    return CapacityDispatch(tokens, chunks, pipelines, outputs, red.outputs[0], buffer)
