"""One expert's MLP inside an expert loop: its projections, its row-wise activation, its weights.

An iteration of the loop runs expert ``e`` on its gathered rows ``r_e [n, H]``::

    y_e = MatMul(act(MatMul(r_e, W1_e) (+ b1_e), MatMul(r_e, W3_e), ...), W2_e) (+ b2_e)

:func:`read_expert_mlp` proves that form, reading back from ``y_e``: FC2 is a ``MatMul`` by a
constant weight, every FC1 a ``MatMul`` of exactly ``r_e`` by a constant weight, each
optionally plus a constant bias row ``[N]`` (a ``Linear`` with bias, hand-written MoE code's
default; the bias an initializer or one entry of a stacked ``[E', N]`` one), and the
activation between them treats each row on its own (the element-wise ops of
:mod:`~onnx_moe_fuse.rewrites.canonical.experts.rowwise` with constant operands shared by every row, and ``Split`` / ``Slice``
along the feature axis), which is what lets it run unchanged on the per-slot ``[T, k, N]``
values. A weight is an initializer ``[K, N]``, ``Transpose(W, [1, 0])`` of one ``[N, K]``
(a ``Gemm(transB=1)`` / ``Linear`` after NormalizeSpellings), ``Gather(W, j)`` of a stacked
``[E', K, N]`` one, or a blocked DequantizeLinear of constants (:mod:`.quantized`: ORT's
MatMulNBits, once presented as DQ). The :class:`ExpertMLP`'s ``signature`` holds everything but the weights
(ops, attributes, activation constants by value, weight shapes and dtypes): two experts have
the same structure exactly when their signatures are equal.

:func:`stack_weights` makes the ``[E, K, N]`` stack of one projection as an ``ir.LazyTensor``
(read when first used: the per-expert tensors are never modified, nor read before a fusion
needs them); :func:`clone_activation` rebuilds expert 0's activation on the per-slot values.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.loops.quantized import (
    QuantizedWeight,
    quantized_weight,
)
from onnx_moe_fuse.rewrites.canonical.experts.rowwise import ELEMENTWISE, per_slot_operands
from onnx_moe_fuse.rewrites.canonical.experts.value_proofs import (
    const_shape,
    producer_op,
    small_const,
)
from onnx_moe_fuse.rewrites.graph.facts import attr_int, const_array, const_ints, label
from onnx_moe_fuse.rewrites.graph.refusals import Refusal

__all__ = [
    "BiasRef",
    "ExpertMLP",
    "LoopProjection",
    "WeightRef",
    "clone_activation",
    "read_expert_mlp",
    "stack_biases",
    "stack_weights",
]

_STD = ("", "ai.onnx")
_FEATURE_AXES = (1, -1)


@dataclass
class WeightRef:
    """One expert's ``[K, N]`` weight: ``source``, its transpose, or its ``index``-th entry.

    ``quantized``: the weight is a blocked DequantizeLinear (``source`` its codes).
    """

    source: ir.Value
    transposed: bool = False
    index: int | None = None
    quantized: QuantizedWeight | None = None

    @property
    def key(self) -> tuple[int, int | None]:
        """Identifies the numbers this weight reads (two experts must not share one)."""
        return id(self.source), self.index

    @property
    def dims(self) -> tuple[int, int]:
        """``(K, N)`` as the MatMul uses it."""
        shape = tuple(int(d) for d in self.source.const_value.shape)
        if self.index is not None:
            shape = shape[1:]
        return (shape[1], shape[0]) if self.transposed else (shape[0], shape[1])

    @property
    def dtype(self) -> ir.DataType:
        """The weight's element type (the dequantized one for a quantized weight)."""
        if self.quantized is not None:
            return self.quantized.dtype
        return self.source.const_value.dtype

    @property
    def quantization(self) -> tuple | None:
        """The quantisation two experts must share (None: float weights)."""
        return None if self.quantized is None else self.quantized.signature

    def array(self) -> np.ndarray:
        """The ``[K, N]`` numbers (reads the tensor)."""
        arr = self.source.const_value.numpy()
        if self.index is not None:
            arr = arr[self.index]
        return arr.T if self.transposed else arr


def _initializer(value: ir.Value | None, rank: int) -> bool:
    tensor = value.const_value if value is not None else None
    return (
        tensor is not None
        and not value.is_graph_input()
        and tensor.dtype.is_floating_point()
        and len(tensor.shape) == rank
    )


def _weight(value: ir.Value, e: int, matmul: ir.Node) -> WeightRef:
    if _initializer(value, 2):
        return WeightRef(value)
    quantized = quantized_weight(value)
    if quantized is not None:
        return WeightRef(quantized.codes, quantized=quantized)
    node = producer_op(value, "Transpose", "Gather")
    if node is not None and node.op_type == "Transpose":
        perm = node.attributes.get("perm")
        if _initializer(node.inputs[0], 2) and perm is not None and list(perm.value) == [1, 0]:
            return WeightRef(node.inputs[0], transposed=True)
    if node is not None and node.op_type == "Gather" and _initializer(node.inputs[0], 3):
        index = small_const(node.inputs[1])
        n = node.inputs[0].const_value.shape[0]
        if attr_int(node, "axis", 0) == 0 and index is not None and index.ndim == 0:
            j = int(index)
            if -n <= j < n:
                return WeightRef(node.inputs[0], index=j % n)
    where = "a graph input" if value.is_graph_input() else "not a float initializer"
    raise Refusal(
        f"expert {e}: the weight {value.name!r} of {label(matmul)} is {where} (nor its "
        "transpose, nor one entry of a stacked initializer, nor a blocked DequantizeLinear of "
        "constants)"
    )


@dataclass
class BiasRef:
    """One expert's bias row ``[N]``: ``source`` (``[N]`` or ``[1, N]``), or its ``index``-th entry."""

    source: ir.Value
    index: int | None = None

    @property
    def width(self) -> int:
        """``N``."""
        return int(self.source.const_value.shape[-1])

    def array(self) -> np.ndarray:
        """The row as a ``[N]`` array (reads the tensor)."""
        arr = np.asarray(self.source.const_value.numpy())
        arr = arr[self.index] if self.index is not None else arr
        return arr.reshape(-1)


def _bias(value: ir.Value, width: int) -> BiasRef | None:
    """``value`` as a bias row of ``width`` for every row of a projection, else None."""
    if _initializer(value, 1) or _initializer(value, 2):
        shape = tuple(int(d) for d in value.const_value.shape)
        return BiasRef(value) if shape in ((width,), (1, width)) else None
    node = producer_op(value, "Gather")
    if node is None or attr_int(node, "axis", 0) != 0:
        return None
    source = node.inputs[0]
    index = small_const(node.inputs[1])
    if not (_initializer(source, 2) or _initializer(source, 3)) or index is None or index.ndim:
        return None
    shape = tuple(int(d) for d in source.const_value.shape)
    if shape[1:] not in ((width,), (1, width)) or not -shape[0] <= int(index) < shape[0]:
        return None
    return BiasRef(source, int(index) % shape[0])


class LoopProjection(NamedTuple):
    """``out = MatMul(x, weight) (+ bias)``: ``node`` the MatMul, ``out`` what the MLP reads."""

    node: ir.Node
    weight: WeightRef
    bias: BiasRef | None
    out: ir.Value


def _biased(add: ir.Node) -> tuple[ir.Node, ir.Value] | None:
    """``Add(MatMul(.), b)`` (either order): the MatMul and the bias operand, else None."""
    if add.op_type != "Add" or add.domain not in _STD or len(add.inputs) != 2:
        return None
    for i in (0, 1):
        matmul = producer_op(add.inputs[i], "MatMul")
        other = add.inputs[1 - i]
        if matmul is not None and other is not None and const_shape(other) is not None:
            return matmul, other
    return None


def _projection(matmul: ir.Node, out: ir.Value, e: int) -> LoopProjection:
    weight = _weight(matmul.inputs[1], e, matmul)
    add = out.producer()
    if add is matmul:
        return LoopProjection(matmul, weight, None, out)
    bias = _bias(_biased(add)[1], weight.dims[1])  # type: ignore[index]
    if bias is None:
        raise Refusal(
            f"expert {e}: {label(add)} adds to {label(matmul)} something that is not a constant "
            f"bias row [{weight.dims[1]}]"
        )
    return LoopProjection(matmul, weight, bias, out)


def _width(matmul: ir.Node) -> int:
    """``N`` of a MatMul by a weight whose last dim the graph fixes (-1 when it does not)."""
    shape = const_shape(matmul.inputs[1]) if len(matmul.inputs) > 1 else None
    if shape is None:
        node = producer_op(matmul.inputs[1], "Transpose", "Gather")
        source = node.inputs[0] if node is not None else None
        full = const_shape(source) if source is not None else None
        if full is None:
            return -1
        shape = full[-2:][::-1] if node.op_type == "Transpose" else full[1:]
    return int(shape[-1]) if shape else -1


def _bias_key(bias: BiasRef | None) -> tuple | None:
    return None if bias is None else (bias.width, str(bias.source.const_value.dtype))


@dataclass
class ExpertMLP:
    """``y = FC2(act(FC1 projections of rows))``; ``act_nodes`` in topological order."""

    rows: ir.Value
    fc1: list[LoopProjection]
    act_nodes: list[ir.Node]
    act_out: ir.Value
    fc2: LoopProjection
    signature: tuple
    nodes: list[ir.Node] = field(default_factory=list)


def _const_key(value: ir.Value) -> tuple:
    arr = const_array(value)
    if arr is None:
        raise Refusal(f"activation: the constant {value.name!r} cannot be read")
    return ("const", str(arr.dtype), arr.shape, np.ascontiguousarray(arr).tobytes())


def _shared_by_rows(value: ir.Value) -> bool:
    """A constant operand the same for every row of a ``[n, F]`` value."""
    shape = const_shape(value)
    return shape is not None and (len(shape) <= 1 or (len(shape) == 2 and shape[0] == 1))


def _attrs_key(node: ir.Node) -> tuple:
    return tuple(sorted((k, repr(a.value)) for k, a in node.attributes.items()))


class _Reader:
    """Walks back from FC2's input to the FC1 projections of ``rows``."""

    def __init__(self, e: int) -> None:
        self.rows: ir.Value | None = None
        self.e = e
        self.fc1: list[LoopProjection] = []
        self.fc1_index: dict[int, int] = {}
        self.act: list[ir.Node] = []
        self.act_index: dict[int, int] = {}
        self.entries: list[tuple] = []

    def ref(self, value: ir.Value, depth: int = 0) -> tuple:
        if id(value) in self.fc1_index:
            return ("fc1", self.fc1_index[id(value)])
        node = value.producer()
        if node is not None and id(node) in self.act_index:
            return ("act", self.act_index[id(node)], value.index())
        if node is None or node.domain not in _STD or depth > 64:
            raise Refusal(
                f"expert {self.e}: activation: {value.name!r} is neither computed by a known "
                "row-wise op nor an FC1 projection of the expert's rows"
            )
        biased = _biased(node)
        if biased is not None and not (
            self._projects_rows(biased[0]) and _bias(biased[1], _width(biased[0])) is not None
        ):
            biased = None  # an Add of the activation's own (a constant shared by every row)
        matmul = node if node.op_type == "MatMul" else biased[0] if biased is not None else None
        if matmul is not None:
            if self.rows is None:
                self.rows = matmul.inputs[0]
            elif matmul.inputs[0] is not self.rows:
                raise Refusal(
                    f"expert {self.e}: fc1: {label(matmul)} does not project the same rows "
                    f"{self.rows.name!r} as the expert's other FC1"
                )
            self.fc1_index[id(value)] = len(self.fc1)
            self.fc1.append(_projection(matmul, value, self.e))
            return ("fc1", self.fc1_index[id(value)])
        self.activation_node(node, depth)
        return ("act", self.act_index[id(node)], value.index())

    def _projects_rows(self, matmul: ir.Node) -> bool:
        """Whether an ``Add`` after ``matmul`` is FC1's bias (the MatMul projects the rows).

        Only a MatMul of a value no activation computed can be FC1; an ``Add`` of a constant to
        anything else is the activation's own (gpt-oss's ``up + 1``).
        """
        x = matmul.inputs[0]
        producer = x.producer() if x is not None else None
        return (
            x is not None
            and (producer is None or id(producer) not in self.act_index)
            and (self.rows is None or x is self.rows)
        )

    def activation_node(self, node: ir.Node, depth: int) -> None:
        op = node.op_type
        cut = op in ("Split", "Slice")
        if op not in ELEMENTWISE and not cut:
            raise Refusal(
                f"expert {self.e}: activation: {label(node)} ({op}) is not proved to treat each "
                "row on its own"
            )
        if op == "Split" and attr_int(node, "axis", 0) not in _FEATURE_AXES:
            raise Refusal(f"expert {self.e}: activation: {label(node)} splits the rows")
        if op == "Slice":
            axes = const_ints(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] else None
            if axes is None or any(a not in _FEATURE_AXES for a in axes):
                raise Refusal(f"expert {self.e}: activation: {label(node)} slices the rows")
        inputs: list[tuple | None] = []
        for pos, v in enumerate(node.inputs):
            if v is None:
                inputs.append(None)
            elif cut and pos >= 1:
                if small_const(v, limit=64) is None:
                    raise Refusal(
                        f"expert {self.e}: activation: {label(node)} cuts at positions that are "
                        "not constant"
                    )
                inputs.append(_const_key(v))
            elif const_shape(v) is not None:
                if not _shared_by_rows(v):
                    raise Refusal(
                        f"expert {self.e}: activation: {label(node)} combines the rows with "
                        f"{v.name!r}, which is not a constant shared by every row"
                    )
                inputs.append(_const_key(v))
            else:
                inputs.append(self.ref(v, depth + 1))
        self.act_index[id(node)] = len(self.act)
        self.act.append(node)
        self.entries.append((node.domain, op, _attrs_key(node), tuple(inputs), len(node.outputs)))


def read_expert_mlp(y: ir.Value, e: int) -> ExpertMLP:
    """Read ``y`` as expert ``e``'s MLP on one rows value (``rows``); refuses otherwise."""
    node = y.producer()
    biased = _biased(node) if node is not None else None
    fc2_node = producer_op(y, "MatMul") or (biased[0] if biased is not None else None)
    if fc2_node is None:
        raise Refusal(
            f"expert {e}: fc2: {y.name!r} (weighted by the routing weight) is not a MatMul by "
            "constant weights (plus a bias)"
        )
    fc2 = _projection(fc2_node, y, e)
    reader = _Reader(e)
    act_ref = reader.ref(fc2_node.inputs[0])
    if not reader.fc1:
        raise Refusal(f"expert {e}: fc1: no projection of the rows before {label(fc2_node)}")
    weights = tuple(
        (p.weight.dims, str(p.weight.dtype), p.weight.quantization, _bias_key(p.bias))
        for p in [*reader.fc1, fc2]
    )
    signature = (tuple(reader.entries), act_ref, weights)
    nodes = [n for p in reader.fc1 for n in _projection_nodes(p)] + reader.act
    nodes += _projection_nodes(fc2)
    return ExpertMLP(reader.rows, reader.fc1, reader.act, fc2_node.inputs[0], fc2, signature, nodes)


def _projection_nodes(p: LoopProjection) -> list[ir.Node]:
    add = p.out.producer()
    return [p.node] if add is p.node or add is None else [p.node, add]


def _lazy_stack(refs: list, dtype: ir.DataType, dims: list[int], name: str) -> ir.Value:
    """A new value (not yet registered) stacking ``r.array()`` of ``refs``, read when first used."""
    shape = ir.Shape([len(refs), *dims])

    def compute() -> ir.TensorProtocol:
        return ir.Tensor(np.ascontiguousarray(np.stack([r.array() for r in refs])), dtype=dtype)

    tensor = ir.LazyTensor(compute, dtype, shape, cache=True, name=name)
    return ir.Value(name=name, type=ir.TensorType(dtype), shape=shape, const_value=tensor)


def stack_weights(refs: list[WeightRef], name: str) -> ir.Value:
    """The ``[E, K, N]`` stack of one projection's weights ``refs``, in expert order, lazily."""
    return _lazy_stack(refs, refs[0].dtype, list(refs[0].dims), name)


def stack_biases(refs: list[BiasRef], name: str) -> ir.Value:
    """The ``[E, N]`` stack of one projection's bias rows ``refs``, in expert order, lazily."""
    return _lazy_stack(refs, refs[0].source.const_value.dtype, [refs[0].width], name)


def clone_activation(
    mlp: ExpertMLP,
    starts: dict[int, ir.Value],
    fresh: Callable[[str], str],
    new_ints: Callable[[list[int]], ir.Value],
) -> tuple[list[ir.Node], ir.Value]:
    """Rebuild ``mlp``'s activation on the per-slot FC1 values; returns the nodes and its end.

    ``starts`` maps ``id`` of each FC1 output to its per-slot replacement. A feature axis
    (``Split``'s ``axis``, ``Slice``'s ``axes``) becomes ``-1``, the same axis of ``[T, k, F]``.
    """
    mapping = dict(starts)
    built: list[ir.Node] = []
    for node in mlp.act_nodes:
        inputs, attributes = per_slot_operands(node, mapping, new_ints)
        outputs = [ir.Value(name=fresh(o.name or "act"), type=o.type) for o in node.outputs]
        clone = ir.Node(
            node.domain,
            node.op_type,
            inputs,
            attributes,
            outputs=outputs,
            version=node.version,
            name=fresh(f"{node.name or node.op_type}__per_slot"),
        )
        for old, new in zip(node.outputs, clone.outputs, strict=True):
            mapping[id(old)] = new
        built.append(clone)
    return built, mapping[id(mlp.act_out)]
