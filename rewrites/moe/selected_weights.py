"""Prove a layer's combine weights are per-selected, non-negative weights of its selection.

The router-agnostic routing (``docs/routing.md``) feeds a fused node the selection ``idx`` (the
indices of the TopK whose experts FC1 and FC2 gather) and the final weights ``w [..., k]`` the
combine multiplies the slots by, whatever router made them. That is exact when slot ``j`` of
``w`` is the weight of expert ``idx[t, j]`` for token ``t`` and ``w >= 0``. This module proves
both from the graph, walking back from ``w``:

* **per slot**: each value is ``slot`` (element ``[t, j]`` belongs to slot ``j`` of token ``t``),
  ``row`` (one value per token, ``[..., 1]``) or ``constant``. Slots come from the selection
  TopK's values, or from ``GatherElements(S, idx, axis=-1)`` of a score row ``S [..., E]`` proved
  row-wise in the tokens (:mod:`.token_rows`); element-wise ops combine slots with rows and
  constants (a renormalisation, a routing factor, a clamp, a Cast); a Softmax over the k slots
  and reductions over them (to a row) stay per token. Weights gathered at other experts than
  ``idx``, the values of another TopK, rows of another token, or a factor that depends on other
  tokens (a capacity mask from a CumSum over tokens) are refused, naming the node.
* **non-negative**: Sigmoid, Softmax, Exp, Relu, Abs, Sqrt, non-negative constants, and sums,
  products, quotients, maxima, clamps and gathers of non-negative values. MoE/QMoE weigh by
  non-negative weights only (their log-weights or ``router_weights``), so a weight that may be
  negative (raw logits, a subtraction) is refused.

:func:`prove_selected_weights` returns nothing on success and raises a
:class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal` of part ``routing`` otherwise.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.facts import (
    attr_int,
    const_array,
    label,
    node_axes,
    normalize_axes,
    static_last_dim,
    static_rank,
    value_label,
)
from onnx_moe_fuse.rewrites.graph.refusals import Refusal
from onnx_moe_fuse.rewrites.graph.selection_rounds import same_topk, selection_round
from onnx_moe_fuse.rewrites.graph.symbolic_dims import value_dims
from onnx_moe_fuse.rewrites.graph.token_rows import ELEMENTWISE, prove_token_rows

__all__ = ["nonnegative", "prove_selected_weights", "same_indices", "same_topk"]

SLOT, ROW, CONSTANT = "slot", "row", "constant"
_LAYOUT = frozenset({"Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten"})
_REDUCE = frozenset({"ReduceSum", "ReduceMax", "ReduceMin", "ReduceMean"})
_POSITIVE = frozenset({"Sigmoid", "Softmax", "Exp", "Softplus"})
_NONNEG_UNARY = frozenset({"Relu", "Abs", "Sqrt", "ReduceL1", "ReduceL2", "ReduceSumSquare"})
_PASS_SIGN = frozenset(
    {"Cast", "CastLike", "Identity", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Expand",
     "Transpose", "Tile", "Slice", "Gather", "GatherElements", "GatherND", "Concat", "Split",
     "ReduceMax", "ReduceMin", "ReduceSum", "ReduceMean", "TopK"}
)  # fmt: skip
_MAX_DEPTH = 64


def same_indices(value: ir.Value | None, idx: ir.Value) -> bool:
    """``value`` is ``idx`` up to Cast/Identity and reshapes that keep its elements in order.

    The indices of a TopK that computes the same as ``idx``'s (:func:`same_topk`) are ``idx``.
    """
    made_by = idx.producer()
    for _ in range(8):
        if value is None:
            return False
        if value is idx:
            return True
        node = value.producer()
        if (
            node is not None
            and made_by is not None
            and made_by.op_type == "TopK"
            and value.index() == 1
            and idx.index() == 1
            and same_topk(node, made_by)
        ):
            return True
        if node is None or node.op_type not in ("Cast", "Identity", "Reshape") or not node.inputs:
            return False
        if node.op_type == "Reshape" and value_dims(value) != value_dims(node.inputs[0]):
            return False
        value = node.inputs[0]
    return False


def nonnegative(value: ir.Value | None, _depth: int = 0) -> bool:
    """Whether every element of ``value`` is provably >= 0 (or NaN) whatever the inputs."""
    if value is None or _depth > _MAX_DEPTH:
        return False
    array = const_array(value)
    if array is not None:
        return bool(np.all(np.asarray(array, dtype=np.float64) >= 0))
    node = value.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return False
    op, ins = node.op_type, node.inputs
    d = _depth + 1
    if op in _POSITIVE or op in _NONNEG_UNARY:
        return True
    if op == "ConstantOfShape":
        attr = node.attributes.get("value")
        return attr is None or bool(np.all(attr.as_tensor().numpy() >= 0))
    if op == "Clip":
        low = const_array(ins[1]) if len(ins) > 1 else None
        return (low is not None and float(low) >= 0) or nonnegative(ins[0], d)
    if op == "Max":
        return any(nonnegative(v, d) for v in ins)
    if op in ("Add", "Mul", "Div", "Min", "Sum", "Mean"):
        return all(nonnegative(v, d) for v in ins)
    if op == "Pow":
        return nonnegative(ins[0], d)
    if op == "Where":
        return nonnegative(ins[1], d) and nonnegative(ins[2], d)
    if op in ("ScatterElements", "ScatterND"):
        return nonnegative(ins[0], d) and nonnegative(ins[-1], d)
    if op in _PASS_SIGN:
        if op == "TopK" and value.index() != 0:
            return False
        if op == "Concat":
            return all(nonnegative(v, d) for v in ins)
        return nonnegative(ins[0], d)
    return False


def _width(value: ir.Value | None) -> int | None:
    """The static last dim of ``value``, from its shape or its derived dims."""
    if value is None:
        return None
    width = static_last_dim(value)
    if width is None:
        dims = value_dims(value)
        width = dims[-1].coef if dims and not dims[-1].syms else None
    return width


class _Slots:
    """Classify the values behind the weights: slot, row or constant (or refuse)."""

    def __init__(
        self, topk: ir.Node, tokens: ir.Value, lead: int, column: int | None = None
    ) -> None:
        """``column``: classify one slot's weight ``[..., 1]`` (an operand of a Concat)."""
        self.topk = topk
        self.idx = topk.outputs[1]
        self.tokens = tokens
        self.lead = lead
        self.column = column
        self.memo: dict[int, str] = {}

    def fail(self, reason: str, where: ir.Node | ir.Value) -> Refusal:
        return Refusal(reason, where, part="routing")

    def kind(self, value: ir.Value, depth: int = 0) -> str:
        if id(value) in self.memo:
            return self.memo[id(value)]
        if depth > _MAX_DEPTH:
            raise self.fail(
                f"the routing weights are too deep to follow at '{value_label(value)}'", value
            )
        out = self._kind(value, depth + 1)
        self.memo[id(value)] = out
        return out

    def _kind(self, value: ir.Value, depth: int) -> str:
        if const_array(value) is not None:
            return CONSTANT
        node = value.producer()
        if node is None:
            raise self.fail(
                f"the routing weights read '{value_label(value)}' (a graph input), which is not "
                f"made from the selection TopK '{label(self.topk)}'",
                value,
            )
        op = node.op_type
        if op == "TopK":
            if value.index() == 0 and same_topk(node, self.topk) and self.column is None:
                return SLOT
            if value.index() == 0 and self.is_column(node.outputs[1]):
                return SLOT  # the value of the round that selected slot ``column``
            what = "indices" if value.index() == 1 else "values"
            raise self.fail(
                f"the routing weights read the {what} of TopK '{label(node)}', not the values "
                f"of the selection TopK '{label(self.topk)}' whose experts FC1 and FC2 use",
                node,
            )
        if op == "GatherElements":
            return self.gathered(node)
        if op == "Concat" and self.column is None:
            return self.slot_columns(node, depth)
        if op == "Softmax" or op in _REDUCE:
            return self.along_slots(node, value, depth)
        if op == "Identity" and node.inputs[0] is not None:
            return self.kind(node.inputs[0], depth)
        if op in _LAYOUT:
            src = node.inputs[0]
            if src is None or _width(src) != _width(value):
                raise self.fail(
                    f"{op} '{label(node)}' regroups the routing weights across slots", node
                )
            return self.kind(src, depth)
        if op in ELEMENTWISE:
            kinds = set()
            for i, v in enumerate(node.inputs):
                if v is None or (op == "Clip" and i > 0 and const_array(v) is not None):
                    continue
                kinds.add(self.operand(node, v, depth))
            return SLOT if SLOT in kinds else ROW if ROW in kinds else CONSTANT
        return self.row_or_fail(node, value)

    def operand(self, node: ir.Node, value: ir.Value, depth: int) -> str:
        try:
            return self.kind(value, depth)
        except Refusal:
            if static_last_dim(value) == 1:
                return self.row_or_fail(node, value)
            raise

    def row_or_fail(self, node: ir.Node, value: ir.Value) -> str:
        """A ``[..., 1]`` value computed row by row from the tokens: one factor per token."""
        if static_last_dim(value) == 1:
            prove_token_rows(
                value,
                self.tokens,
                self.lead,
                f"the routing weights' factor '{value_label(value)}'",
            )
            return ROW
        raise self.fail(
            f"the routing weights pass through {node.op_type} '{label(node)}', which is not a "
            "per-slot function of the selected experts' scores (an element-wise op, a softmax "
            "or a sum over the k slots, or a gather at the selection)",
            node,
        )

    def gathered(self, node: ir.Node) -> str:
        data, indices = node.inputs[0], node.inputs[1]
        assert data is not None
        # data and indices of a GatherElements share one rank
        rank = len(value_dims(data) or value_dims(indices) or []) or static_rank(indices)
        axis = attr_int(node, "axis", 0)
        norm = normalize_axes([axis], rank) if rank is not None and axis is not None else None
        if rank is None or norm != [rank - 1]:
            raise self.fail(
                f"GatherElements '{label(node)}' gathers the routing weights along axis {axis}, "
                "not over the experts (last axis)",
                node,
            )
        at_selection = (
            self.is_column(indices) if self.column is not None else same_indices(indices, self.idx)
        )
        if not at_selection:
            raise self.fail(
                f"GatherElements '{label(node)}' gathers the routing weights at "
                f"'{value_label(indices)}', not at the experts the selection TopK "
                f"'{label(self.topk)}' chose (the indices FC1 and FC2 use)",
                node,
            )
        prove_token_rows(
            data,
            self.tokens,
            rank - 1,
            f"the scores the routing weights are gathered from ('{value_label(data)}')",
        )
        return SLOT

    def is_column(self, indices: ir.Value | None) -> bool:
        """``indices`` are column ``self.column`` of the selection: its top-1 round of that rank.

        The selection TopK must be sorted and largest-first over the round's logits
        (:mod:`onnx_moe_fuse.rewrites.graph.selection_rounds`).
        """
        found = selection_round(indices)
        topk = self.topk
        return (
            found is not None
            and found.column == self.column
            and found.logits is topk.inputs[0]
            and attr_int(topk, "largest", 1) == 1
            and attr_int(topk, "sorted", 1) == 1
        )

    def slot_columns(self, node: ir.Node, depth: int) -> str:
        """``Concat`` of one-column weights along the slots: column j is slot j's weight."""
        rank = static_rank(self.idx) or len(value_dims(self.idx) or []) or None
        axis = attr_int(node, "axis", None)
        widths = [_width(v) for v in node.inputs]
        if rank is None or axis is None or normalize_axes([axis], rank) != [rank - 1]:
            raise self.fail(
                f"Concat '{label(node)}' joins the routing weights along axis {axis}, not the slots",
                node,
            )
        if any(w != 1 for w in widths):
            raise self.fail(
                f"Concat '{label(node)}' joins routing weights that are not one slot each "
                f"(widths {widths})",
                node,
            )
        kinds = set()
        for j, v in enumerate(node.inputs):
            kinds.add(_Slots(self.topk, self.tokens, self.lead, column=j).kind(v, depth))
        return SLOT if SLOT in kinds else ROW if ROW in kinds else CONSTANT

    def along_slots(self, node: ir.Node, value: ir.Value, depth: int) -> str:
        """A Softmax over the k slots (slot) or a reduction over them (row); else refuse."""
        src = node.inputs[0]
        assert src is not None
        rank = len(value_dims(src) or []) or None
        if node.op_type == "Softmax":
            axes = [attr_int(node, "axis", -1)]
        else:
            axes = node_axes(node)
        norm = normalize_axes(axes, rank) if rank is not None and axes else None
        if norm != [rank - 1 if rank else -1]:
            raise self.fail(
                f"{node.op_type} '{label(node)}' works over axes {axes} of the routing weights, "
                "not over the k slots of each token",
                node,
            )
        inner = self.operand(node, src, depth)
        if node.op_type == "Softmax":
            return inner
        if attr_int(node, "keepdims", 1) != 1:
            raise self.fail(
                f"{node.op_type} '{label(node)}' drops the slot axis (keepdims=0)", node
            )
        return ROW if inner != CONSTANT else CONSTANT


def prove_selected_weights(weights: ir.Value, topk: ir.Node, tokens: ir.Value, lead: int) -> None:
    """Raise a :class:`Refusal` unless ``weights`` are per-selected, non-negative weights.

    First what the selection TopK reads must be computed row by row from ``tokens``
    (:func:`.token_rows.prove_token_rows`). ``topk``: the selection TopK (its indices are what FC1 and FC2 gather experts by);
    ``tokens``: the rows the experts read; ``lead``: the token axes of ``weights`` (its rank
    minus one).
    """
    scores = topk.inputs[0]
    assert scores is not None
    prove_token_rows(
        scores,
        tokens,
        lead,
        f"the router: the selection TopK '{label(topk)}' reads '{value_label(scores)}'",
    )
    kind = _Slots(topk, tokens, lead).kind(weights)
    if kind != SLOT:
        raise Refusal(
            f"the routing weights '{value_label(weights)}' are not per slot: they are "
            f"{'one value per token' if kind == ROW else 'a constant'}, not taken from the "
            f"experts TopK '{label(topk)}' selects",
            weights,
            part="routing",
        )
    if not nonnegative(weights):
        raise Refusal(
            f"the routing weights '{value_label(weights)}' may be negative (nothing shows them "
            ">= 0: no softmax, sigmoid, exp or relu behind every term); MoE and QMoE weigh the "
            "experts by non-negative weights only",
            weights,
            part="routing",
        )
