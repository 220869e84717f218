"""Canonicalisation: fold shape arithmetic, so that the layer proofs read constant shapes.

Exporters and onnx's function inliner compute Reshape / Expand / Split / Range shapes in the
graph: ``Shape(x)`` -> ``Gather`` / ``Slice`` -> ``Concat`` with constants, ``Mul`` / ``Div`` of
shape scalars, ``Squeeze`` / ``Unsqueeze`` of the pieces. The layer proofs read constant
targets only (``graph.dims.reshape_dims``), so :class:`FoldShapesPass` rewrites them:

1. onnxscript's ``fold_constants``, allowed to fold only integer shape arithmetic (never a
   weight: DequantizeLinear, Transpose or Reshape of a constant weight stay as they are), folds
   what the declared shapes fix (``Shape`` of a static value, ``Gather`` / ``Concat`` of such
   pieces, a Reshape / Expand to the declared shape of its input). It reads declared shapes
   only, so a Shape of an undeclared intermediate, a product of symbolic dims or a target with
   two symbolic dims is left to the next step;
2. every shape value is then evaluated symbolically (:func:`~onnx_moe_fuse.rewrites.graph.symbolic_dims.shape_value`: each element a
   :class:`~onnx_moe_fuse.rewrites.graph.facts.Dim`, unknown sizes as symbols tied to the value
   and axis they come from, through :func:`~onnx_moe_fuse.rewrites.graph.facts.value_dims`).
   A shape that evaluates to numbers becomes a constant. A ``Reshape`` target that does not
   becomes one with ``0`` for an entry that is the input's dim at the same place and ``-1`` for
   the one entry left unknown; an ``Expand`` shape gets ``1`` where it repeats the input's dim;
3. a ``Reshape`` / ``Expand`` that then provably keeps its input's shape is dropped, and a
   Reshape into a MatMul that only inserts unit axes becomes the ``Unsqueeze`` the rules read;
4. the GroupedMatMul function body (ONNX opset 29, as onnx's inliner writes it, or by hand:
   ``Gather(W, Reshape(idx, [M*S]))`` + ``MatMul`` on ``[M*S, 1, K]`` rows + ``Reshape`` to
   ``[M, S, N]``) is rewritten into the per-slot ``Gather(W, idx)`` + ``MatMul`` form that
   ``rewrites/moe/layer_rules.py`` matches (:func:`~.grouped_rows.grouped_rows_rules`, ``grouped_rows.py``).

Every rewrite is exact: the same elements in the same order, the same products. What the pass
cannot prove (a data-dependent shape, an unknown rank, a dim it cannot tie to the input) it
leaves as it is; it never raises on a valid model. A replaced value's name goes to its
replacement; new values get fresh names. Nodes that become dead are removed, and only those.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxscript.optimizer as onnxscript_optimizer

from onnx_moe_fuse.rewrites.canonical.experts.slots.grouped_rows import grouped_rows_rules
from onnx_moe_fuse.rewrites.graph.dims import Dim, reshape_dims
from onnx_moe_fuse.rewrites.graph.facts import attr_int, const_ints
from onnx_moe_fuse.rewrites.graph.fresh_names import FreshNames
from onnx_moe_fuse.rewrites.graph.symbolic_dims import (
    INT64_INPUTS,
    SHAPE_ARITHMETIC,
    SHAPE_TYPES,
    ShapeValue,
    shape_value,
    value_dims,
)

__all__ = ["FoldShapesPass", "ShapeValue", "shape_value", "grouped_rows_rules"]


# -- the pass ----------------------------------------------------------------------------------


def _fold_only_shape_arithmetic(node: ir.Node) -> bool | None:
    """``should_fold`` for onnxscript's folder: integer shape arithmetic, never anything else."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in SHAPE_ARITHMETIC:
        return False
    if any(v.dtype not in SHAPE_TYPES for v in node.outputs):
        return False
    return None  # the folder's own size limits then apply


class FoldShapesPass(ir.passes.InPlacePass):
    """Fold shape arithmetic into constants; unflatten GroupedMatMul function bodies."""

    def __init__(self, *, unflatten_grouped_rows: bool = True) -> None:
        """``unflatten_grouped_rows``: also rewrite GroupedMatMul bodies into the per-slot form."""
        super().__init__()
        self.unflatten_grouped_rows = unflatten_grouped_rows

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Run the folder, the symbolic folding and the GroupedMatMul-body rules on ``model``."""
        graph = model.graph
        already_dead = {id(n) for n in graph if _is_dead(n, graph)}
        try:
            folded = onnxscript_optimizer.fold_constants(
                model, should_fold=_fold_only_shape_arithmetic
            )
            modified = bool(folded.modified)
        except RuntimeError:  # the folder wraps an op it cannot evaluate; each fold it made
            modified = True  # before that is exact, so the graph stays valid: carry on
        names = FreshNames(graph, "folded")  # after the folder, which names values of its own
        for node in list(graph):
            if node.graph is not graph:  # removed by an earlier step
                continue
            modified |= _fold_shape_inputs(node, names)
            if node.op_type == "Reshape" and node.domain in ("", "ai.onnx"):
                modified |= _simplify_reshape(node, names)
            elif node.op_type == "Expand" and node.domain in ("", "ai.onnx"):
                modified |= _simplify_expand(node, names)
        # the rules refuse a match whose inner values have other users: dead ones count too
        _remove_new_dead(graph, already_dead)
        # the body rules run before and after the no-op drop: before, a body with S = 1 still
        # has the Reshapes / Expand that the rules read; after, a dropped no-op may open a match
        modified |= self._unflatten(model, names)
        for node in list(graph):
            modified |= _drop_if_noop(node, graph) or _reshape_as_unsqueeze(node, names)
        _remove_new_dead(graph, already_dead)
        modified |= self._unflatten(model, names)
        _remove_new_dead(graph, already_dead)
        return ir.passes.PassResult(model, modified)

    def _unflatten(self, model: ir.Model, names: FreshNames) -> bool:
        if not self.unflatten_grouped_rows:
            return False
        return bool(grouped_rows_rules(names).apply_to_model(model))


# -- graph edits -------------------------------------------------------------------------------


def _is_dead(node: ir.Node, graph: ir.Graph) -> bool:
    outputs = set(graph.outputs)
    return all(not v.uses() and v not in outputs for v in node.outputs)


def _remove_new_dead(graph: ir.Graph, keep: set[int]) -> None:
    """Remove the nodes that became dead (and what only they used); keep those dead before."""
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph)):
            if id(node) not in keep and _is_dead(node, graph):
                graph.remove(node, safe=True)
                changed = True


def _constant(
    node: ir.Node, values: list[int], dtype: ir.DataType, name: str, scalar: bool = False
) -> ir.Value:
    """A Constant node holding ``values`` (1-D, or a scalar), inserted before ``node``."""
    array = np.array(values[0] if scalar else values, dtype=dtype.numpy())
    const = ir.node("Constant", [], attributes={"value": ir.tensor(array, name=name)})
    const.outputs[0].name = name
    const.outputs[0].shape = ir.Shape(array.shape)
    const.outputs[0].dtype = dtype
    node.graph.insert_before(node, const)  # type: ignore[union-attr]
    return const.outputs[0]


def _input_dtype(node: ir.Node, index: int) -> ir.DataType | None:
    """The integer type of input ``index``: declared, int64 where the op says so, or traced."""
    value = node.inputs[index]
    if value is None:
        return None
    if value.dtype is None and index in INT64_INPUTS.get(node.op_type, ()):
        return ir.DataType.INT64
    dtype = _traced_dtype(value)
    return dtype if dtype in SHAPE_TYPES else None


def _traced_dtype(value: ir.Value, depth: int = 0) -> ir.DataType | None:
    """The element type of a shape computation's value, from its chain where undeclared."""
    if value.dtype is not None or depth > 64:
        return value.dtype
    tensor = ir.convenience.get_const_tensor(value)
    node = value.producer()
    if tensor is not None:
        return tensor.dtype
    if node is None or node.op_type not in SHAPE_ARITHMETIC:
        return None
    if node.op_type in ("Shape", "Size"):
        return ir.DataType.INT64
    if node.op_type == "Cast":
        to = attr_int(node, "to", None)
        return None if to is None else ir.DataType(to)
    first = node.inputs[0] if node.inputs else None
    return None if first is None else _traced_dtype(first, depth + 1)


def _replace_input(
    node: ir.Node, index: int, values: list[int], names: FreshNames, scalar: bool = False
) -> None:
    old, dtype = node.inputs[index], _input_dtype(node, index)
    assert old is not None and dtype is not None
    node.replace_input_with(index, _constant(node, values, dtype, names(old.name), scalar))


def _fold_shape_inputs(node: ir.Node, names: FreshNames) -> bool:
    """Make every computed integer input of ``node`` that evaluates to numbers a constant."""
    if node.op_type in SHAPE_ARITHMETIC and node.op_type != "Reshape":
        out = shape_value(node.outputs[0]) if node.outputs else None
        if out is not None and out.ints is not None:
            return False  # a link of a shape computation: its consumer folds the whole chain
    changed = False
    for i, v in enumerate(node.inputs):
        if v is None or _input_dtype(node, i) is None or v.const_value is not None:
            continue
        if ir.convenience.get_const_tensor(v) is not None:
            continue
        sv = shape_value(v)
        if sv is None or sv.ints is None:
            continue
        _replace_input(node, i, sv.ints, names, sv.scalar)
        changed = True
    return changed


def _simplify_reshape(node: ir.Node, names: FreshNames) -> bool:
    """A computed Reshape target -> constants, ``0`` (copy the input's dim) and one ``-1``."""
    if len(node.inputs) != 2 or node.inputs[1] is None or const_ints(node.inputs[1]) is not None:
        return False
    sv, dims = shape_value(node.inputs[1]), value_dims(node.inputs[0])
    if sv is None or sv.scalar or dims is None:
        return False
    allowzero = attr_int(node, "allowzero", 0)
    if allowzero and any(d == Dim.of(0) for d in sv.dims):
        return False  # a literal zero size: copy markers (0) or a -1 could not sit beside it
    target: list[int] = []
    for i, d in enumerate(sv.dims):
        if not d.syms:
            target.append(d.coef)
        elif i < len(dims) and dims[i] == d:
            target.append(0)  # the input's own dim at this place
        else:
            target.append(-1)  # Reshape infers it: what the valid original computed
    if target.count(-1) > 1:
        return False
    if 0 in target and allowzero:
        node.attributes.pop("allowzero")  # the new target's zeros are all copy markers
    _replace_input(node, 1, target, names)
    return True


def _simplify_expand(node: ir.Node, names: FreshNames) -> bool:
    """A computed Expand shape -> constants, with ``1`` where it repeats the input's dim."""
    if len(node.inputs) != 2 or node.inputs[1] is None or const_ints(node.inputs[1]) is not None:
        return False
    sv, dims = shape_value(node.inputs[1]), value_dims(node.inputs[0])
    if sv is None or sv.scalar or dims is None:
        return False
    pad = len(sv.dims) - len(dims)
    shape: list[int] = []
    for i, d in enumerate(sv.dims):
        if not d.syms:
            shape.append(d.coef)
        elif i >= pad and dims[i - pad] == d:
            shape.append(1)  # broadcasting keeps the input's dim
        else:
            return False
    _replace_input(node, 1, shape, names)
    return True


def _drop_if_noop(node: ir.Node, graph: ir.Graph) -> bool:
    """Remove a Reshape / Expand that provably returns its input's shape unchanged."""
    if node.op_type not in ("Reshape", "Expand") or node.domain not in ("", "ai.onnx"):
        return False
    if len(node.inputs) != 2 or node.inputs[0] is None or node.outputs[0] in graph.outputs:
        return False
    shape, dims = const_ints(node.inputs[1]), value_dims(node.inputs[0])
    if shape is None or dims is None:
        return False
    if node.op_type == "Reshape":
        same = reshape_dims(dims, shape, attr_int(node, "allowzero", 0)) == dims
    else:
        pad = len(dims) - len(shape)
        same = pad >= 0 and all(s == 1 or Dim.of(s) == dims[pad + i] for i, s in enumerate(shape))
    if not same:
        return False
    ir.convenience.replace_all_uses_with(node.outputs[0], node.inputs[0])
    return True


def _inserted_unit_axes(dims_in: list[Dim], dims_out: list[Dim]) -> list[int] | None:
    """The axes at which ``dims_out`` is ``dims_in`` with unit dims inserted (None if not)."""
    axes, j = [], 0
    for i, d in enumerate(dims_out):
        if j < len(dims_in) and d == dims_in[j]:
            j += 1
        elif d == Dim.of(1):
            axes.append(i)
        else:
            return None
    return axes if j == len(dims_in) and axes else None


def _reshape_as_unsqueeze(node: ir.Node, names: FreshNames) -> bool:
    """A Reshape into a MatMul that only inserts unit axes -> ``Unsqueeze`` (the rules' form).

    Only where every user is a MatMul: elsewhere a rule may read that Reshape as it is (a
    top-1 layer's ``[T, 1, H]`` rows, say).
    """
    if node.op_type != "Reshape" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return False
    out = node.outputs[0]
    if not out.uses() or any(user.op_type != "MatMul" for user, _ in out.uses()):
        return False
    target, dims = const_ints(node.inputs[1]), value_dims(node.inputs[0])
    if target is None or dims is None or out in node.graph.outputs:  # type: ignore[union-attr]
        return False
    dims_out = reshape_dims(dims, target, attr_int(node, "allowzero", 0))
    axes = None if dims_out is None else _inserted_unit_axes(dims, dims_out)
    if axes is None:
        return False
    axes_value = _constant(node, axes, ir.DataType.INT64, names(out.name))
    unsqueeze = ir.node("Unsqueeze", [node.inputs[0], axes_value])
    ir.convenience.replace_nodes_and_values(
        node.graph, node, [node], [unsqueeze], [out], [unsqueeze.outputs[0]]
    )  # the Unsqueeze's output takes the Reshape's name
    return True
