"""Canonicalisation: the GroupedMatMul function body, as onnx's inliner writes it, to the per-slot form.

``Gather(W, Reshape(idx, [M*S]))`` + ``MatMul`` on ``[M*S, 1, K]`` rows + ``Reshape`` to
``[M, S, N]`` (ONNX opset 29's GroupedMatMul body, or the same by hand) computes the same
``[1, K] @ [K, N]`` products as the per-slot ``Gather(W, idx)`` + ``MatMul`` on
``Unsqueeze(x)`` that ``rewrites/moe/layer_rules.py`` matches, batched ``[M, S]`` instead of
``[M*S]``. :func:`grouped_rows_rules` rewrites one into the other (tokens, per-slot inputs,
``S = 1`` and the bias); :class:`~.fold_shapes.FoldShapesPass` runs them after folding the
body's shape arithmetic. The replaced output keeps its name; new values get fresh ones.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter._basics import MatchResult

from onnx_moe_fuse.rewrites.graph.dims import Dim, reshape_dims
from onnx_moe_fuse.rewrites.graph.facts import attr_int, const_ints, node_axes
from onnx_moe_fuse.rewrites.graph.fresh_names import FreshNames
from onnx_moe_fuse.rewrites.graph.symbolic_dims import value_dims

__all__ = [
    "GroupedRowsBias",
    "GroupedRowsSlots",
    "GroupedRowsTokens",
    "GroupedRowsUnit",
    "grouped_rows_rules",
]


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

    def __init__(self, names: FreshNames | None = None) -> None:
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


def grouped_rows_rules(names: FreshNames | None = None) -> pattern.RewriteRuleSet:
    """The GroupedMatMul-body rules (bias rows, FC on the tokens, on per-slot rows, top-1).

    ``names`` (the pass's) names the values they create; without it the graph names them.
    """
    classes = (GroupedRowsBias, GroupedRowsTokens, GroupedRowsSlots, GroupedRowsUnit)
    rules = [cls.rule(names) for cls in classes]
    rule_set = pattern.RewriteRuleSet(rules)
    rule_set.remove_unused_nodes = False  # the pass removes what it made dead, and only that
    return rule_set
