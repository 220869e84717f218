"""Read one expert MLP of a dense MoE layer: FC1 projections, activation, FC2, and its shape.

Used by :mod:`.dense_experts`. An expert MLP, whether one expert's (weights ``[K, N]``, values
``[T, N]``) or all experts' at once (stacked weights ``[E, K, N]``, values ``[E, T, N]``), is

    y = FC2(act(FC1_0(x), FC1_1(x), ...))      FC(v) = MatMul(v, W) (+ bias)

where ``W`` is a constant or a ``DequantizeLinear`` of constants and ``act`` is a small graph of
per-row operations: element-wise ops whose other operands are constant scalars, and
``Slice``/``Split`` along the last axis. Per-row is what makes the rewrite valid: such an
activation computes the same on the ``[T, k, N]`` rows of the selected experts as on the dense
``[T, N]`` / ``[E, T, N]`` ones, so it can be copied onto the per-slot values unchanged (with
its axes written as ``-1``).

:func:`read_mlp` returns an :class:`ExpertMLP` whose ``signature`` describes everything but
the weights: two experts have the same structure iff their signatures are equal. It raises
:class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal` with a reason when the value is not
such an MLP.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.dense.consts import (
    STD,
    const_array,
    const_ints,
    is_const,
)
from onnx_moe_fuse.rewrites.canonical.experts.dense.nbits import (
    MS_DOMAIN,
    nbits_geometry,
    nbits_is_supported,
)
from onnx_moe_fuse.rewrites.graph.facts import attr_int, label, normalize_axes
from onnx_moe_fuse.rewrites.graph.refusals import Refusal, part

__all__ = ["ExpertMLP", "Projection", "WeightSource", "read_mlp"]

#: Element-wise ops allowed in the activation (every other operand a constant scalar).
_ELEMENTWISE = frozenset(
    {
        "Relu",
        "Sigmoid",
        "Tanh",
        "Gelu",
        "Erf",
        "Neg",
        "Exp",
        "Softplus",
        "Identity",
        "Mul",
        "Add",
        "Sub",
        "Div",
        "Min",
        "Max",
        "Clip",
        "Swish",
        "HardSigmoid",
        "Pow",  # a cube in a hand-written tanh GELU (its exponent a constant scalar)
        "Reciprocal",
    }
)
_MS_ELEMENTWISE = frozenset({"FastGelu", "Gelu", "QuickGelu"})
_STD = STD


def _operand_shapes(node: ir.Node) -> tuple:
    """``(dtype, shape)`` of each constant input, ``"input"`` for others, None when absent."""
    out: list = []
    for v in node.inputs:
        if v is None:
            out.append(None)
        elif v.const_value is not None:
            out.append((str(v.const_value.dtype), tuple(v.const_value.shape)))
        else:
            out.append("input")
    return tuple(out)


@dataclass
class WeightSource:
    """A projection weight: a float constant, a DQ of constants, or a MatMulNBits node's.

    ``dequantize`` is the ``DequantizeLinear(q, scale, zero_point?)`` node, ``nbits`` the
    ``MatMulNBits`` node whose packed weights these are.
    """

    value: ir.Value | None  # the MatMul operand (None for MatMulNBits)
    dequantize: ir.Node | None = None
    nbits: ir.Node | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The weight's ``[.., K, N]`` shape (of the codes when quantized)."""
        if self.nbits is not None:
            k, n, _, _ = nbits_geometry(self.nbits)
            return (k, n)
        src = self.value if self.dequantize is None else self.dequantize.inputs[0]
        return tuple(src.const_value.shape)

    def signature(self) -> tuple:
        """Everything but the numbers: dtypes, shapes, quantisation attributes."""
        if self.dequantize is None and self.nbits is None:
            return ("float", str(self.value.const_value.dtype), self.shape)
        node = self.dequantize or self.nbits
        attrs = tuple(sorted((k, repr(a.value)) for k, a in node.attributes.items()))
        return (node.op_type, _operand_shapes(node), attrs)


@dataclass
class Projection:
    """``out = MatMul(lhs, weight) (+ bias)``, or ``MatMulNBits(lhs, ..., bias?)`` (+ bias)."""

    lhs: ir.Value
    weight: WeightSource
    bias: ir.Value | None
    nodes: list[ir.Node]
    out: ir.Value


@dataclass
class ExpertMLP:
    """``out = FC2(act(FC1 projections))``; ``act_nodes`` in a deterministic topological order.

    ``signature`` is ``(activation entries, FC2 input, projection signatures)``: the first two
    describe the activation, the last the weights' dtypes, shapes and quantisation.
    """

    fc1: list[Projection]
    act_nodes: list[ir.Node]
    act_out: ir.Value
    fc2: Projection
    signature: tuple
    nodes: list[ir.Node] = field(default_factory=list)


def _float_initializer(value: ir.Value | None) -> bool:
    """An initializer of a float type (read by dtype only: its data is not loaded)."""
    return (
        value is not None
        and not value.is_graph_input()
        and value.const_value is not None
        and value.const_value.dtype.is_floating_point()
    )


def _weight(value: ir.Value | None) -> WeightSource | None:
    """``value`` as a projection weight, or None (not a constant, not a DQ of constants)."""
    if value is None or value.is_graph_input():
        return None
    if value.const_value is not None:  # an initializer (weights in Constant nodes: refused)
        return WeightSource(value) if _float_initializer(value) else None
    dq = value.producer()
    if dq is None or dq.op_type != "DequantizeLinear" or dq.domain not in _STD:
        return None
    for v in dq.inputs:
        if v is not None and (v.is_graph_input() or v.const_value is None):
            return None
    return WeightSource(value, dequantize=dq)


def _bias_fits(bias: ir.Value, weight: WeightSource) -> bool:
    """A bias row of the projection's N outputs (a scalar Add is the activation's, not a bias)."""
    shape = tuple(bias.const_value.shape)
    n = weight.shape[-1]
    return len(shape) >= 1 and shape[-1] == n and (n > 1 or len(shape) > 1)


def _projection(value: ir.Value) -> Projection | None:
    """``value`` as ``MatMul(lhs, W) (+ constant bias)`` or a MatMulNBits node, else None."""
    node = value.producer()
    if node is None:
        return None
    bias, nodes = None, []
    if node.op_type == "Add" and node.domain in _STD:
        a, b = node.inputs
        for mm_in, b_in in ((a, b), (b, a)):
            p = mm_in.producer() if mm_in is not None else None
            if (
                p is not None
                and p.op_type in ("MatMul", "MatMulNBits")
                and _float_initializer(b_in)
            ):
                nodes, bias, node = [node], b_in, p
                break
        else:
            return None
    if node.op_type == "MatMulNBits" and node.domain == MS_DOMAIN:
        weight = WeightSource(None, nbits=node) if nbits_is_supported(node) else None
        own_bias = node.inputs[5] if len(node.inputs) > 5 else None
        if own_bias is not None:  # its bias input, [N]: the same as an Add after it
            if bias is not None or not _float_initializer(own_bias):
                return None
            bias = own_bias
    elif node.op_type == "MatMul" and node.domain in _STD:
        weight = _weight(node.inputs[1])
    else:
        return None
    if weight is None or (bias is not None and not _bias_fits(bias, weight)):
        return None
    return Projection(node.inputs[0], weight, bias, [node, *nodes], value)


def _not_constant(value: ir.Value | None) -> ir.Value | None:
    """The graph input or computed value that keeps a weight from being constant, else None."""
    if value is None:
        return None
    if value.is_graph_input() or (value.const_value is None and value.producer() is None):
        return value
    if value.const_value is not None:
        return None
    dq = value.producer()
    if dq.op_type == "DequantizeLinear" and dq.domain in _STD:
        return next((v for v in dq.inputs if v is not None and _not_constant(v) is v), None)
    return value


def refuse_bad_projection(value: ir.Value, fc: str) -> None:
    """Refuse, naming part ``fc``, a ``MatMul`` / ``MatMulNBits`` that is not a projection.

    Returns when ``value`` is no such product at all (the caller says what it is instead; an
    ``Add`` of a bias that does not fit is read as the activation's). ``fc`` is ``"fc1"`` or
    ``"fc2"``.
    """
    node = value.producer()
    if node is None or node.op_type not in ("MatMul", "MatMulNBits"):
        return
    weight = node.inputs[1] if len(node.inputs) > 1 else None
    blocker = _not_constant(weight)
    with part(fc):
        if blocker is not None:
            where = "a graph input" if blocker.is_graph_input() else "computed in the graph"
            raise Refusal(
                f"{fc.upper()} expert weights not constant: '{blocker.name}' is {where}, so they "
                "cannot be stacked into the fused layout at fusion time",
                blocker,
            )
        raise Refusal(
            f"{label(node)}: the {fc.upper()} projection's weights or bias are not ones the "
            "fused experts take (a float initializer or a DequantizeLinear of initializers, "
            "a bias of one row)",
            node,
        )


def _const_key(value: ir.Value) -> tuple:
    arr = const_array(value)
    if arr is None:
        raise Refusal(f"a constant of the activation cannot be read: {value.name}")
    return ("const", str(arr.dtype), arr.shape, np.ascontiguousarray(arr).tobytes())


class _MLPReader:
    """Walks back from the FC2 input to the FC1 projections, recording the activation."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.fc1: list[Projection] = []
        self.fc1_index: dict[int, int] = {}  # id(FC1 output) -> position
        self.nodes: list[ir.Node] = []
        self.node_index: dict[int, int] = {}
        self.entries: list[tuple] = []

    def ref(self, value: ir.Value | None, depth: int = 0) -> tuple | None:
        if value is None:
            return None
        if id(value) in self.fc1_index:
            return ("fc1", self.fc1_index[id(value)])
        node = value.producer()
        if node is not None and id(node) in self.node_index:
            return ("act", self.node_index[id(node)], value.index())
        if depth > 64:
            raise Refusal("the activation is too deep to read")
        proj = _projection(value)
        if proj is not None:
            self.fc1_index[id(value)] = len(self.fc1)
            self.fc1.append(proj)
            return ("fc1", self.fc1_index[id(value)])
        refuse_bad_projection(value, "fc1")
        if node is None or value.is_graph_input():
            raise Refusal(
                f"the activation reads {value.name}, which is not an FC1 projection", value
            )
        self.activation_node(node, depth)
        return ("act", self.node_index[id(node)], value.index())

    def activation_node(self, node: ir.Node, depth: int) -> None:
        op = node.op_type
        ms = node.domain == MS_DOMAIN
        if not (
            node.domain in ("", "ai.onnx") and op in _ELEMENTWISE | {"Slice", "Split"}
        ) and not (ms and op in _MS_ELEMENTWISE):
            raise Refusal(f"{label(node)}: {op} is not a per-row activation op", node)
        inputs: list[tuple | None] = []
        for pos, v in enumerate(node.inputs):
            if op in ("Slice", "Split") and pos >= 1 and v is not None and not is_const(v):
                raise Refusal(f"{label(node)}: cuts FC1 at positions that are not constant", node)
            if v is not None and is_const(v):
                arr = const_array(v)
                per_row_operand = op in ("Slice", "Split") and pos >= 1
                if arr is None or (not per_row_operand and arr.size != 1):
                    raise Refusal(f"{label(node)}: a constant operand that is not a scalar", node)
                inputs.append(_const_key(v))
            else:
                inputs.append(self.ref(v, depth + 1))
        axis_key = self.axis_key(node)
        attrs = tuple(sorted((k, repr(a.value)) for k, a in node.attributes.items() if k != "axis"))
        self.node_index[id(node)] = len(self.nodes)
        self.nodes.append(node)
        self.entries.append((node.domain, op, attrs, axis_key, tuple(inputs), len(node.outputs)))

    def axis_key(self, node: ir.Node) -> str | None:
        """``"last"`` for a Slice/Split along the last axis; refuses any other axis."""
        if node.op_type == "Split":
            axis = normalize_axes([attr_int(node, "axis", 0)], self.rank)
            if axis != [self.rank - 1]:
                raise Refusal(f"{label(node)}: Split along an axis that is not the last", node)
            return "last"
        if node.op_type == "Slice":
            axes = const_ints(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] else None
            if axes is None or normalize_axes(axes, self.rank) != [self.rank - 1]:
                raise Refusal(f"{label(node)}: Slice along an axis that is not the last", node)
            return "last"
        return None


def read_mlp(out: ir.Value, rank: int) -> ExpertMLP:
    """Read ``out`` as ``FC2(act(FC1...))`` on values of ``rank``; refuses anything else."""
    fc2 = _projection(out)
    if fc2 is None:
        refuse_bad_projection(out, "fc2")
        with part("fc2"):
            raise Refusal(f"{out.name}: not MatMul(activation, constant weights) (+ bias)", out)
    reader = _MLPReader(rank)
    with part("activation"):
        act_ref = reader.ref(fc2.lhs)
        if not reader.fc1:
            raise Refusal(f"{out.name}: no FC1 projection before the FC2 projection", out)
    proj_sig = tuple(
        (p.weight.signature(), None if p.bias is None else p.bias.const_value.shape)
        for p in (*reader.fc1, fc2)
    )
    signature = (tuple(reader.entries), act_ref, proj_sig)
    nodes = [n for p in reader.fc1 for n in p.nodes] + reader.nodes + fc2.nodes
    return ExpertMLP(reader.fc1, reader.nodes, fc2.lhs, fc2, signature, nodes)
