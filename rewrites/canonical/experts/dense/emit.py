"""Write the per-slot layer for a proved dense layer (:mod:`.dense_experts`) and remove the old.

Two steps, so that a failure cannot leave a half-rewritten graph: :meth:`Emitter.load` reads and
stacks the weights (:mod:`.stack`, numpy only) and may fail; :meth:`Emitter.rewrite` then
only writes. The new nodes go right before the dense combine (everything they read is computed
before it); the new ReduceSum takes over the layer output's name and uses; new values and
initializers get fresh names (``<combine>_canonical/...``). The old nodes are removed, then
whatever only fed them (per-expert DQ and Constant nodes, the scatter's zeros, initializers).
A new node that stands for an old one (an activation op copied from expert 0, the GroupedMatMul
of an FC, the final ReduceSum) then takes over the old node's name and its outputs' names, so
the layer rules' near misses name nodes and values the user's model has.
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.dense.ffn import ExpertMLP
from onnx_moe_fuse.rewrites.canonical.experts.dense.layer import DenseLayer
from onnx_moe_fuse.rewrites.canonical.experts.dense.stack import (
    StackedWeight,
    stack_bias,
    stack_weights,
)
from onnx_moe_fuse.rewrites.canonical.experts.writer import GraphWriter

__all__ = ["Emitter"]


class Emitter(GraphWriter):
    """Rewrites one proved :class:`~.dense_experts.DenseLayer` of ``graph``."""

    def __init__(self, graph: ir.Graph, layer: DenseLayer) -> None:
        """Prepare to rewrite ``layer``; names are made unique against all of ``graph``."""
        root = layer.combine.root
        super().__init__(graph, f"{root.name or root.outputs[0].name or 'moe'}_canonical")
        self.layer = layer

    # -- weights --------------------------------------------------------------------------------
    def load(self) -> None:
        """Read and stack every weight and bias the rewrite needs (before any graph change)."""
        layer, mlps = self.layer, self.layer.mlps
        groups = [[m.fc1[j] for m in mlps] for j in range(len(mlps[0].fc1))]
        groups.append([m.fc2 for m in mlps])
        self.stacks = [
            (
                stack_weights([p.weight for p in group], layer.stacked),
                stack_bias(group, layer.routing.experts),
            )
            for group in groups
        ]

    def weight_value(self, stacked: StackedWeight, base: str) -> ir.Value:
        """The ``[E, K, N]`` weights as a value: as is, an initializer, or a new DQ node."""
        if stacked.as_is is not None:
            return stacked.as_is
        if stacked.array is not None:
            return self.initializer(base, stacked.array)
        inputs = [
            self.initializer(f"{base}_quant", stacked.codes),
            self.initializer(f"{base}_scale", stacked.scales),
        ]
        if stacked.zero_points is not None:
            inputs.append(self.initializer(f"{base}_zero_point", stacked.zero_points))
        return self.node("DequantizeLinear", inputs, base, **stacked.dq_attributes).outputs[0]

    def projection_inputs(self, index: int, base: str) -> tuple[ir.Value, list[ir.Value]]:
        """The stacked weight and the optional bias (as GroupedMatMul's trailing inputs)."""
        stacked, bias = self.stacks[index]
        weight = self.weight_value(stacked, f"{base}_weight")
        return weight, [] if bias is None else [self.initializer(f"{base}_bias", bias)]

    # -- the layer ------------------------------------------------------------------------------
    def rewrite(self) -> None:
        """Emit the per-slot layer, redirect the layer output to it, remove the dense nodes.

        Call :meth:`load` first: it reads the weights, which may fail; this only writes.
        """
        layer, mlps = self.layer, self.layer.mlps
        routing = layer.routing
        tokens, idx, w = routing.tokens, routing.indices, layer.mask.weights
        if layer.prescale is not None:  # Llama4: the selected score scales the token, weight 1
            picked = self.node(
                "GatherElements", [layer.prescale.scores, idx], "token_scale", axis=-1
            )
            for old in layer.prescale.maps:  # g, where only S^T is in the graph
                attrs = dict(old.attributes.items())
                picked = self.node(old.op_type, picked.outputs, "token_scale", **attrs)
            tokens = self.node("Mul", [tokens, picked.outputs[0]], "scaled_tokens").outputs[0]
            w = self.node("Softmax", [layer.prescale.values], "unit_weights", axis=-1).outputs[0]
        mapping: dict[int, ir.Value] = {}
        for j, proj in enumerate(mlps[0].fc1):
            weight, bias = self.projection_inputs(j, f"fc1_{j}")
            gmm = self.node("GroupedMatMul", [tokens, weight, idx, *bias], f"fc1_{j}")
            self.stands_for.append((gmm, proj.nodes[0]))
            mapping[id(proj.out)] = gmm.outputs[0]
        act = self.copy_activation(mlps[0], mapping)
        w2, b2 = self.projection_inputs(len(mlps[0].fc1), "fc2")
        inter, hidden = mlps[0].fc2.weight.shape[-2:]
        rows = self.node("Reshape", [act, self.ints("fc2_rows_shape", [-1, inter])], "fc2_rows")
        row_idx = self.node("Reshape", [idx, self.ints("fc2_idx_shape", [-1, 1])], "fc2_row_idx")
        grouped = self.node(
            "GroupedMatMul", [rows.outputs[0], w2, row_idx.outputs[0], *b2], "fc2_grouped"
        )
        self.stands_for.append((grouped, mlps[0].fc2.nodes[0]))
        shape = self.ints("fc2_slots_shape", [-1, routing.k, hidden])
        fc2_out = self.node("Reshape", [grouped.outputs[0], shape], "fc2")
        w3 = self.node("Unsqueeze", [w, self.ints("weights_axes", [-1])], "routing_weights_3d")
        mul = self.node("Mul", [fc2_out.outputs[0], w3.outputs[0]], "weighted")
        summed = mul.outputs[0]
        if layer.prescale is not None and layer.prescale.sum_type is not None:
            # the export sums in float32 (torch upcasts a half-precision sum): so does this
            mul.outputs[0].dtype = mlps[0].fc2.out.dtype  # what the widening Cast reads
            summed = self.node("Cast", [summed], "weighted_wide", to=layer.prescale.sum_type)
            summed = summed.outputs[0]
            summed.dtype = ir.DataType(layer.prescale.sum_type)
        out = self.node("ReduceSum", [summed, self.ints("slots_axes", [1])], "out", keepdims=0)
        self.stands_for.append((out, layer.combine.root))
        self.graph.insert_before(layer.combine.root, self.new_nodes)
        self.take_over(layer.combine.root.outputs[0], out.outputs[0])
        self.remove_dense_nodes()
        self.take_over_node_names(layer.combine.root)

    def copy_activation(self, mlp: ExpertMLP, mapping: dict[int, ir.Value]) -> ir.Value:
        """Copy expert 0's activation onto the per-slot FC1 outputs; returns the FC2 input."""
        for old in mlp.act_nodes:
            inputs = [None if v is None else mapping.get(id(v), v) for v in old.inputs]
            attrs: dict = dict(old.attributes.items())
            if old.op_type == "Split":
                attrs["axis"] = -1
            if old.op_type == "Slice":  # the proof says axes is the last axis
                inputs[3] = self.ints("slice_axes", [-1])
            base = f"act_{old.op_type.lower()}"
            new = self.node(old.op_type, inputs, base, len(old.outputs), old.domain, **attrs)
            self.stands_for.append((new, old))
            for o_old, o_new in zip(old.outputs, new.outputs, strict=True):
                mapping[id(o_old)] = o_new
        return mapping.get(id(mlp.act_out), mlp.act_out)

    def remove_dense_nodes(self) -> None:
        nodes = self.layer.nodes()
        feeding = [v for n in nodes for v in n.inputs if v is not None]
        self.graph.remove(nodes, safe=True)
        # What only fed the dense block is dead now (per-expert DQ and Constant nodes, the
        # scatter's zeros, initializers): remove it, walking up while nothing else uses it.
        todo = feeding
        while todo:
            v = todo.pop()
            if v.uses() or v.is_graph_output() or v.is_graph_input():
                continue
            node = v.producer()
            if node is not None and node.graph is None:
                continue  # removed already (a value can feed several dense nodes)
            if node is not None and all(
                not o.uses() and not o.is_graph_output() for o in node.outputs
            ):
                todo.extend(i for i in node.inputs if i is not None)
                self.graph.remove(node, safe=True)
            elif node is None and v.is_initializer() and v.name in self.graph.initializers:
                del self.graph.initializers[v.name]
