"""Prove that a router value is computed row by row from the tokens the experts read.

A fused MoE/QMoE node routes token row ``t`` by row ``t`` of what it is fed. When the router
stays in the graph as the model wrote it (the routing construction, :mod:`.selected_weights`),
the selection ``idx`` and the weights ``w`` it is fed must therefore be, row for row, the
routing of the token rows the experts read. :func:`prove_token_rows` walks back from such a
value and shows that every op on the way acts within a token row: element-wise ops (constants
broadcast over the feature axes only), Softmax/TopK/ArgMax/reductions/CumSum/Gather/Scatter/
Concat/Slice/Split over feature axes, reshapes that keep (or, in order, merge) the token axes,
and the router projection ``MatMul(rows, W)`` / ``Gemm`` of the token rows with a constant
weight. It raises a :class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal` naming the first node
that mixes rows (a Softmax over tokens, a Slice along them, a CumSum over them, a second graph
input), so the near miss points at the node.

"Token axes" are the leading ``lead`` axes of a value: ``[T, ...]`` has one, ``[B, S, ...]``
two. Shape computations (``Shape``, the shape operand of ``Reshape``/``Expand``/
``ConstantOfShape``, a TopK's ``k``) carry no data and are not walked.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.dims import Dim, product
from onnx_moe_fuse.rewrites.graph.facts import (
    attr_int,
    const_array,
    default_opset,
    label,
    node_axes,
    normalize_axes,
    static_rank,
    value_label,
)
from onnx_moe_fuse.rewrites.graph.refusals import Refusal
from onnx_moe_fuse.rewrites.graph.symbolic_dims import fill_dims, value_dims

__all__ = ["ELEMENTWISE", "prove_token_rows", "row_origins", "row_source"]

#: Element-wise ops: each output element reads the elements at its own position (broadcast).
ELEMENTWISE = frozenset(
    {
        "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "Mod", "Where",
        "Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual", "And", "Or", "Xor", "Not",
        "Cast", "CastLike", "Identity", "Sigmoid", "HardSigmoid", "Tanh", "Relu", "LeakyRelu",
        "Exp", "Log", "Abs", "Neg", "Sqrt", "Reciprocal", "Erf", "Sign", "Floor", "Ceil",
        "Round", "IsNaN", "IsInf", "Softplus", "Clip", "BitwiseNot", "Swish",
    }
)  # fmt: skip
#: Ops that compute along one ``axis`` attribute (default -1) and keep the others apart.
_ALONG_AXIS = {
    "Softmax": -1, "LogSoftmax": -1, "Hardmax": -1, "TopK": -1, "ArgMax": 0, "ArgMin": 0,
    "CumSum": None, "GatherElements": 0, "ScatterElements": 0, "Concat": None, "Split": 0,
    "Gather": 0, "OneHot": -1,
}  # fmt: skip
#: Reductions: their axes (attribute or input 1) must all be feature axes.
_REDUCE = frozenset(
    {"ReduceSum", "ReduceMax", "ReduceMin", "ReduceMean", "ReduceProd", "ReduceL1", "ReduceL2"}
)
#: Operands that hold sizes, not data: (op, input index).
_SHAPE_OPERANDS = {
    ("Reshape", 1), ("Expand", 1), ("TopK", 1), ("Tile", 1), ("OneHot", 1), ("Slice", 1),
    ("Slice", 2), ("Slice", 3), ("Slice", 4), ("Split", 1), ("Unsqueeze", 1), ("Squeeze", 1),
    ("CumSum", 1), ("Clip", 1), ("Clip", 2), ("Pad", 1),
}  # fmt: skip
_PROJECTIONS = frozenset({"MatMul", "Gemm"})
_MAX_NODES = 400


def row_source(value: ir.Value) -> ir.Value:
    """Walk back through ops that keep the token rows and the feature axis (a layout only)."""
    for _ in range(16):
        node = value.producer()
        if node is None or node.domain not in ("", "ai.onnx") or not node.inputs:
            return value
        src = node.inputs[0]
        if src is None or node.op_type not in ("Identity", "Reshape", "Flatten", "Cast"):
            if node.op_type not in ("Squeeze", "Unsqueeze") or src is None:
                return value
        dims_in, dims_out = value_dims(src), value_dims(value)
        if dims_in is None or dims_out is None or not dims_in or not dims_out:
            return value
        if dims_in[-1] != dims_out[-1]:
            return value
        if product(dims_in[:-1]) != product(dims_out[:-1]):
            return value
        value = src
    return value


_CONSTANT_LAYOUT = frozenset({"Transpose", "Cast", "Reshape", "Identity", "Unsqueeze", "Squeeze"})


def _constant_like(value: ir.Value | None) -> bool:
    """A constant, or a layout op of one (a router weight transposed in the graph)."""
    for _ in range(8):
        if value is None:
            return False
        if const_array(value) is not None:
            return True
        node = value.producer()
        if node is None or node.op_type not in _CONSTANT_LAYOUT or not node.inputs:
            return False
        if any(not _constant_like(v) for v in node.inputs[1:] if v is not None):
            return False
        value = node.inputs[0]
    return False


_SAME_RANK = ELEMENTWISE | {"Concat", "Slice", "Softmax", "LogSoftmax", "CumSum", "TopK", "MatMul"}


def _rank(value: ir.Value, depth: int = 0) -> int | None:
    dims = value_dims(value)
    if dims is not None:
        return len(dims)
    if value.shape is not None:
        return len(value.shape)
    fixed = static_rank(value)  # the producers' ranks (a model with no value_info)
    if fixed is not None:
        return fixed
    node = value.producer()
    if node is None or depth > 16 or node.op_type not in _SAME_RANK:
        return None
    # element-wise (broadcast) ops and these: the largest rank of their data operands
    ranks = [
        _rank(v, depth + 1)
        for i, v in enumerate(node.inputs)
        if v is not None and (node.op_type, i) not in _SHAPE_OPERANDS
    ]
    known = [r for r in ranks if r is not None]
    return max(known) if known and len(known) == len(ranks) else None


def _axis(node: ir.Node, rank: int, default: int | None) -> int | None:
    if node.op_type == "CumSum":
        axes = const_array(node.inputs[1]) if len(node.inputs) > 1 else None
        axis = None if axes is None or axes.size != 1 else int(axes.reshape(-1)[0])
    elif node.op_type == "Concat":
        axis = attr_int(node, "axis", None)
    elif node.op_type in ("Softmax", "LogSoftmax", "Hardmax") and default_opset(node.graph) < 13:
        axis = attr_int(node, "axis", 1)  # coerced to 2-D at axis: rows stay apart if >= lead
    else:
        axis = attr_int(node, "axis", default)
    if axis is None:
        return None
    norm = normalize_axes([axis], rank)
    return None if norm is None else norm[0]


def _uniform(array: np.ndarray) -> bool:
    return array.size == 0 or bool(np.all(array == array.reshape(-1)[0]))


class _Walk:
    """One proof: values already shown row-wise, by id, with their token-axis count."""

    def __init__(self, roots: tuple[ir.Value, ...], what: str) -> None:
        self.roots = roots
        self.tokens_root = roots[0]
        self.what = what
        self.done: dict[int, int] = {}
        self.nodes = 0

    def fail(self, reason: str, where: ir.Node | ir.Value) -> Refusal:
        return Refusal(f"{self.what}: {reason}", where, part="routing")

    def constant_ok(self, array: np.ndarray, out_rank: int, lead: int) -> bool:
        """A constant operand broadcast over the feature axes only (or the same everywhere)."""
        if _uniform(array):
            return True
        lead_in_const = array.ndim - (out_rank - lead)  # its axes aligned with token axes
        return lead_in_const <= 0 or all(d == 1 for d in array.shape[:lead_in_const])

    def value(self, value: ir.Value, lead: int) -> None:
        """Prove ``value`` row-wise with ``lead`` token axes; raise the first failure."""
        if self.done.get(id(value)) == lead:
            return
        source = row_source(value)
        if any(source is root for root in self.roots):
            self.done[id(value)] = lead
            return
        node = value.producer()
        if node is None:
            what = "a graph input" if value.is_graph_input() else "a value with no producer"
            raise self.fail(
                f"'{value_label(value)}' ({what}) is not the token rows the experts read "
                f"('{value_label(self.tokens_root)}'): the fused node routes each token by its "
                "own row, which cannot be proved here",
                value,
            )
        self.nodes += 1
        if self.nodes > _MAX_NODES:
            raise self.fail("the router is too large to prove row by row", node)
        if node.domain not in ("", "ai.onnx"):
            raise self.fail(f"{node.op_type} '{label(node)}' is not a standard op", node)
        self.done[id(value)] = lead
        self.node(node, value, lead)

    def operands(self, node: ir.Node, out_rank: int, lead: int, skip: Callable[[int], bool]):
        for i, v in enumerate(node.inputs):
            if v is None or skip(i) or (node.op_type, i) in _SHAPE_OPERANDS:
                continue
            array = const_array(v)
            if array is not None:
                if not self.constant_ok(array, out_rank, lead):
                    raise self.fail(
                        f"{node.op_type} '{label(node)}' combines the rows with the constant "
                        f"'{value_label(v)}' {list(array.shape)}, which differs along the "
                        "token axes",
                        node,
                    )
                continue
            producer = v.producer()
            if producer is not None and producer.op_type in ("Shape", "Size", "ConstantOfShape"):
                continue  # sizes, or one value everywhere
            if producer is not None and producer.op_type in ("Expand", "Tile"):
                filled = const_array(producer.inputs[0])
                if filled is not None and _uniform(filled):
                    continue  # one value everywhere, of a computed shape (torch's ones_like)
            rank = _rank(v)
            if rank is None:
                raise self.fail(f"the rank of '{value_label(v)}' is unknown", v)
            if rank < out_rank:  # broadcast from the right: no token axes of its own
                if rank > out_rank - lead:
                    raise self.fail(
                        f"{node.op_type} '{label(node)}' broadcasts '{value_label(v)}' over "
                        "the token axes",
                        node,
                    )
                self.row_invariant(v, node)
                continue
            self.value(v, lead)

    def row_invariant(self, value: ir.Value, user: ir.Node) -> None:
        """A non-constant operand without token axes: it must not depend on any token."""
        todo, seen = [value], set()
        while todo:
            v = todo.pop()
            if id(v) in seen or const_array(v) is not None:
                continue
            seen.add(id(v))
            p = v.producer()
            if p is None or any(v is root for root in self.roots):
                raise self.fail(
                    f"{user.op_type} '{label(user)}' mixes the rows with '{value_label(value)}', "
                    "which depends on the graph's inputs but has no token axis",
                    user,
                )
            if p.op_type in ("Shape", "Size"):
                continue
            todo.extend(x for x in p.inputs if x is not None)

    def node(self, node: ir.Node, out: ir.Value, lead: int) -> None:
        op = node.op_type
        out_rank = _rank(out)
        if out_rank is None:
            raise self.fail(f"the rank of '{value_label(out)}' is unknown", out)
        if op in ELEMENTWISE:
            self.operands(node, out_rank, lead, lambda i: False)
            return
        if op == "ConstantOfShape":
            return  # one value in every row
        if op in _PROJECTIONS:
            self.projection(node, out, lead)
            return
        if op in _ALONG_AXIS or op in _REDUCE:
            data = node.inputs[0]
            rank = _rank(data) if data is not None else None
            if rank is None:
                raise self.fail(f"the rank of the input of {op} '{label(node)}' is unknown", node)
            if op in _REDUCE:
                axes = node_axes(node)
                norm = None if axes is None else normalize_axes(axes, rank)
                keep = attr_int(node, "keepdims", 1)
                if not norm or min(norm) < lead or (not keep and out_rank < lead):
                    raise self.fail(
                        f"{op} '{label(node)}' reduces over axes {axes}, which include a token "
                        "axis (or all axes)",
                        node,
                    )
            else:
                axis = _axis(node, out_rank if op == "OneHot" else rank, _ALONG_AXIS[op])
                if axis is None or axis < lead:
                    said = "an unknown axis" if axis is None else f"axis {axis}, a token axis"
                    raise self.fail(
                        f"{op} '{label(node)}' works along {said}: it mixes the tokens' rows",
                        node,
                    )
                if op == "Gather":  # indices anywhere are fine if constant; data row-wise
                    self.value(data, lead)
                    if const_array(node.inputs[1]) is None:
                        raise self.fail(
                            f"Gather '{label(node)}' picks features by computed indices", node
                        )
                    return
            self.operands(node, out_rank, lead, lambda i: False)
            return
        if op in ("Slice", "Unsqueeze", "Squeeze"):
            self.layout_axes(node, out, lead)
            return
        if op == "Transpose":
            perm = node.attributes.get("perm")
            if perm is None or list(perm.as_ints())[:lead] != list(range(lead)):
                raise self.fail(f"Transpose '{label(node)}' moves a token axis", node)
            self.value(node.inputs[0], lead)
            return
        if op in ("Reshape", "Expand", "Flatten", "Tile"):
            self.reshape(node, out, lead)
            return
        raise self.fail(f"{op} '{label(node)}' is not an op this proof can follow row by row", node)

    def projection(self, node: ir.Node, out: ir.Value, lead: int) -> None:
        a, b = node.inputs[0], node.inputs[1] if len(node.inputs) > 1 else None
        if node.op_type == "Gemm" and attr_int(node, "transA", 0):
            raise self.fail(f"Gemm '{label(node)}' transposes the token rows (transA=1)", node)
        if a is None or b is None or not _constant_like(b):
            raise self.fail(
                f"{node.op_type} '{label(node)}' is not a projection by a constant weight", node
            )
        b_rank = _rank(b) or 2
        out_rank = _rank(out) or 0
        if b_rank > 2 and b_rank > out_rank - lead:
            raise self.fail(f"{node.op_type} '{label(node)}' weighs each token differently", node)
        if node.op_type == "Gemm" and len(node.inputs) > 2 and node.inputs[2] is not None:
            bias = const_array(node.inputs[2])
            if bias is None or (bias.ndim == 2 and bias.shape[0] != 1 and not _uniform(bias)):
                raise self.fail(f"Gemm '{label(node)}' adds a bias per token", node)
        self.value(a, lead)

    def layout_axes(self, node: ir.Node, out: ir.Value, lead: int) -> None:
        op = node.op_type
        data = node.inputs[0]
        rank_in = _rank(data)
        rank_out = _rank(out)
        if rank_in is None or rank_out is None:
            raise self.fail(f"the rank around {op} '{label(node)}' is unknown", node)
        if op == "Slice":
            axes_v = node.inputs[3] if len(node.inputs) > 3 else None
            axes = const_array(axes_v).reshape(-1).tolist() if axes_v is not None else None  # type: ignore[union-attr]
            if axes_v is not None and axes is None:
                raise self.fail(f"Slice '{label(node)}' has computed axes", node)
            starts = const_array(node.inputs[1])
            axes = list(range(starts.size)) if axes is None and starts is not None else axes
            norm = None if axes is None else normalize_axes(axes, rank_in)
        else:
            axes = node_axes(node)
            norm = (
                None
                if axes is None
                else normalize_axes(axes, rank_out if op == "Unsqueeze" else rank_in)
            )
        if not norm or min(norm) < lead:
            raise self.fail(
                f"{op} '{label(node)}' works on axes {axes}, which include a token axis", node
            )
        self.value(data, lead)

    def reshape(self, node: ir.Node, out: ir.Value, lead: int) -> None:
        data = node.inputs[0]
        array = const_array(data)
        if node.op_type in ("Expand", "Tile") and array is not None and _uniform(array):
            return  # one value everywhere (torch's zeros_like / full_like)
        dims_in, dims_out = value_dims(data), value_dims(out)
        lead_in = _rows_kept(node.op_type, dims_in, dims_out, lead)
        if lead_in is None:
            # the plain dims may not equate row counts that an Expand to a computed target
            # fixes (DeepSeek-V2's [T, G, 1] group mask expanded to Concat(Shape(x)[0] *
            # Shape(x)[1], G, E/G)): ask the question that follows them, on this path only
            dims_in, dims_out = fill_dims(data), fill_dims(out)
            lead_in = _rows_kept(node.op_type, dims_in, dims_out, lead)
        if dims_in is None or dims_out is None:
            raise self.fail(
                f"cannot prove that {node.op_type} '{label(node)}' keeps the token rows "
                "(unknown shapes)",
                node,
            )
        if lead_in is None:
            raise self.fail(
                f"{node.op_type} '{label(node)}' regroups the token rows (from "
                f"{_text(dims_in)} to {_text(dims_out)})",
                node,
            )
        self.value(data, lead_in)


def _rows_kept(op: str, dims_in: list[Dim] | None, dims_out: list[Dim] | None, lead: int):
    """The token axes of the input of a reshape-like ``op`` whose output has ``lead`` of them.

    None unless the rows provably keep their order: the same leading dims, or (not for Expand)
    the token axes merged or split in order with the rest of the elements kept.
    """
    if dims_in is None or dims_out is None:
        return None
    if dims_in[:lead] == dims_out[:lead] and len(dims_out) >= lead:
        return lead
    if op == "Expand":
        return None
    for lead_in in range(1, len(dims_in) + 1):
        if product(dims_in[:lead_in]) == product(dims_out[:lead]):
            if _same_rest(dims_in[lead_in:], dims_out[lead:]):
                return lead_in
    return None


def _same_rest(a: list[Dim], b: list[Dim]) -> bool:
    return product(a) == product(b)


def _text(dims: list[Dim]) -> str:
    return "[" + ", ".join(str(d) for d in dims) + "]"


def prove_token_rows(value: ir.Value, tokens: ir.Value, lead: int, what: str) -> None:
    """Raise a :class:`Refusal` (part ``routing``) unless ``value`` is row-wise in ``tokens``.

    ``lead``: the token axes of ``value`` (its rank minus one for ``[..., E]`` scores);
    ``what`` names the value in the reason (``"the selection TopK 'x' reads ..."``).
    """
    _Walk(row_origins(tokens), what).value(value, lead)


def row_origins(tokens: ir.Value) -> tuple[ir.Value, ...]:
    """The values whose rows are the token rows, row for row: ``row_source(tokens)`` first.

    Where the tokens are rows scaled by a per-row factor, ``Mul(x, f)`` with ``f [..., 1]``
    computed row by row from ``x`` (Llama4 scales each token by its router score before the
    expert), row ``t`` of the tokens is made from row ``t`` of ``x`` alone, so a router that
    reads ``x`` routes each token by its own row as well: ``x``'s row source is an origin too.
    """
    root = row_source(tokens)
    node = root.producer()
    if node is None or node.op_type != "Mul" or node.domain not in ("", "ai.onnx"):
        return (root,)
    if len(node.inputs) != 2 or None in node.inputs:
        return (root,)
    rank = _rank(root)
    for rows, factor in (node.inputs, node.inputs[::-1]):
        if rank is None or _rank(rows) != rank or _rank(factor) != rank:
            continue
        dims, feature, out = value_dims(factor), value_dims(rows), value_dims(root)
        if not dims or not feature or not out or dims[-1] != Dim.of(1) or feature[-1] != out[-1]:
            continue
        try:
            _Walk((row_source(rows),), "the token scale").value(factor, rank - 1)
        except Refusal:
            continue
        return (root, row_source(rows))
    return (root,)
