"""What the ONNX layout ops do to one tensor, read off a node, for folding them on weights.

:class:`~onnx_moe_fuse.rewrites.canonical.weights.fold_weight_layout.FoldWeightLayoutPass` folds
``Transpose``, ``Reshape``, ``Squeeze``, ``Unsqueeze``, ``Concat``, ``Slice``, ``Split``, ``Cast``
and ``Identity`` on constant weights, and pushes them through ``DequantizeLinear``. Both need the
same facts about a node: its permutation, its target shape, the indices it keeps, its split sizes.
This module reads those facts (from inputs or, in older opsets, attributes), works out each
output's shape without touching the data, and says how numpy computes it; numpy moves elements
without arithmetic, so folding is bit-exact. ``Cast`` is folded where the conversion is exact
(widening), and float32 -> float16/bfloat16, whose rounding numpy does as ONNX Runtime does (to
nearest even, measured bit for bit); other rounding casts are left in the graph.

Every reader returns None when it cannot establish the fact (a non-constant parameter, an
out-of-range axis, a malformed node): the caller then leaves the node alone.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.facts import attr_int, const_ints, node_axes, normalize_axes

__all__ = [
    "LAYOUT_OPS",
    "transpose_perm",
    "reshaped_shape",
    "slice_indices",
    "split_sizes",
    "unstacks",
    "concat_axis",
    "exact_cast_target",
    "take_kept",
    "FoldedOutput",
    "plan_layout_op",
]

LAYOUT_OPS = frozenset(
    {"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Concat", "Slice", "Split", "Cast", "Identity"}
)
"""Default-domain ops that only move, select or exactly convert elements."""

_RESHAPE_LIKE = frozenset({"Reshape", "Squeeze", "Unsqueeze"})

Shape = tuple[int, ...]


def transpose_perm(node: ir.Node, rank: int) -> list[int] | None:
    """The permutation of a ``Transpose`` on a tensor of ``rank`` (reversed axes by default)."""
    attr = node.attributes.get("perm")
    if attr is None:
        return list(reversed(range(rank)))
    if attr.is_ref():
        return None
    perm = [int(p) for p in attr.value]
    if sorted(perm) != list(range(rank)):
        return None
    return perm


def _reshape_target(node: ir.Node, in_shape: Shape) -> Shape | None:
    """Output shape of ``Reshape``: 0 copies the input dim (unless allowzero), -1 is inferred."""
    if len(node.inputs) < 2:
        return None
    target = const_ints(node.inputs[1])
    if target is None:
        return None
    allow_zero = attr_int(node, "allowzero", 0)
    dims: list[int] = []
    inferred = None
    for i, d in enumerate(target):
        if d == 0 and not allow_zero:
            if i >= len(in_shape):
                return None
            dims.append(in_shape[i])
        elif d == -1:
            if inferred is not None:
                return None
            inferred = i
            dims.append(1)
        elif d < 0:
            return None
        else:
            dims.append(d)
    total = int(np.prod(in_shape, dtype=np.int64))
    known = int(np.prod(dims, dtype=np.int64))
    if inferred is not None:
        if known == 0 or total % known:
            return None
        dims[inferred] = total // known
    elif known != total:
        return None
    return tuple(dims)


def reshaped_shape(node: ir.Node, in_shape: Shape) -> Shape | None:
    """Output shape of a ``Reshape``, ``Squeeze`` or ``Unsqueeze`` applied to ``in_shape``."""
    if node.op_type == "Reshape":
        return _reshape_target(node, in_shape)
    axes = node_axes(node, 1)
    if axes is None:
        return None
    if node.op_type == "Squeeze":
        if not axes:
            return tuple(d for d in in_shape if d != 1)
        norm = normalize_axes(axes, len(in_shape))
        if norm is None or len(set(norm)) != len(norm) or any(in_shape[a] != 1 for a in norm):
            return None
        return tuple(d for i, d in enumerate(in_shape) if i not in norm)
    if node.op_type == "Unsqueeze":
        out_rank = len(in_shape) + len(axes)
        norm = normalize_axes(axes, out_rank)
        if not axes or norm is None or len(set(norm)) != len(norm):
            return None
        rest = iter(in_shape)
        return tuple(1 if i in norm else next(rest) for i in range(out_rank))
    return None


def _slice_params(node: ir.Node) -> tuple[list[int], list[int], list[int] | None, list[int] | None]:
    """``(starts, ends, axes, steps)`` of a ``Slice``: inputs from opset 10, attributes before."""
    if len(node.inputs) >= 3:
        starts = const_ints(node.inputs[1])
        ends = const_ints(node.inputs[2])
        axes = steps = None
        if len(node.inputs) > 3 and node.inputs[3] is not None:
            axes = const_ints(node.inputs[3])
            if axes is None:
                raise ValueError("non-constant axes")
        if len(node.inputs) > 4 and node.inputs[4] is not None:
            steps = const_ints(node.inputs[4])
            if steps is None:
                raise ValueError("non-constant steps")
        if starts is None or ends is None:
            raise ValueError("non-constant starts/ends")
        return starts, ends, axes, steps
    attrs = node.attributes
    if "starts" not in attrs or "ends" not in attrs or any(a.is_ref() for a in attrs.values()):
        raise ValueError("attributes missing")
    axes_attr = attrs.get("axes")
    return (
        [int(v) for v in attrs["starts"].value],
        [int(v) for v in attrs["ends"].value],
        None if axes_attr is None else [int(v) for v in axes_attr.value],
        None,
    )


def slice_indices(node: ir.Node, in_shape: Shape) -> list[np.ndarray | None] | None:
    """Per axis, the indices a ``Slice`` keeps (None: the whole axis), with ONNX's clamping."""
    try:
        starts, ends, axes, steps = _slice_params(node)
    except ValueError:
        return None
    rank = len(in_shape)
    if axes is None:
        axes = list(range(len(starts)))
    if steps is None:
        steps = [1] * len(starts)
    axes = normalize_axes(axes, rank)
    if axes is None or len(set(axes)) != len(axes) or not len(starts) == len(ends) == len(axes):
        return None
    if len(steps) != len(axes) or 0 in steps:
        return None
    kept: list[np.ndarray | None] = [None] * rank
    for axis, start, end, step in zip(axes, starts, ends, steps, strict=True):
        dim = in_shape[axis]
        start = start + dim if start < 0 else start
        end = end + dim if end < 0 else end
        if step > 0:
            start, end = min(max(start, 0), dim), min(max(end, 0), dim)
        else:
            start, end = min(max(start, 0), dim - 1), min(max(end, -1), dim - 1)
        kept[axis] = np.arange(start, end, step, dtype=np.int64)
    return kept


def split_sizes(node: ir.Node, in_shape: Shape) -> tuple[int, list[int]] | None:
    """``(axis, sizes)`` of a ``Split``: sizes from the input, the attribute or num_outputs."""
    axes = normalize_axes([attr_int(node, "axis", 0)], len(in_shape))
    if axes is None:
        return None
    axis, dim, parts = axes[0], in_shape[axes[0]], len(node.outputs)
    if len(node.inputs) > 1 and node.inputs[1] is not None:
        sizes = const_ints(node.inputs[1])
    elif "split" in node.attributes:
        attr = node.attributes["split"]
        sizes = None if attr.is_ref() else [int(v) for v in attr.value]
    elif "num_outputs" in node.attributes:
        # Opset 18: chunks of ceil(dim / n), the last one smaller.
        chunk = -(-dim // parts)
        sizes = [chunk] * (parts - 1) + [dim - chunk * (parts - 1)]
    else:
        sizes = [dim // parts] * parts if dim % parts == 0 else None
    if sizes is None or len(sizes) != parts or sum(sizes) != dim or min(sizes) <= 0:
        return None
    return axis, sizes


def unstacks(axis: int, sizes: Sequence[int]) -> bool:
    """Whether a Split with ``(axis, sizes)`` cuts a stack into its single entries.

    ``Split(W, [1] * E, axis=0)`` then ``Squeeze(0)`` is how torch's grouped_mm exports (and the
    sorted-experts forms that read them) reach expert ``e`` of the stacked weight ``W``: the
    form reads the stack through it. Folding it would scatter the stack into E constants (the
    grouped_mm exports then stop fusing, measured), so the pass leaves such a Split alone.
    """
    return axis == 0 and len(sizes) > 1 and all(size == 1 for size in sizes)


def concat_axis(node: ir.Node, rank: int) -> int | None:
    """The non-negative ``axis`` of a ``Concat`` over tensors of ``rank``."""
    axis = attr_int(node, "axis", None)
    if axis is None:
        return None
    axes = normalize_axes([axis], rank)
    return None if axes is None else axes[0]


_INT_RANGES = {
    ir.DataType.INT4: (-8, 7),
    ir.DataType.UINT4: (0, 15),
    ir.DataType.INT8: (-(2**7), 2**7 - 1),
    ir.DataType.UINT8: (0, 2**8 - 1),
    ir.DataType.INT16: (-(2**15), 2**15 - 1),
    ir.DataType.UINT16: (0, 2**16 - 1),
    ir.DataType.INT32: (-(2**31), 2**31 - 1),
    ir.DataType.UINT32: (0, 2**32 - 1),
    ir.DataType.INT64: (-(2**63), 2**63 - 1),
    ir.DataType.UINT64: (0, 2**64 - 1),
    ir.DataType.BOOL: (0, 1),
}
# Largest power of two up to which every integer is representable (significand bits + 1).
_FLOAT_EXACT_INT = {
    ir.DataType.BFLOAT16: 2**8,
    ir.DataType.FLOAT16: 2**11,
    ir.DataType.FLOAT: 2**24,
    ir.DataType.DOUBLE: 2**53,
}
_FLOAT_WIDENING = frozenset(
    {
        (ir.DataType.FLOAT16, ir.DataType.FLOAT),
        (ir.DataType.FLOAT16, ir.DataType.DOUBLE),
        (ir.DataType.BFLOAT16, ir.DataType.FLOAT),
        (ir.DataType.BFLOAT16, ir.DataType.DOUBLE),
        (ir.DataType.FLOAT, ir.DataType.DOUBLE),
    }
)


#: Narrowing float casts whose folded value is the runtime's, bit for bit: numpy (ml_dtypes)
#: rounds to nearest even and overflows to inf, as ONNX's Cast; measured against ORT 1.32 CPU's
#: Cast on 120,000 values, halfway cases and overflow included (mixed-precision exports).
_FLOAT_ROUNDED = frozenset(
    {(ir.DataType.FLOAT, ir.DataType.FLOAT16), (ir.DataType.FLOAT, ir.DataType.BFLOAT16)}
)


def _is_exact_cast(src: ir.DataType, dst: ir.DataType) -> bool:
    """True when folding a Cast from ``src`` to ``dst`` gives exactly the runtime's values.

    Every value converts without rounding or wrapping, or (:data:`_FLOAT_ROUNDED`) rounds as
    the runtime's Cast rounds it.
    """
    if src == dst or (src, dst) in _FLOAT_WIDENING or (src, dst) in _FLOAT_ROUNDED:
        return True
    if src not in _INT_RANGES:
        return False
    low, high = _INT_RANGES[src]
    if dst in _INT_RANGES and dst != ir.DataType.BOOL:
        dst_low, dst_high = _INT_RANGES[dst]
        return dst_low <= low and high <= dst_high
    if dst in _FLOAT_EXACT_INT:
        return max(-low, high) <= _FLOAT_EXACT_INT[dst]
    return False


def exact_cast_target(node: ir.Node, src: ir.DataType) -> ir.DataType | None:
    """The ``to`` type of a ``Cast`` from ``src`` if that conversion is exact, else None."""
    to = attr_int(node, "to", None)
    if to is None:
        return None
    try:
        dst = ir.DataType(to)
    except ValueError:
        return None
    return dst if _is_exact_cast(src, dst) else None


def _cast(array: np.ndarray, target: ir.DataType) -> np.ndarray:
    """``array`` as ``target``; a value beyond a float16's range becomes inf, as the Cast's."""
    with np.errstate(over="ignore"):  # the overflow is the op's meaning, not a fault
        return array.astype(target.numpy())


def take_kept(array: np.ndarray, kept: Sequence[np.ndarray | None]) -> np.ndarray:
    """``array`` restricted, axis by axis, to the indices in ``kept`` (None keeps the axis)."""
    for axis, indices in enumerate(kept):
        if indices is not None:
            array = np.take(array, indices, axis=axis)
    return array


@dataclasses.dataclass(frozen=True)
class FoldedOutput:
    """One output of a layout op on constants: known shape and type, numbers on demand.

    ``compute`` takes the arrays of the op's data inputs and returns this output's array; the
    caller decides when to run it (the pass defers it until someone reads the weight).
    """

    shape: Shape
    dtype: ir.DataType
    compute: Callable[[Sequence[np.ndarray]], np.ndarray]


def plan_layout_op(
    node: ir.Node, inputs: Sequence[tuple[Shape, ir.DataType]]
) -> list[FoldedOutput] | None:
    """How to fold layout op ``node`` on constant data inputs of these shapes and types.

    ``inputs`` describes the data inputs only (all of Concat's, the first of the others); the
    other parameters are read from the node as constants. Returns None if not foldable.
    """
    op = node.op_type
    shape, dtype = inputs[0]
    if op == "Identity":
        return [FoldedOutput(shape, dtype, lambda arrays: arrays[0])]
    if op == "Cast":
        target = exact_cast_target(node, dtype)
        if target is None:
            return None
        return [FoldedOutput(shape, target, lambda arrays: _cast(arrays[0], target))]
    if op == "Transpose":
        perm = transpose_perm(node, len(shape))
        if perm is None:
            return None
        out_shape = tuple(shape[p] for p in perm)
        return [
            FoldedOutput(
                out_shape, dtype, lambda arrays: np.ascontiguousarray(arrays[0].transpose(perm))
            )
        ]
    if op in _RESHAPE_LIKE:
        target_shape = reshaped_shape(node, shape)
        if target_shape is None:
            return None
        return [FoldedOutput(target_shape, dtype, lambda arrays: arrays[0].reshape(target_shape))]
    if op == "Slice":
        kept = slice_indices(node, shape)
        if kept is None:
            return None
        out_shape = tuple(d if k is None else len(k) for d, k in zip(shape, kept, strict=True))
        return [
            FoldedOutput(
                out_shape, dtype, lambda arrays: np.ascontiguousarray(take_kept(arrays[0], kept))
            )
        ]
    if op == "Split":
        return _plan_split(node, shape, dtype)
    if op == "Concat":
        return _plan_concat(node, inputs)
    return None


def _plan_split(node: ir.Node, shape: Shape, dtype: ir.DataType) -> list[FoldedOutput] | None:
    """The outputs of a ``Split``: each one slice of the input along the split axis."""
    split = split_sizes(node, shape)
    if split is None or unstacks(*split):
        return None
    axis, sizes = split
    outputs = []
    start = 0
    for size in sizes:
        cut = (slice(None),) * axis + (slice(start, start + size),)
        out_shape = shape[:axis] + (size,) + shape[axis + 1 :]
        outputs.append(
            FoldedOutput(
                out_shape, dtype, lambda arrays, cut=cut: np.ascontiguousarray(arrays[0][cut])
            )
        )
        start += size
    return outputs


def _plan_concat(
    node: ir.Node, inputs: Sequence[tuple[Shape, ir.DataType]]
) -> list[FoldedOutput] | None:
    """The output of ``Concat`` on constants of one dtype whose shapes agree off the axis."""
    shapes = [shape for shape, _ in inputs]
    if len({dtype for _, dtype in inputs}) != 1 or len({len(s) for s in shapes}) != 1:
        return None
    axis = concat_axis(node, len(shapes[0]))
    if axis is None or len({s[:axis] + s[axis + 1 :] for s in shapes}) != 1:
        return None
    out_shape = shapes[0][:axis] + (sum(s[axis] for s in shapes),) + shapes[0][axis + 1 :]
    return [FoldedOutput(out_shape, inputs[0][1], lambda arrays: np.concatenate(arrays, axis=axis))]
