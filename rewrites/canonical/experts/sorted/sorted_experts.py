"""Canonicalise the grouped_mm (sorted rows) experts block into per-slot ``GroupedMatMul``.

transformers' default experts implementation, ``grouped_mm``, exports as an argsort of the
routed expert ids, the token rows gathered in that order, one ``MatMul`` per expert over its
contiguous segment (offsets from a histogram and a ``CumSum``), a ``Concat``, and an un-sort
(:mod:`.proof` spells it out). The layer rules (``rewrites/moe/layer_rules.py``) do not take
that form. This pass proves the block computes, for token ``t`` and slot ``j``,
``x[t] @ W[ids[t, j]]`` for both projections, and rewrites it on the working copy into the
per-slot form they do take::

    fc1 = GroupedMatMul(tokens [T, H], W1 [E, H, N1], ids [T, k] (, B1))     # [T, k, N1]
    act = the block's row-wise activation on fc1 (feature axis -1)
    fc2 = Reshape(GroupedMatMul(Reshape(act, [-1, I]), W2, Reshape(ids, [-1, 1]) (, B2)),
                  [-1, k, H])
    out = ReduceSum(Mul(fc2, Unsqueeze(weights, [-1])), axes=[1], keepdims=0)

``out`` takes the name of the block's layer output; the tokens, ids, routing weights and the
router stay as they are (so does everything outside the block). Weights held ``[E, N, K]`` (the
per-expert MatMul uses ``Transpose(W[e])``) are transposed once into a new initializer; weights
already K-major are reused as they are. ``GroupedMatMul`` is opset 29: the default-domain opset
import is raised to 29 when a block is rewritten (the working copy is never executed; the fuser
lowers the opset again once the GroupedMatMul nodes are fused away).

Blocks whose proof fails are left unchanged; the pass records why as it runs
(``CanonicalSortedExpertsPass.refusals``: a
:class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal` per block, for the TopK whose ids it
sorts: the fuser's near miss for a grouped_mm layer that did not fuse), and
:func:`sorted_experts_refusals` lists the reasons of a model.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.rowwise import clone_rowwise
from onnx_moe_fuse.rewrites.canonical.experts.sorted.proof import (
    SortedBlock,
    StackedWeight,
    analyse_sorted_block,
    sort_candidates,
)
from onnx_moe_fuse.rewrites.canonical.spellings.common import FreshNames
from onnx_moe_fuse.rewrites.graph.edits import ancestors, remove_dead
from onnx_moe_fuse.rewrites.graph.facts import label
from onnx_moe_fuse.rewrites.graph.refusals import SORTED_EXPERTS, Refusal
from onnx_moe_fuse.rewrites.graph.tensor_reads import read_array

__all__ = [
    "CanonicalSortedExpertsPass",
    "sorted_experts_refusals",
    "GROUPED_MATMUL_OPSET",
]

#: The default-domain opset that introduces ``GroupedMatMul``.
GROUPED_MATMUL_OPSET = 29


def _analyse(sort: ir.Node) -> SortedBlock | Refusal:
    """The proved block of ``sort``, or the refusal saying why not."""
    try:
        return analyse_sorted_block(sort)
    except Refusal as refusal:
        return refusal
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:
        # A shape of graph the proof did not foresee (a missing optional input, an odd
        # attribute): refusing keeps the pass from raising on a valid model.
        return Refusal(f"could not analyse the block ({type(exc).__name__}: {exc})")


def sorted_experts_refusals(model: ir.Model) -> list[tuple[str, str]]:
    """``(argsort node, reason)`` for every sorted-experts block the pass would leave alone."""
    refusals = []
    for sort in sort_candidates(model.graph):
        result = _analyse(sort)
        if isinstance(result, Refusal):
            refusals.append((label(sort), result.reason))
    return refusals


def _routing_topk(sort: ir.Node) -> ir.Node | None:
    """The TopK whose ids (output 1) ``sort`` reads through shape-only nodes, else None."""
    value = sort.inputs[0]
    for _ in range(8):
        node = value.producer() if value is not None else None
        if node is None:
            return None
        if node.op_type == "TopK":
            return node if value.index() == 1 else None
        if node.op_type not in ("Reshape", "Flatten", "Squeeze", "Unsqueeze", "Cast", "Identity"):
            return None
        value = node.inputs[0]
    return None


class _Builder:
    """Creates the per-slot nodes with fresh names and small int64 initializers."""

    def __init__(self, model: ir.Model, prefix: str) -> None:
        self.graph = model.graph
        self.prefix = prefix
        self.names = FreshNames(model)
        self.nodes: list[ir.Node] = []

    def const(self, values: list[int], base: str) -> ir.Value:
        name = self.names(base)
        value = ir.Value(
            name=name, const_value=ir.tensor(np.array(values, dtype=np.int64), name=name)
        )
        value.type = ir.TensorType(ir.DataType.INT64)
        value.shape = ir.Shape([len(values)])
        self.graph.register_initializer(value)
        return value

    def node(
        self,
        op_type: str,
        inputs: list[ir.Value],
        base: str,
        like: ir.Value | None = None,
        dims: list | None = None,
        **attrs,
    ) -> ir.Value:
        """One node; its output takes ``like``'s type and the shape ``dims`` when given."""
        out = ir.Value(name=self.names(base))
        if like is not None:
            out.type = like.type
        if dims is not None:
            out.shape = ir.Shape(dims)
        node = ir.Node(
            "",
            op_type,
            inputs,
            ir.convenience.convert_attributes(attrs),
            outputs=[out],
            name=f"{self.prefix}/{op_type}_{len(self.nodes)}",
        )
        self.nodes.append(node)
        return out

    def weight(self, weight: StackedWeight) -> ir.Value:
        """The stacked weight K-major ``[E, K, N]``: as it is, or transposed into a new one."""
        if not weight.transposed:
            return weight.value
        source = weight.value.const_value
        e, n, k = source.shape
        name = self.names(weight.value.name)

        def transposed() -> ir.TensorProtocol:  # read when a rule reads it, kept by nobody
            return ir.tensor(np.ascontiguousarray(np.swapaxes(read_array(source), 1, 2)))

        lazy = ir.LazyTensor(transposed, source.dtype, ir.Shape([e, k, n]), name=name)
        value = ir.Value(name=name, const_value=lazy)
        value.type = ir.TensorType(weight.value.dtype)
        value.shape = ir.Shape([e, k, n])
        self.graph.register_initializer(value)
        return value


def _rewrite(model: ir.Model, block: SortedBlock) -> None:
    graph = model.graph
    b = _Builder(model, f"{label(block.sort)}/sorted_experts")
    tokens, k = block.tokens, block.k
    t, (_, n1) = tokens.shape[0], block.fc1.k_major_dims()
    inner, hidden = block.fc2.k_major_dims()
    fc1_inputs = [tokens, b.weight(block.fc1), block.ids]
    fc1_inputs += [block.fc1_bias] if block.fc1_bias is not None else []
    fc1 = b.node("GroupedMatMul", fc1_inputs, "fc1_slots", tokens, [t, k, n1])
    act_nodes, act = clone_rowwise(
        block.activation, fc1, b.names, lambda v: b.const(v, "axes"), [t, k]
    )
    b.nodes.extend(act_nodes)
    rows = b.node("Reshape", [act, b.const([-1, inner], "act_rows_shape")], "act_rows", act)
    row_ids = b.node("Reshape", [block.ids, b.const([-1, 1], "ids_rows_shape")], "ids_rows")
    fc2_inputs = [rows, b.weight(block.fc2), row_ids]
    fc2_inputs += [block.fc2_bias] if block.fc2_bias is not None else []
    fc2 = b.node("GroupedMatMul", fc2_inputs, "fc2_rows", tokens)
    slots_shape = b.const([-1, k, hidden], "slots_shape")
    slots = b.node("Reshape", [fc2, slots_shape], "fc2_slots", tokens, [t, k, hidden])
    if block.upcast is not None:
        # a half-precision block sums in float32: the widening Cast is exact here; where the
        # export cast the weighted slots instead, the product rounds in float32 (once) here
        slots = b.node("Cast", [slots], "fc2_slots_wide", None, [t, k, hidden], to=block.upcast)
        slots.type = ir.TensorType(block.upcast)
    w3 = b.node("Unsqueeze", [block.weights, b.const([-1], "weights_axes")], "weights_unsq")
    weighted = b.node("Mul", [slots, w3], "weighted_slots", slots, [t, k, hidden])
    out = b.node("ReduceSum", [weighted, b.const([1], "slot_axis")], "layer_out", keepdims=0)

    old_reduce = block.layer_out.producer()
    cone = ancestors(old_reduce)
    name = block.layer_out.name
    out.type, out.shape = block.layer_out.type, block.layer_out.shape
    ir.convenience.replace_all_uses_with(block.layer_out, out, replace_graph_outputs=True)
    graph.insert_after(old_reduce, b.nodes)
    graph.remove(old_reduce, safe=True)
    block.layer_out.name = None
    out.name = name
    remove_dead(graph, cone)
    version = model.opset_imports.get("", 1)
    if version < GROUPED_MATMUL_OPSET:
        model.opset_imports[""] = GROUPED_MATMUL_OPSET
        graph.opset_imports[""] = GROUPED_MATMUL_OPSET


class CanonicalSortedExpertsPass(ir.passes.InPlacePass):
    """Rewrite every proved grouped_mm experts block into the per-slot GroupedMatMul form.

    ``refusals`` receives, while the pass runs, the refusal of each block it leaves as it is,
    recorded as :data:`SORTED_EXPERTS`'s for the TopK whose ids the block sorts (the list the
    pipeline hands it, or one of its own).
    """

    def __init__(self, refusals: list[Refusal] | None = None) -> None:
        """Record refusals into ``refusals`` (a new list by default)."""
        super().__init__()
        self.refusals: list[Refusal] = [] if refusals is None else refusals

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Prove and rewrite each block; leave every other node as it is."""
        modified = False
        # One block at a time, each proved on the graph as the previous rewrites left it.
        for sort in sort_candidates(model.graph):
            if sort.graph is not model.graph:
                continue
            block = _analyse(sort)
            if isinstance(block, Refusal):
                self.refusals.append(block.recorded_by(SORTED_EXPERTS, _routing_topk(sort)))
                continue
            _rewrite(model, block)
            modified = True
        return ir.passes.PassResult(model, modified=modified)
