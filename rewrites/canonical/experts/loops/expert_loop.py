"""Canonicalise a loop over all experts (optimum-onnx's MoE exports) into per-slot GroupedMatMul.

optimum-onnx does not export transformers' MoE forwards: its ``model_patcher.py`` swaps in ones
that loop over every expert, ``NonZero`` of the expert's slice of a one-hot mask, the expert's
MLP on the gathered rows, times the gathered routing weight, ``index_add_`` into the output
(:mod:`.proof` spells out both the TorchScript and the dynamo export). No layer rule takes
that form. This pass proves the loop equals the MoE of its TopK and rewrites it, on the working
copy, into the per-slot form the layer rules (``rewrites/moe/layer_rules.py``) fuse, the one
:mod:`.sorted_experts` writes::

    fc1_j = GroupedMatMul(tokens [T, H], W1_j [E, H, N], ids [T, k] (, b1_j [E, N]))  # per FC1
    act   = the experts' row-wise activation on the fc1_j (feature axis -1)
    fc2   = Reshape(GroupedMatMul(Reshape(act, [-1, I]), W2, Reshape(ids, [-1, 1]) (, b2)),
                    [-1, k, H])
    out   = ReduceSum(Mul(fc2, Unsqueeze(weights, [-1])), axes=[1], keepdims=0)

(the biases where the experts' projections have them: ``Linear`` with bias, hand-written MoE
code's default).

``out`` takes the name of the loop's last accumulator; the tokens, ids, routing weights and the
router stay as they are. The stacked weights ``[E, K, N]`` are new initializers holding lazy
tensors (``ir.LazyTensor``): the per-expert tensors are neither modified nor read until a rule
reads the stack. ``GroupedMatMul`` is opset 29: the default-domain opset import is raised to 29
when a loop is rewritten (the working copy is never executed; the fuser lowers the opset again
once the GroupedMatMul nodes are fused away).

Loops whose proof fails are left unchanged; the pass records why as it runs
(``CanonicalExpertLoopPass.refusals``: a :class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal`
per loop, for its routing TopK: the fuser's near miss for such a layer), and
:func:`expert_loop_refusals` lists the reasons of a model.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.loops.mlp import (
    clone_activation,
    stack_biases,
    stack_weights,
)
from onnx_moe_fuse.rewrites.canonical.experts.loops.proof import (
    ExpertLoop,
    analyse_loop,
    loop_candidates,
)
from onnx_moe_fuse.rewrites.canonical.experts.loops.quantized import stack_quantized
from onnx_moe_fuse.rewrites.canonical.experts.loops.values import Mask
from onnx_moe_fuse.rewrites.canonical.experts.sorted.sorted_experts import GROUPED_MATMUL_OPSET
from onnx_moe_fuse.rewrites.graph.edits import ancestors, remove_dead
from onnx_moe_fuse.rewrites.graph.facts import label
from onnx_moe_fuse.rewrites.graph.fresh_names import FreshNames
from onnx_moe_fuse.rewrites.graph.refusals import EXPERT_LOOP, Refusal

__all__ = ["CanonicalExpertLoopPass", "expert_loop_refusals"]


def _analyse(topk: ir.Node, mask: Mask) -> ExpertLoop | Refusal:
    """The proved loop of ``topk``, or the refusal saying why not."""
    try:
        return analyse_loop(topk, mask)
    except Refusal as refusal:
        return refusal
    except (AttributeError, IndexError, KeyError, TypeError, ValueError) as exc:
        # A shape of graph the proof did not foresee: refusing keeps the pass from raising on a
        # valid model.
        return Refusal(f"could not analyse the expert loop ({type(exc).__name__}: {exc})")


def expert_loop_refusals(model: ir.Model) -> list[tuple[str, str]]:
    """``(TopK node, reason)`` for every expert loop the pass would leave alone."""
    refusals = []
    for topk, mask in loop_candidates(model.graph):
        result = _analyse(topk, mask)
        if isinstance(result, Refusal):
            refusals.append((label(topk), result.reason))
    return refusals


class _Builder:
    """Creates the per-slot nodes with fresh names and small int64 initializers."""

    def __init__(self, model: ir.Model, names: FreshNames, prefix: str) -> None:
        self.graph, self.names, self.prefix = model.graph, names, prefix
        self.nodes: list[ir.Node] = []

    def ints(self, values: list[int], base: str) -> ir.Value:
        name = self.names(base)
        tensor = ir.tensor(np.array(values, dtype=np.int64), name=name)
        value = ir.Value(name=name, type=ir.TensorType(ir.DataType.INT64), const_value=tensor)
        value.shape = ir.Shape([len(values)])
        self.graph.register_initializer(value)
        return value

    def node(self, op_type: str, inputs: list[ir.Value], base: str, **attrs) -> ir.Value:
        out = ir.Value(name=self.names(base))
        node = ir.Node(
            "",
            op_type,
            inputs,
            ir.convenience.convert_attributes(attrs),
            outputs=[out],
            name=self.names(f"{self.prefix}/{op_type}"),
        )
        self.nodes.append(node)
        return out

    def stacked(self, refs, base: str) -> ir.Value:
        if refs[0].quantized is not None:
            # the codes, scales and zero points stacked as they are, one DequantizeLinear
            parts, block = stack_quantized([r.quantized for r in refs], self.names, base)
            for value in parts:
                self.graph.register_initializer(value)
            out = self.node("DequantizeLinear", parts, base, axis=1, block_size=block)
            out.type = ir.TensorType(refs[0].dtype)
            return out
        value = stack_weights(refs, self.names(base))
        self.graph.register_initializer(value)
        return value

    def biases(self, refs, base: str) -> list[ir.Value]:
        """GroupedMatMul's trailing bias input ``[E, N]``: none when the experts have none."""
        if refs[0] is None:
            return []  # the signatures are equal: no expert has one
        value = stack_biases(refs, self.names(base))
        self.graph.register_initializer(value)
        return [value]


def _rewrite(model: ir.Model, loop: ExpertLoop) -> None:
    graph = model.graph
    names = FreshNames(model, "loop")
    b = _Builder(model, names, f"{label(loop.topk)}/expert_loop")
    mlps, first = loop.mlps, loop.mlps[0]
    float_type = ir.TensorType(first.fc2.weight.dtype)  # the experts' type (float32 or half)
    starts: dict[int, ir.Value] = {}
    for j, projection in enumerate(first.fc1):
        weight = b.stacked([m.fc1[j].weight for m in mlps], f"fc1_{j}_experts")
        bias = b.biases([m.fc1[j].bias for m in mlps], f"fc1_{j}_bias")
        fc1 = b.node("GroupedMatMul", [loop.tokens, weight, loop.ids, *bias], f"fc1_{j}_slots")
        fc1.type = float_type
        starts[id(projection.out)] = fc1
    act_nodes, act = clone_activation(first, starts, names, lambda v: b.ints(v, "slice_axes"))
    b.nodes.extend(act_nodes)
    inner, hidden = first.fc2.weight.dims
    rows = b.node("Reshape", [act, b.ints([-1, inner], "act_rows_shape")], "act_rows")
    row_ids = b.node("Reshape", [loop.ids, b.ints([-1, 1], "ids_rows_shape")], "ids_rows")
    w2 = b.stacked([m.fc2.weight for m in mlps], "fc2_experts")
    b2 = b.biases([m.fc2.bias for m in mlps], "fc2_bias")
    fc2 = b.node("GroupedMatMul", [rows, w2, row_ids, *b2], "fc2_rows")
    slots = b.node("Reshape", [fc2, b.ints([-1, loop.k, hidden], "slots_shape")], "fc2_slots")
    w3 = b.node("Unsqueeze", [loop.weights, b.ints([-1], "weights_axes")], "weights_unsq")
    weighted = b.node("Mul", [slots, w3], "weighted_slots")
    out = b.node("ReduceSum", [weighted, b.ints([1], "slot_axis")], "layer_out", keepdims=0)
    for v in (rows, fc2, slots, weighted):
        v.type = float_type

    old = loop.layer_out
    producer = old.producer()
    cone = ancestors(producer)
    name = old.name
    out.type, out.shape = old.type or float_type, old.shape
    ir.convenience.replace_all_uses_with(old, out, replace_graph_outputs=True)
    graph.insert_after(producer, b.nodes)
    old.name = names(name)
    out.name = name
    remove_dead(graph, [producer, *cone])
    if model.opset_imports.get("", 1) < GROUPED_MATMUL_OPSET:
        model.opset_imports[""] = GROUPED_MATMUL_OPSET
        graph.opset_imports[""] = GROUPED_MATMUL_OPSET


class CanonicalExpertLoopPass(ir.passes.InPlacePass):
    """Rewrite every proved loop over all experts into the per-slot GroupedMatMul form.

    ``refusals`` receives, while the pass runs, the refusal of each loop it leaves as it is,
    recorded as :data:`EXPERT_LOOP`'s for the loop's TopK (the list the pipeline hands it, or
    one of its own).
    """

    def __init__(self, refusals: list[Refusal] | None = None) -> None:
        """Record refusals into ``refusals`` (a new list by default)."""
        super().__init__()
        self.refusals: list[Refusal] = [] if refusals is None else refusals

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Prove and rewrite each loop; leave every other node as it is."""
        modified = False
        # One loop at a time, each proved on the graph as the previous rewrites left it.
        for topk, mask in loop_candidates(model.graph):
            if topk.graph is not model.graph:
                continue
            loop = _analyse(topk, mask)
            if isinstance(loop, Refusal):
                self.refusals.append(loop.recorded_by(EXPERT_LOOP, topk))
                continue
            _rewrite(model, loop)
            modified = True
        return ir.passes.PassResult(model, modified=modified)
