"""Canonicalisation: fold shape arithmetic, so that the layer proofs read constant shapes.

Exporters and onnx's function inliner compute Reshape / Expand / Split / Range shapes in the
graph: ``Shape(x)`` -> ``Gather`` / ``Slice`` -> ``Concat`` with constants, ``Mul`` / ``Div`` of
shape scalars, ``Squeeze`` / ``Unsqueeze`` of the pieces. The layer proofs read constant
targets only (``_graph_facts.reshape_dims``), so :class:`FoldShapesPass` rewrites them:

1. onnxscript's ``fold_constants``, allowed to fold only integer shape arithmetic (never a
   weight: DequantizeLinear, Transpose or Reshape of a constant weight stay as they are), folds
   what the declared shapes fix (``Shape`` of a static value, ``Gather`` / ``Concat`` of such
   pieces, a Reshape / Expand to the declared shape of its input). It reads declared shapes
   only, so a Shape of an undeclared intermediate, a product of symbolic dims or a target with
   two symbolic dims is left to the next step;
2. every shape value is then evaluated symbolically (:func:`shape_value`: each element a
   :class:`~onnx_moe_fuse.rewrites._graph_facts.Dim`, unknown sizes as symbols tied to the value
   and axis they come from, through :func:`~onnx_moe_fuse.rewrites._graph_facts.value_dims`).
   A shape that evaluates to numbers becomes a constant. A ``Reshape`` target that does not
   becomes one with ``0`` for an entry that is the input's dim at the same place and ``-1`` for
   the one entry left unknown; an ``Expand`` shape gets ``1`` where it repeats the input's dim;
3. a ``Reshape`` / ``Expand`` that then provably keeps its input's shape is dropped, and a
   Reshape into a MatMul that only inserts unit axes becomes the ``Unsqueeze`` the rules read;
4. the GroupedMatMul function body (ONNX opset 29, as onnx's inliner writes it, or by hand:
   ``Gather(W, Reshape(idx, [M*S]))`` + ``MatMul`` on ``[M*S, 1, K]`` rows + ``Reshape`` to
   ``[M, S, N]``) is rewritten into the per-slot ``Gather(W, idx)`` + ``MatMul`` form that
   ``rewrites/moe_layer.py`` matches (:func:`grouped_rows_rules`, at the end of this module).

Every rewrite is exact: the same elements in the same order, the same products. What the pass
cannot prove (a data-dependent shape, an unknown rank, a dim it cannot tie to the input) it
leaves as it is; it never raises on a valid model. A replaced value's name goes to its
replacement; new values get fresh names. Nodes that become dead are removed, and only those.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
import onnxscript.optimizer as onnxscript_optimizer
from onnxscript.rewriter import pattern
from onnxscript.rewriter._basics import MatchResult

from onnx_moe_fuse.rewrites._graph_facts import (
    Dim,
    attr_int,
    const_ints,
    node_axes,
    product,
    reshape_dims,
    value_dims,
)

__all__ = ["FoldShapesPass", "ShapeValue", "shape_value", "grouped_rows_rules"]

_SHAPE_TYPES = frozenset({ir.DataType.INT64, ir.DataType.INT32})
#: Ops that compute shapes from shapes: the only ones the constant folder may evaluate.
_SHAPE_ARITHMETIC = frozenset(
    {
        "Shape", "Size", "Gather", "Slice", "Concat", "Squeeze", "Unsqueeze", "Reshape", "Cast",
        "Identity", "Mul", "Div", "Add", "Sub", "Range", "ReduceProd", "Constant",
    }
)  # fmt: skip
#: A shape value has at most this many elements (longer integer tensors are data).
_MAX_RANK = 64
#: Inputs that are int64 by the op's definition (their dtype is known without inference).
_INT64_INPUTS = {
    "Reshape": (1,), "Expand": (1,), "Tile": (1,), "ConstantOfShape": (0,), "Split": (1,),
    "Unsqueeze": (1,), "Squeeze": (1,), "TopK": (1,), "Slice": (1, 2, 3, 4),
    "ReduceSum": (1,), "ReduceMean": (1,), "ReduceMax": (1,), "ReduceMin": (1,),
}  # fmt: skip


@dataclass(frozen=True)
class ShapeValue:
    """An integer tensor of rank 0 or 1 whose elements are known as :class:`Dim` products."""

    dims: tuple[Dim, ...]
    scalar: bool

    @property
    def ints(self) -> list[int] | None:
        """The elements as numbers, or None while one is symbolic."""
        return None if any(d.syms for d in self.dims) else [d.coef for d in self.dims]


#: The ops :func:`shape_value` evaluates (anything else is not a shape computation to it).
_EVALUATED = frozenset(
    {"Shape", "Size", "Identity", "Cast", "Gather", "Slice", "Concat", "Unsqueeze", "Squeeze",
     "Reshape", "ReduceProd", "Mul", "Div", "Add", "Sub"}
)  # fmt: skip


def shape_value(value: ir.Value | None, _depth: int = 0) -> ShapeValue | None:
    """What the shape tensor ``value`` holds, element by element; None when not provable."""
    if value is None or _depth > 32 or value.is_graph_input():
        return None
    if value.dtype is not None and value.dtype not in _SHAPE_TYPES:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    if tensor is not None:
        if tensor.dtype not in _SHAPE_TYPES or len(tensor.shape) > 1 or tensor.size > _MAX_RANK:
            return None
        arr = tensor.numpy()
        return ShapeValue(tuple(Dim.of(int(v)) for v in arr.reshape(-1)), arr.ndim == 0)
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx") or value is not node.outputs[0]:
        return None
    if node.op_type == "Constant":  # value_int(s), as onnxscript's folder writes them
        ints = node.attributes.get("value_ints") or node.attributes.get("value_int")
        if ints is None or ints.is_ref():
            return None
        scalar = ints.name == "value_int"
        values = [ints.value] if scalar else list(ints.value)
        return ShapeValue(tuple(Dim.of(int(v)) for v in values), scalar)
    if node.op_type not in _EVALUATED or (value.shape is not None and len(value.shape) > 1):
        return None  # checked before the inputs: never a walk over the data path
    try:
        return _evaluate(node, _depth + 1)
    except (TypeError, ValueError, IndexError, ZeroDivisionError):  # an unreadable node: no fact
        return None


def _evaluate(node: ir.Node, depth: int) -> ShapeValue | None:
    op, ins = node.op_type, node.inputs
    if op == "Shape":
        dims = value_dims(ins[0])
        if dims is None:
            return None
        start, end = attr_int(node, "start", 0), attr_int(node, "end", None)
        return ShapeValue(tuple(dims[start:end]), False)
    if op == "Size":
        dims = value_dims(ins[0])
        return None if dims is None else ShapeValue((product(dims),), True)
    args = [shape_value(v, depth) for v in ins]
    if not args or args[0] is None:
        return None
    first = args[0]
    if op in ("Identity", "Cast"):
        to = attr_int(node, "to", None)
        ok = op == "Identity" or (to is not None and ir.DataType(to) in _SHAPE_TYPES)
        return first if ok else None
    if op == "Gather" and len(args) > 1 and args[1] is not None and not first.scalar:
        index = args[1].ints
        if attr_int(node, "axis", 0) != 0 or index is None:
            return None
        rank = len(first.dims)
        picked = tuple(first.dims[i + rank if i < 0 else i] for i in index)
        return ShapeValue(picked, args[1].scalar)
    if op == "Slice" and not first.scalar:
        return _slice(first, args[1:])
    if op == "Concat":
        if attr_int(node, "axis", None) not in (0, -1) or any(a is None or a.scalar for a in args):
            return None
        return ShapeValue(tuple(d for a in args for d in a.dims), False)  # type: ignore[union-attr]
    if op == "Unsqueeze" and first.scalar and node_axes(node) in ([0], [-1]):
        return ShapeValue(first.dims, False)
    if op in ("Squeeze", "Reshape") and len(first.dims) == 1:
        target = const_ints(ins[1]) if op == "Reshape" and len(ins) > 1 else None
        if op == "Squeeze" and node_axes(node) in ([], [0], [-1]):
            return ShapeValue(first.dims, True)
        if target is not None and target in ([], [1], [-1]):
            return ShapeValue(first.dims, target == [])
        return None
    if op == "ReduceProd" and not first.scalar and node_axes(node) in ([], [0], [-1]):
        if attr_int(node, "noop_with_empty_axes", 0) and not node_axes(node):
            return None
        return ShapeValue((product(first.dims),), not attr_int(node, "keepdims", 1))
    if op in ("Mul", "Div", "Add", "Sub") and len(args) == 2 and args[1] is not None:
        return _arithmetic(op, first, args[1])
    return None


def _slice(data: ShapeValue, args: list[ShapeValue | None]) -> ShapeValue | None:
    """``Slice`` of a 1-D shape along axis 0 with constant starts / ends (/ axes, steps > 0)."""
    ints = [a.ints if a is not None else None for a in args]
    if len(ints) < 2 or ints[0] is None or ints[1] is None or len(ints[0]) != 1:
        return None
    if len(ints) > 2 and ints[2] not in ([0], [-1]):
        return None
    step = ints[3][0] if len(ints) > 3 and ints[3] is not None else 1
    if len(ints) > 3 and ints[3] is None or step <= 0:
        return None
    return ShapeValue(tuple(data.dims[ints[0][0] : ints[1][0] : step]), False)


def _arithmetic(op: str, a: ShapeValue, b: ShapeValue) -> ShapeValue | None:
    """Element-wise ``Mul`` / exact ``Div`` of products, ``Add`` / ``Sub`` of numbers."""
    if len(a.dims) != len(b.dims) and 1 not in (len(a.dims), len(b.dims)):
        return None
    n = max(len(a.dims), len(b.dims))
    xs = a.dims * n if len(a.dims) == 1 else a.dims
    ys = b.dims * n if len(b.dims) == 1 else b.dims
    out = []
    for x, y in zip(xs, ys, strict=True):
        if op == "Mul":
            out.append(x * y)
        elif op == "Div":
            q = x.divide(y)  # only an exact quotient: integer Div truncates otherwise
            if q is None or (q.coef < 0):
                return None
            out.append(q)
        elif x.syms or y.syms:
            return None
        else:
            out.append(Dim.of(x.coef + y.coef if op == "Add" else x.coef - y.coef))
    return ShapeValue(tuple(out), a.scalar and b.scalar)


# -- the pass ----------------------------------------------------------------------------------


def _fold_only_shape_arithmetic(node: ir.Node) -> bool | None:
    """``should_fold`` for onnxscript's folder: integer shape arithmetic, never anything else."""
    if node.domain not in ("", "ai.onnx") or node.op_type not in _SHAPE_ARITHMETIC:
        return False
    if any(v.dtype not in _SHAPE_TYPES for v in node.outputs):
        return False
    return None  # the folder's own size limits then apply


class _Names:
    """Fresh value names: none collides with a name in the graph, nor with another fresh one."""

    def __init__(self, graph: ir.Graph) -> None:
        self._taken = {v.name for v in [*graph.inputs, *graph.outputs] if v.name}
        self._taken.update(graph.initializers)
        for node in ir.traversal.RecursiveGraphIterator(graph):
            self._taken.update(v.name for v in [*node.inputs, *node.outputs] if v and v.name)
        self._n = 0

    def __call__(self, base: str | None) -> str:
        while True:
            self._n += 1
            name = f"{base or 'shape'}__folded{self._n}"
            if name not in self._taken:
                self._taken.add(name)
                return name


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
        names = _Names(graph)  # after the folder, which names values of its own
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

    def _unflatten(self, model: ir.Model, names: _Names) -> bool:
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
    if value.dtype is None and index in _INT64_INPUTS.get(node.op_type, ()):
        return ir.DataType.INT64
    dtype = _traced_dtype(value)
    return dtype if dtype in _SHAPE_TYPES else None


def _traced_dtype(value: ir.Value, depth: int = 0) -> ir.DataType | None:
    """The element type of a shape computation's value, from its chain where undeclared."""
    if value.dtype is not None or depth > 64:
        return value.dtype
    tensor = ir.convenience.get_const_tensor(value)
    node = value.producer()
    if tensor is not None:
        return tensor.dtype
    if node is None or node.op_type not in _SHAPE_ARITHMETIC:
        return None
    if node.op_type in ("Shape", "Size"):
        return ir.DataType.INT64
    if node.op_type == "Cast":
        to = attr_int(node, "to", None)
        return None if to is None else ir.DataType(to)
    first = node.inputs[0] if node.inputs else None
    return None if first is None else _traced_dtype(first, depth + 1)


def _replace_input(
    node: ir.Node, index: int, values: list[int], names: _Names, scalar: bool = False
) -> None:
    old, dtype = node.inputs[index], _input_dtype(node, index)
    assert old is not None and dtype is not None
    node.replace_input_with(index, _constant(node, values, dtype, names(old.name), scalar))


def _fold_shape_inputs(node: ir.Node, names: _Names) -> bool:
    """Make every computed integer input of ``node`` that evaluates to numbers a constant."""
    if node.op_type in _SHAPE_ARITHMETIC and node.op_type != "Reshape":
        if node.outputs and shape_value(node.outputs[0]) is not None:
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


def _simplify_reshape(node: ir.Node, names: _Names) -> bool:
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


def _simplify_expand(node: ir.Node, names: _Names) -> bool:
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


def _reshape_as_unsqueeze(node: ir.Node, names: _Names) -> bool:
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


# -- the GroupedMatMul function body -> per-slot form ------------------------------------------


def _index_sources(flat: ir.Value) -> list[tuple[ir.Value, Dim]]:
    """The ``[M, S]`` values (with their ``S``) that ``flat``, ``[M*S]`` or ``[M*S, 1]``, relabels.

    ``flat`` is a chain of Reshapes of them: a Reshape only relabels the same elements in the
    same order, so each rank-2 value on the chain is ``flat`` read as ``[M, S]``.
    """
    dims = value_dims(flat)
    if dims is None or not dims or any(d != Dim.of(1) for d in dims[1:]):
        return []  # not one index per row: [R] or [R, 1, ...]
    out = []
    value = flat
    for _ in range(8):
        node = value.producer()
        if node is None or node.op_type != "Reshape" or node.domain not in ("", "ai.onnx"):
            break
        value = node.inputs[0]
        vd = value_dims(value)
        if vd is not None and len(vd) == 2 and not vd[1].syms:
            out.append((value, vd[1]))
    return out


def _index_for(flat: ir.Value, s: Dim) -> ir.Value | None:
    """The ``[M, S]`` index that ``flat`` flattens, for this ``S``; None if there is none."""
    return next((v for v, vs in _index_sources(flat) if vs == s), None)


def _reshapes_to(node: ir.Node, dims_in: list[Dim], want: list[Dim], kept: bool = True) -> bool:
    """``Reshape`` ``node`` maps ``dims_in`` to ``want``.

    ``kept``: the rewrite keeps this Reshape on a new input, so its target must copy no input
    dim (a ``0`` would read the new input's dims); a Reshape the rewrite removes may.
    """
    target = const_ints(node.inputs[1])
    allowzero = attr_int(node, "allowzero", 0)
    if target is None or (kept and 0 in target and not allowzero):
        return False
    return reshape_dims(dims_in, target, allowzero) == want


class _GroupedRowsRule(pattern.RewriteRuleClassBase):
    """Shared parts of the GroupedMatMul-body rules: the weight check, the per-slot emitter."""

    def __init__(self, names: _Names | None = None) -> None:
        """``names`` gives the new values fresh names (the replaced output keeps its own)."""
        super().__init__(type(self).__name__)
        self.names = names

    def _name(self, base: ir.Value | None) -> list[str] | int:
        return [self.names(base.name if base is not None else None)] if self.names else 1

    def _per_slot(self, op, lhs, axes, weight, idx, out_shape, out):
        """``Reshape(MatMul(Unsqueeze(lhs, axes), Gather(weight, idx)), out_shape)``."""
        axes_value = op.Constant(
            value=ir.tensor(np.array(axes, dtype=np.int64)), _outputs=self._name(lhs)
        )
        unsq = op.Unsqueeze(lhs, axes_value, _outputs=self._name(lhs))
        selected = op.Gather(weight, idx, axis=0, _outputs=self._name(weight))
        mm = op.MatMul(unsq, selected, _outputs=self._name(out))
        return op.Reshape(mm, out_shape, **_allowzero(out), _outputs=self._name(out))

    def _weights(self, weight: ir.Value, gather: ir.Node | None) -> list[Dim] | None:
        w = value_dims(weight)
        if w is None or len(w) != 3 or gather is None or attr_int(gather, "axis", 0) != 0:
            return None
        return w


class GroupedRowsTokens(_GroupedRowsRule):
    """GroupedMatMul body on tokens ``x [M, K]``, ``S`` experts each -> per-slot Gather/MatMul.

    ``Reshape(MatMul(Reshape(Expand?(Unsqueeze(x, [1]), [M|1, S, K]), [M*S, 1, K]),
    Gather(W, Reshape(idx, [M*S]))), [M, S, N])`` becomes
    ``Reshape(MatMul(Unsqueeze(x, [1, 2]), Gather(W, idx)), [M, S, N])``: the same ``[1, K] @
    [K, N]`` products, batched ``[M, S]`` instead of ``[M*S]`` (the output keeps its name).
    """

    def pattern(self, op, x, axes, repeat, rows_shape, weight, flat, out_shape):
        """The body's FC on the tokens, with or without the Expand."""
        unsq = op.Unsqueeze(x, axes, _outputs=["unsq"])
        repeated = pattern.OrValue([op.Expand(unsq, repeat, _outputs=["expand"]), unsq])
        rows = op.Reshape(repeated, rows_shape, _outputs=["rows"])
        selected = op.Gather(weight, flat, _outputs=["gather"])
        mm = op.MatMul(rows, selected)
        return op.Reshape(mm, out_shape, _outputs=["out"])

    @staticmethod
    def _slots(b: dict) -> Dim:
        """``S``: the Expand's repeat count (1 without an Expand)."""
        expand = b.get("expand")
        shape = const_ints(expand.producer().inputs[1]) if expand is not None else [1, 1, 1]
        return Dim.of(shape[1]) if shape is not None and len(shape) == 3 else Dim.of(-1)

    def check(self, context, x, weight, flat, **b) -> MatchResult:
        """Prove the ranks, the unsqueeze axis, the repeat, the row layout and the output."""
        result = MatchResult()
        w, xd, s = self._weights(weight, b["gather"].producer()), value_dims(x), self._slots(b)
        if w is None or xd is None or len(xd) != 2 or s.coef < 1:
            return result.fail("not a GroupedMatMul body on [M, K] tokens")
        if _index_for(flat, s) is None or len(value_dims(flat) or []) != 1:
            return result.fail(f"the experts are not selected by [M*{s}] flat indices")
        m, k = xd
        if w[1] != k or node_axes(b["unsq"].producer()) not in ([1], [-2]):
            return result.fail("the tokens are not made [M, 1, K] rows of K = W's K")
        repeated = [m, Dim.of(1), k]
        if b.get("expand") is not None:
            shape = const_ints(b["expand"].producer().inputs[1]) or []
            if not all(v == 1 or Dim.of(v) == d for v, d in ((shape[0], m), (shape[2], k))):
                return result.fail("the Expand changes another dim than S")
            repeated = [m, s, k]
        if not _reshapes_to(b["rows"].producer(), repeated, [m * s, Dim.of(1), k], kept=False):
            return result.fail("the rows are not [M*S, 1, K] in token-major order")
        if not _reshapes_to(b["out"].producer(), [m * s, Dim.of(1), w[2]], [m, s, w[2]]):
            return result.fail("the output is not reshaped to [M, S, N]")
        return result

    def rewrite(self, op, x, weight, flat, out_shape, **b):
        """Per-slot: ``Unsqueeze(x, [1, 2]) @ Gather(W, idx)``, reshaped as before."""
        idx = _index_for(flat, self._slots(b))
        return self._per_slot(op, x, [1, 2], weight, idx, out_shape, b["out"])


class GroupedRowsSlots(_GroupedRowsRule):
    """An FC on per-slot inputs flattened to rows -> the per-slot Gather/MatMul.

    ``Reshape(Squeeze?|Reshape?(MatMul(Unsqueeze(Reshape(a [M, S, K], [M*S, K])), Gather(W,
    ids))) (+ Gather(b, ids')), [M, S, N])``, where the unit axes make every row ``[1, K]`` and ``ids``
    is the ``[M, S]`` top-k index relabelled as ``[M*S]`` or ``[M*S, 1]`` (the GroupedMatMul
    function body on FC2's rows, or its per-slot decomposition with ``S = 1``), becomes
    ``Reshape(MatMul(Unsqueeze(a, [2]), Gather(W, idx)), [M, S, N]) (+ Gather(b, idx))``: the
    same ``[1, K] @ [K, N]`` products and bias rows, in the same order.
    """

    def pattern(
        self, op, rows, axes, weight, flat, drop_axes, drop_shape, bias, bias_flat, out_shape
    ):
        """An FC on flattened rows (+ a bias), its unit axes dropped by the final Reshape."""
        unsq = op.Unsqueeze(rows, axes, _outputs=["unsq"])
        selected = op.Gather(weight, flat, _outputs=["gather"])
        mm = op.MatMul(unsq, selected, _outputs=["mm"])
        relabelled = [op.Squeeze(mm, drop_axes), op.Reshape(mm, drop_shape), mm]
        dropped = pattern.OrValue(relabelled, name="dropped")
        bias_rows = op.Gather(bias, bias_flat, _outputs=["bias_gather"])
        biased = pattern.OrValue([op.Add(dropped, bias_rows), dropped])
        return op.Reshape(biased, out_shape, _outputs=["out"])

    @staticmethod
    def _rows_of(rows: ir.Value) -> tuple[ir.Value, list[Dim]] | None:
        """The per-slot ``a [M, S, K]`` that ``rows`` flattens to ``[M*S, K]``, and its dims."""
        node = rows.producer()
        if node is None or node.op_type != "Reshape" or node.domain not in ("", "ai.onnx"):
            return None
        per_slot = node.inputs[0]
        dims = value_dims(per_slot)
        if dims is None or len(dims) != 3 or dims[1].syms:
            return None
        flattens = _reshapes_to(node, dims, [dims[0] * dims[1], dims[2]], kept=False)
        return (per_slot, dims) if flattens else None

    def check(self, context, rows, weight, flat, **b) -> MatchResult:
        """Prove the rows, the unit axes, the row-wise experts and the output ``[M, S, N]``."""
        result = MatchResult()
        w, found = self._weights(weight, b["gather"].producer()), self._rows_of(rows)
        if w is None or found is None:
            return result.fail("not an FC on [M*S, K] rows of [M, S, K] per-slot inputs")
        (m, s, k), r = found[1], found[1][0] * found[1][1]
        lhs, rhs = value_dims(b["unsq"]), value_dims(b["gather"])
        if lhs is None or rhs is None or len(lhs) != len(rhs) or len(lhs) < 3 or k != w[1]:
            return result.fail("the rows and the selected experts do not pair up")
        units = [Dim.of(1)] * (len(lhs) - 3)
        if lhs != [r, *units, Dim.of(1), k] or rhs != [r, *units, k, w[2]]:
            return result.fail("each row is not one [1, K] @ [K, N] product with its expert")
        if _index_for(flat, s) is None:
            return result.fail(f"the experts are not selected by [M, {s}] indices")
        dropped = value_dims(b["dropped"])
        if dropped is None or not _reshapes_to(b["out"].producer(), dropped, [m, s, w[2]]):
            return result.fail("the output is not reshaped to [M, S, N]")
        if b.get("bias_gather") is not None:  # the same rows of a [G, N] bias, same shape
            gather, bd = b["bias_gather"].producer(), value_dims(b.get("bias"))
            if bd is None or len(bd) != 2 or bd[1] != w[2] or attr_int(gather, "axis", 0) != 0:
                return result.fail("the bias is not [G, N] rows selected along the group axis")
            same_rows = _index_for(b["bias_flat"], s) is _index_for(flat, s)
            if not same_rows or value_dims(b["bias_gather"]) != dropped:
                return result.fail("the bias rows are not the experts' rows, shaped as the product")
        return result

    def rewrite(self, op, rows, weight, flat, out_shape, **b):
        """Per-slot: ``Unsqueeze(a, [2]) @ Gather(W, idx)``, reshaped as before (+ bias)."""
        per_slot, dims = self._rows_of(rows)  # type: ignore[misc]
        idx = _index_for(flat, dims[1])
        product = self._per_slot(op, per_slot, [2], weight, idx, out_shape, b["out"])
        if b.get("bias_gather") is None:
            return product
        bias_rows = op.Gather(b["bias"], idx, axis=0, _outputs=self._name(b["bias"]))
        return op.Add(product, bias_rows, _outputs=self._name(b["out"]))


class GroupedRowsUnit(_GroupedRowsRule):
    """An FC with one expert per row (``S = 1``), as the folder leaves it -> per-slot form.

    With ``S = 1`` the body's Expand and Reshapes are no-ops that onnxscript's folder removes,
    leaving ``MatMul(Unsqueeze(x [M, K], [1]), Gather(W, ids))`` ``[M, 1, N]``, ``ids`` the
    ``[M, 1]`` top-1 index relabelled as ``[M]``. It becomes ``Squeeze(MatMul(Unsqueeze(x, [1,
    2]), Gather(W, idx)), [2])``, or, when ``x`` flattens per-slot inputs ``a [M, 1, K]``,
    ``Squeeze(MatMul(Unsqueeze(a, [2]), Gather(W, idx)), [2])``: the same products, the same
    ``[M, 1, N]`` result.
    """

    def pattern(self, op, x, axes, weight, flat):
        """The folded top-1 body."""
        unsq = op.Unsqueeze(x, axes, _outputs=["unsq"])
        selected = op.Gather(weight, flat, _outputs=["gather"])
        return op.MatMul(unsq, selected, _outputs=["out"])

    def check(self, context, x, weight, flat, **b) -> MatchResult:
        """Prove the ``[M, 1, K] @ [M, K, N]`` row products with the top-1 experts."""
        result = MatchResult()
        w, xd = self._weights(weight, b["gather"].producer()), value_dims(x)
        lhs, rhs = value_dims(b["unsq"]), value_dims(b["gather"])
        if w is None or xd is None or len(xd) != 2 or lhs is None or rhs is None:
            return result.fail("not a top-1 FC on [M, K] rows")
        m, k = xd
        if lhs != [m, Dim.of(1), k] or rhs != [m, k, w[2]] or k != w[1]:
            return result.fail("each row is not one [1, K] @ [K, N] product with its expert")
        if _index_for(flat, Dim.of(1)) is None:
            return result.fail("the experts are not selected by [M, 1] indices")
        return result

    def rewrite(self, op, x, weight, flat, **b):
        """Per-slot, with the slot axis of the ``[M, 1, ...]`` top-1 index kept."""
        idx = _index_for(flat, Dim.of(1))
        per_slot = GroupedRowsSlots._rows_of(x)  # a [M, 1, K] whose rows x is (else x itself)
        top1 = per_slot is not None and per_slot[1][1] == Dim.of(1)
        lhs, axes = (per_slot[0], [2]) if top1 else (x, [1, 2])  # type: ignore[index]
        axes_value = op.Constant(
            value=ir.tensor(np.array(axes, dtype=np.int64)), _outputs=self._name(lhs)
        )
        unsq = op.Unsqueeze(lhs, axes_value, _outputs=self._name(lhs))
        selected = op.Gather(weight, idx, axis=0, _outputs=self._name(weight))
        mm = op.MatMul(unsq, selected, _outputs=self._name(b["out"]))
        two = op.Constant(value=ir.tensor(np.array([2], dtype=np.int64)), _outputs=self._name(mm))
        return op.Squeeze(mm, two, _outputs=self._name(b["out"]))


class GroupedRowsBias(_GroupedRowsRule):
    """``Reshape(Gather(b [G, N], Reshape(idx, [M*S])), [M, S, N])`` -> ``Gather(b, idx)``."""

    def pattern(self, op, bias, flat, out_shape):
        """The body's bias selection."""
        selected = op.Gather(bias, flat, _outputs=["gather"])
        return op.Reshape(selected, out_shape, _outputs=["out"])

    @staticmethod
    def _source(bias: ir.Value, flat: ir.Value, out: ir.Value) -> ir.Value | None:
        """The ``[M, S]`` index whose selected bias rows the Reshape makes ``[M, S, N]``."""
        bd = value_dims(bias)
        if bd is None or len(bd) != 2:
            return None
        selected = value_dims(out.producer().inputs[0])  # type: ignore[union-attr]
        for idx, s in _index_sources(flat):
            m = value_dims(idx)[0]  # type: ignore[index]
            restored = [m, s, bd[1]]
            if selected and _reshapes_to(out.producer(), selected, restored, kept=False):  # type: ignore[arg-type]
                return idx
        return None

    def check(self, context, bias, flat, **b) -> MatchResult:
        """Prove the indices flatten ``[M, S]`` and the output restores ``[M, S, N]``."""
        result = MatchResult()
        gather = b["gather"].producer()
        if gather is None or attr_int(gather, "axis", 0) != 0:
            return result.fail("the bias is not selected along the group axis")
        if self._source(bias, flat, b["out"]) is None:
            return result.fail("the selected bias is not reshaped to [M, S, N] of the indices")
        return result

    def rewrite(self, op, bias, flat, **b):
        """``Gather(b, idx)``: the same rows, in the same order."""
        idx = self._source(bias, flat, b["out"])
        return op.Gather(bias, idx, axis=0, _outputs=self._name(b["out"]))


def _allowzero(out: ir.Value) -> dict[str, int]:
    """The ``allowzero`` attribute of the Reshape that made ``out`` (none when 0)."""
    node = out.producer()
    value = attr_int(node, "allowzero", 0) if node is not None else 0
    return {"allowzero": value} if value else {}


def grouped_rows_rules(names: _Names | None = None) -> pattern.RewriteRuleSet:
    """The GroupedMatMul-body rules (bias rows, FC on the tokens, on per-slot rows, top-1).

    ``names`` (the pass's) names the values they create; without it the graph names them.
    """
    classes = (GroupedRowsBias, GroupedRowsTokens, GroupedRowsSlots, GroupedRowsUnit)
    rules = [cls.rule(names) for cls in classes]
    rule_set = pattern.RewriteRuleSet(rules)
    rule_set.remove_unused_nodes = False  # the pass removes what it made dead, and only that
    return rule_set
