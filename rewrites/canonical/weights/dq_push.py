"""Moving a layout op from the output of ``DequantizeLinear`` onto its constant inputs.

``Transpose(DequantizeLinear(q, scale, zp))`` computes the same numbers as
``DequantizeLinear(Transpose(q), scale', zp')`` with the quantization axis moved by the perm, and
so on for the other layout ops, when the scale's layout can follow. Doing the layout on the
quantized constants keeps weights quantized, which is the form the QMoE rules recognise.

A :class:`QuantizedWeight` reads one ``DequantizeLinear`` whose inputs are all constants and
says which of the three layouts it uses (per tensor: scalar scale; per axis: 1-D scale along
``axis``; blocked: scale of q's rank, ``ceil(dim / block_size)`` along ``axis``). The functions
below each return the :class:`QuantizedWeight` that the layout op's output dequantizes from, or
None when the scale cannot follow exactly (a reshape that merges or splits the quantized axis,
a slice that cuts inside a block, a concat of weights quantized differently). ``Cast`` is never
pushed: dequantizing straight into another float type rounds differently.

Operands that the op leaves untouched stay as the graph's existing values (no weight is read or
copied for them); changed ones are numpy arrays for the caller to store as new initializers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.weights.layout_ops import take_kept
from onnx_moe_fuse.rewrites.graph.facts import attr_int
from onnx_moe_fuse.rewrites.graph.tensor_reads import read_array

__all__ = [
    "is_constant",
    "const_tensor",
    "LazyArray",
    "Operand",
    "QuantizedWeight",
    "read_quantized_weight",
    "push_transpose",
    "push_reshape",
    "push_slice",
    "push_concat",
    "single_block_as_per_tensor",
]


@dataclasses.dataclass(frozen=True)
class LazyArray:
    """An array of known shape whose numbers are computed only when asked for."""

    shape: tuple[int, ...]
    compute: Callable[[], np.ndarray]


Operand = ir.Value | np.ndarray | LazyArray
"""An input of the new DequantizeLinear: an existing constant value, or new numbers.

The quantized data moves as a :class:`LazyArray`, so that a push reads no weight until a rule
(or serialisation) reads the result; scales and zero points are small and move as arrays.
"""


def is_constant(value: ir.Value | None) -> bool:
    """True for an initializer that is not a graph input, or the output of a Constant node."""
    if value is None or value.is_graph_input():
        return False
    if value.is_initializer():
        return value.const_value is not None
    producer = value.producer()
    return (
        producer is not None
        and producer.op_type == "Constant"
        and producer.domain == ""
        and ir.convenience.get_const_tensor(value) is not None
    )


def const_tensor(value: ir.Value) -> ir.TensorProtocol:
    """The tensor of a value for which :func:`is_constant` holds."""
    tensor = ir.convenience.get_const_tensor(value)
    assert tensor is not None
    return tensor


@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A constant ``DequantizeLinear``: its operands, layout and the node it came from."""

    node: ir.Node
    data: Operand
    scale: Operand
    zero_point: Operand | None
    shape: tuple[int, ...]
    axis: int | None  # None: per-tensor
    block_size: int  # 0: not blocked
    dtypes: tuple[ir.DataType, ir.DataType, ir.DataType | None]  # of data, scale, zero point

    @property
    def blocked(self) -> bool:
        """Whether the scale holds one value per block along ``axis``."""
        return self.block_size > 0

    def replace(self, **changes) -> QuantizedWeight:
        """This weight with some fields changed."""
        return dataclasses.replace(self, **changes)


def _array(operand: Operand) -> np.ndarray:
    """The numbers of an operand (reads the tensor of an existing constant)."""
    if isinstance(operand, np.ndarray):
        return operand
    if isinstance(operand, LazyArray):
        return operand.compute()
    return read_array(const_tensor(operand))


def _shape(operand: Operand) -> tuple[int, ...]:
    """Shape of an operand, without reading its data."""
    if isinstance(operand, (np.ndarray, LazyArray)):
        return tuple(operand.shape)
    return tuple(int(d) for d in const_tensor(operand).shape)


def _moved_data(
    weight: QuantizedWeight, shape: tuple[int, ...], move: Callable[[np.ndarray], np.ndarray]
) -> LazyArray:
    """``weight``'s quantized data after ``move`` (of result ``shape``), computed on demand."""
    source = weight.data
    return LazyArray(shape, lambda: move(_array(source)))


def read_quantized_weight(value: ir.Value | None) -> QuantizedWeight | None:
    """The weight that ``value`` dequantizes, if a DequantizeLinear of constants produces it."""
    node = None if value is None else value.producer()
    if node is None or node.op_type != "DequantizeLinear" or node.domain != "":
        return None
    inputs = list(node.inputs) + [None] * (3 - len(node.inputs))
    data, scale, zero_point = inputs[:3]
    if not (is_constant(data) and is_constant(scale)):
        return None
    if zero_point is not None and not is_constant(zero_point):
        return None
    shape = _shape(data)
    scale_shape = _shape(scale)
    if zero_point is not None and _shape(zero_point) != scale_shape:
        return None
    block_size = attr_int(node, "block_size", 0)
    axis = attr_int(node, "axis", 1)
    if block_size is None or axis is None or block_size < 0:
        return None
    dtypes = (
        const_tensor(data).dtype,
        const_tensor(scale).dtype,
        None if zero_point is None else const_tensor(zero_point).dtype,
    )
    if not scale_shape and not block_size:
        return QuantizedWeight(node, data, scale, zero_point, shape, None, 0, dtypes)
    axis = axis + len(shape) if axis < 0 else axis
    if not 0 <= axis < len(shape):
        return None
    if not block_size:
        if scale_shape != (shape[axis],):
            return None
    else:
        blocks = -(-shape[axis] // block_size)
        expected = shape[:axis] + (blocks,) + shape[axis + 1 :]
        if scale_shape != expected or blocks == 0:
            return None
    return QuantizedWeight(node, data, scale, zero_point, shape, axis, block_size, dtypes)


def _on_scales(weight: QuantizedWeight, change) -> dict:
    """``scale`` and ``zero_point`` both transformed by ``change`` (an array function)."""
    zero_point = weight.zero_point
    return {
        "scale": change(_array(weight.scale)),
        "zero_point": None if zero_point is None else change(_array(zero_point)),
    }


def push_transpose(weight: QuantizedWeight, perm: Sequence[int]) -> QuantizedWeight:
    """The weight after ``Transpose(perm)``: the axis moves to ``perm.index(axis)``."""
    shape = tuple(weight.shape[p] for p in perm)
    data = _moved_data(weight, shape, lambda a: np.ascontiguousarray(a.transpose(perm)))
    if weight.axis is None:
        return weight.replace(data=data, shape=shape)
    axis = list(perm).index(weight.axis)
    if not weight.blocked:
        return weight.replace(data=data, shape=shape, axis=axis)
    scales = _on_scales(weight, lambda a: np.ascontiguousarray(a.transpose(perm)))
    return weight.replace(data=data, shape=shape, axis=axis, **scales)


def _matching_axis(old: tuple[int, ...], new: tuple[int, ...], axis: int) -> int | None:
    """An axis of ``new`` that keeps ``old[axis]`` whole, with the same elements before it."""
    before = int(np.prod(old[:axis], dtype=np.int64))
    for candidate, dim in enumerate(new):
        if dim == old[axis] and int(np.prod(new[:candidate], dtype=np.int64)) == before:
            return candidate
    return None


def push_reshape(weight: QuantizedWeight, shape: tuple[int, ...]) -> QuantizedWeight | None:
    """The weight after a reshape to ``shape``, if the quantized axis survives it unchanged.

    With the elements before and after the axis grouped the same way, element ``(i, j, k)``
    of the flattened (before, axis, after) view stays where it is, and so does its scale.
    """
    data = _moved_data(weight, shape, lambda a: a.reshape(shape))
    if weight.axis is None:
        return weight.replace(data=data, shape=shape)
    axis = _matching_axis(weight.shape, shape, weight.axis)
    if axis is None:
        return None
    if not weight.blocked:
        return weight.replace(data=data, shape=shape, axis=axis)
    blocks = _shape(weight.scale)[weight.axis]
    scale_shape = shape[:axis] + (blocks,) + shape[axis + 1 :]
    scales = _on_scales(weight, lambda a: a.reshape(scale_shape))
    return weight.replace(data=data, shape=shape, axis=axis, **scales)


def _block_range(indices: np.ndarray, dim: int, block_size: int) -> slice | None:
    """The blocks that a contiguous cut ``indices`` of a blocked axis spans whole, or None."""
    start, stop = int(indices[0]), int(indices[-1]) + 1
    contiguous = np.array_equal(indices, np.arange(start, stop))
    whole_blocks = start % block_size == 0 and (stop % block_size == 0 or stop == dim)
    if not (contiguous and whole_blocks):
        return None
    return slice(start // block_size, -(-stop // block_size))


def push_slice(
    weight: QuantizedWeight, kept: Sequence[np.ndarray | None]
) -> QuantizedWeight | None:
    """The weight restricted to the indices ``kept`` per axis (None: the whole axis).

    A per-axis scale is cut with its axis; a blocked scale is cut along the other axes as the
    data is, and along the block axis only when the cut falls on block boundaries.
    """
    if any(indices is not None and indices.size == 0 for indices in kept):
        return None  # an empty weight: leave it to the op
    shape = tuple(d if k is None else len(k) for d, k in zip(weight.shape, kept, strict=True))
    data = _moved_data(weight, shape, lambda a: np.ascontiguousarray(take_kept(a, kept)))
    changed = weight.replace(data=data, shape=shape)
    if weight.axis is None:
        return changed
    if not weight.blocked:
        indices = kept[weight.axis]
        if indices is None:
            return changed
        return changed.replace(**_on_scales(weight, lambda a: np.take(a, indices)))
    cuts: list[np.ndarray | slice | None] = list(kept)
    if kept[weight.axis] is not None:
        blocks = _block_range(kept[weight.axis], weight.shape[weight.axis], weight.block_size)
        if blocks is None:
            return None
        cuts[weight.axis] = blocks
    if all(cut is None for cut in cuts):
        return changed

    def cut_scales(array: np.ndarray) -> np.ndarray:
        for axis, cut in enumerate(cuts):
            if isinstance(cut, slice):
                array = array[(slice(None),) * axis + (cut,)]
            elif cut is not None:
                array = np.take(array, cut, axis=axis)
        return np.ascontiguousarray(array)

    return changed.replace(**_on_scales(weight, cut_scales))


def _same_attributes(nodes: Sequence[ir.Node]) -> bool:
    """Whether the DequantizeLinear nodes agree on every attribute but the (checked) axis."""

    def key(node: ir.Node) -> dict:
        return {k: a.value for k, a in node.attributes.items() if k not in ("axis", "block_size")}

    first = key(nodes[0])
    return all(key(node) == first for node in nodes[1:])


def _equal_operands(operands: Sequence[Operand | None]) -> bool:
    """Whether all operands hold the same numbers (all None counts as equal)."""
    if any(o is None for o in operands):
        return all(o is None for o in operands)
    first = _array(operands[0])
    return all(np.array_equal(_array(o), first) for o in operands[1:])


def _per_axis(weight: QuantizedWeight, axis: int) -> QuantizedWeight:
    """A per-tensor weight restated per axis along ``axis``: its scale repeated, same numbers."""
    dim = weight.shape[axis]
    return weight.replace(
        axis=axis, **_on_scales(weight, lambda a: np.broadcast_to(a.reshape(()), (dim,)).copy())
    )


def _one_block(weight: QuantizedWeight, avoid: int) -> QuantizedWeight | None:
    """A per-axis weight restated as blocked, one block over its longest axis but ``avoid``.

    Each element keeps its scale (the scale is repeated along the other axes), so the blocked
    DequantizeLinear computes the same numbers; None when no axis is left to block along.
    """
    others = [i for i in range(len(weight.shape)) if i not in (weight.axis, avoid)]
    if not others:
        return None
    block_axis = max(others, key=lambda i: (weight.shape[i], i))
    scale_shape = list(weight.shape)
    scale_shape[block_axis] = 1
    along_axis = [1] * len(weight.shape)
    along_axis[weight.axis] = weight.shape[weight.axis]

    def spread(array: np.ndarray) -> np.ndarray:
        return np.broadcast_to(array.reshape(along_axis), scale_shape).copy()

    return weight.replace(
        axis=block_axis, block_size=weight.shape[block_axis], **_on_scales(weight, spread)
    )


def push_concat(
    weights: Sequence[QuantizedWeight], axis: int, opset: int
) -> QuantizedWeight | None:
    """The weight of ``Concat(axis)`` over several dequantized weights, if one DQ can hold it.

    They must share the layout (axis, block size, dtypes, other attributes). Along the
    quantized axis the scales concatenate (blocked: every part but the last whole blocks);
    blocked scales concatenate along any axis. Per-tensor or per-axis parts concatenated across
    their axis share one scale when all are equal; otherwise per-tensor parts become per-axis
    along the concat axis (opset >= 13) and per-axis parts become blocked with one block along
    another axis (opset >= 21): each element keeps its scale.
    """
    first = weights[0]
    rank = len(first.shape)
    same_layout = all(
        len(w.shape) == rank
        and w.axis == first.axis
        and w.block_size == first.block_size
        and w.dtypes == first.dtypes
        for w in weights
    )
    if not same_layout or not _same_attributes([w.node for w in weights]):
        return None
    shapes = [w.shape for w in weights]
    if any(s[:axis] + s[axis + 1 :] != shapes[0][:axis] + shapes[0][axis + 1 :] for s in shapes):
        return None
    sources = [w.data for w in weights]
    shape = shapes[0][:axis] + (sum(s[axis] for s in shapes),) + shapes[0][axis + 1 :]
    data = LazyArray(shape, lambda: np.concatenate([_array(d) for d in sources], axis=axis))
    if first.axis is None or (not first.blocked and axis != first.axis):
        if _equal_operands([w.scale for w in weights]) and _equal_operands(
            [w.zero_point for w in weights]
        ):
            return first.replace(data=data, shape=shape)
        if first.axis is None and opset >= 13:
            weights = [_per_axis(w, axis) for w in weights]
        elif first.axis is not None and opset >= 21:
            restated = [_one_block(w, axis) for w in weights]
            if any(w is None for w in restated):
                return None
            weights = restated
        else:
            return None
        first = weights[0]
    if first.blocked and axis == first.axis:
        if any(w.shape[axis] % w.block_size for w in weights[:-1]):
            return None
    scale_axis = axis if first.blocked else 0

    def joined(pick) -> np.ndarray:
        return np.concatenate([_array(pick(w)) for w in weights], axis=scale_axis)

    zero_point = None if first.zero_point is None else joined(lambda w: w.zero_point)
    return first.replace(
        data=data, shape=shape, scale=joined(lambda w: w.scale), zero_point=zero_point
    )


def single_block_as_per_tensor(weight: QuantizedWeight) -> QuantizedWeight:
    """A blocked 1-D weight with one block restated per tensor (scalar scale), same numbers.

    ONNX Runtime reads a one-element 1-D scale as per-tensor and then refuses a block size
    (measured with ORT 1.32: "block_size must be 0 for per-tensor quantization").
    """
    if not weight.blocked or len(weight.shape) != 1 or _shape(weight.scale) != (1,):
        return weight
    return weight.replace(axis=None, block_size=0, **_on_scales(weight, lambda a: a.reshape(())))
