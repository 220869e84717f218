"""Canonicalisation pass: fold the layout ops between constant expert weights and their users.

Exporters and users reach a MoE's stacked weights through layout ops: an output-major
``[E, N, K]`` weight with ``Transpose(perm=[0, 2, 1])``, ``Reshape``/``Squeeze``/``Unsqueeze`` of
stacked weights, ``Concat`` of per-expert weights, ``Slice``/``Split`` of a fused gate_up weight,
``Cast`` of float16 weights. The layer rules want constants (or ``DequantizeLinear`` of
constants) feeding the Gather/GroupedMatMul directly. :class:`FoldWeightLayoutPass`:

1. folds a layout op whose inputs are all constants (initializers that are not graph inputs, or
   Constant nodes) into a new initializer, whatever its size;
2. pushes a layout op on the output of a ``DequantizeLinear`` of constants onto the quantized
   data, scale and zero point, and folds it there (:mod:`.dq_push`), so quantized weights
   stay quantized (a Concat of per-expert DQs whose scales differ across the concat axis becomes
   one per-axis or blocked DQ in which every element keeps its scale);
3. leaves every other node alone, and also a ``Split`` that cuts a stack into its single
   entries along axis 0 (the grouped_mm spelling reads the stack through it; see
   :func:`.layout_ops.unstacks`).

Why not onnxscript's ``fold_constants`` with raised size limits (checked with onnxscript 0.7.2):
it does not fold multi-output ops (``Split``), its partial evaluators rewrite nodes that are not
layout ops whatever ``should_fold`` says (``Shape`` becomes a Constant, ``Cast`` to the same type
an ``Identity``), it serialises every input tensor to evaluate a node, and it ends with
``NameFixPass`` over the whole model. Layout ops move elements without arithmetic, so a few
lines of numpy each (:mod:`.layout_ops`) fold them bit-exactly.

Names: a folded or pushed value takes the name of the layout op output it replaces; new
initializers and nodes get fresh names. Original tensors are never mutated (the working copy
shares them with the original model). A node whose output is a graph output, or that the pass
cannot prove foldable, is left as it is.

Memory: a folded weight (rule 1) and a pushed DQ's quantized data (rule 2) are lazy tensors
(``ir.LazyTensor``) that compute their numbers each time they are read and keep nothing, so
folding the transposed weights of a whole model costs nothing, and a layer rule that reads the
weights of the layer it fuses holds them only while it reads them (caching them would keep every
fused layer's weights in the working copy until the end: memory growing with the model); only
the small scales and zero points of a push are computed at once. Source tensors are read through
:func:`~onnx_moe_fuse.rewrites.graph.tensor_reads.read_array`, which leaves external data unmapped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.weights import dq_push as dq
from onnx_moe_fuse.rewrites.canonical.weights import layout_ops as ops
from onnx_moe_fuse.rewrites.graph.fresh_names import FreshNames
from onnx_moe_fuse.rewrites.graph.tensor_reads import read_array

__all__ = ["FoldWeightLayoutPass"]


def _graphs(graph: ir.Graph) -> Iterator[ir.Graph]:
    """``graph`` and every subgraph nested in its nodes' attributes."""
    yield graph
    for node in graph:
        for attr in node.attributes.values():
            if attr.is_ref():
                continue
            if attr.type == ir.AttributeType.GRAPH:
                yield from _graphs(attr.as_graph())
            elif attr.type == ir.AttributeType.GRAPHS:
                for sub in attr.as_graphs():
                    yield from _graphs(sub)


def _drop_if_dead(value: ir.Value | None) -> None:
    """Remove an initializer, Constant or DequantizeLinear that a rewrite left without users."""
    if value is None or value.uses() or value.is_graph_output() or value.is_graph_input():
        return
    if value.is_initializer():
        if value.graph is not None and value.name in value.graph.initializers:
            value.graph.initializers.pop(value.name)
        return
    producer = value.producer()
    if producer is None or producer.graph is None or producer.domain != "":
        return
    if producer.op_type not in ("Constant", "DequantizeLinear"):
        return
    if any(out.uses() or out.is_graph_output() for out in producer.outputs):
        return
    inputs = list(producer.inputs)
    producer.graph.remove(producer, safe=True)
    for input_value in inputs:
        _drop_if_dead(input_value)


def _dequantized_dtype(output_dtype: ir.Attr | None, scale_dtype: ir.DataType) -> ir.DataType:
    """DequantizeLinear outputs its scale's type unless ``output_dtype`` (opset 23) is set."""
    if output_dtype is None or output_dtype.is_ref() or not output_dtype.value:
        return scale_dtype
    return ir.DataType(output_dtype.value)


class FoldWeightLayoutPass(ir.passes.InPlacePass):
    """Fold layout ops on constant weights, pushing them through DequantizeLinear.

    After a run, :attr:`counts` holds how many nodes were folded per ``(op_type, how)``, where
    ``how`` is ``"constant"`` (rule 1) or ``"through DequantizeLinear"`` (rule 2).
    """

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[tuple[str, str]] = Counter()
        self._names: FreshNames | None = None
        self._opset = 1
        # id(tensor) -> (tensor, compute) for the lazy tensors this run made (the tensor is
        # kept so that its id stays its own while the run lasts).
        self._computations: dict[int, tuple[ir.TensorProtocol, Callable[[], np.ndarray]]] = {}

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Fold every layout op of ``model`` that the rules can prove foldable.

        The main graph and its subgraphs are visited; model-local functions are not (they
        cannot hold initializers).
        """
        self.counts = Counter()
        self._names = FreshNames(model, "layout", base_when_free=True)
        self._opset = model.opset_imports.get("", 1)
        self._computations = {}
        # Graph order is topological, so a chain (Transpose of Reshape of W) folds in one sweep:
        # each op sees its input already folded. Nodes removed on the way are skipped.
        for graph in list(_graphs(model.graph)):
            for node in list(graph):
                if node.graph is not graph or node.domain != "":
                    continue
                if node.op_type not in ops.LAYOUT_OPS:
                    continue
                if any(out.is_graph_output() for out in node.outputs):
                    continue
                if self._fold_constant(node):
                    self.counts[(node.op_type, "constant")] += 1
                elif self._push_through_dequantize(node):
                    self.counts[(node.op_type, "through DequantizeLinear")] += 1
        self._computations = {}
        return ir.passes.PassResult(model, bool(self.counts))

    # -- rule 1 ------------------------------------------------------------------------------

    def _fold_constant(self, node: ir.Node) -> bool:
        """Replace a layout op on constants by initializers holding its outputs."""
        data_inputs = list(node.inputs) if node.op_type == "Concat" else list(node.inputs[:1])
        if not data_inputs or not all(dq.is_constant(v) for v in data_inputs):
            return False
        tensors = [dq.const_tensor(v) for v in data_inputs]
        if any(t.dtype == ir.DataType.STRING for t in tensors):
            return False
        plan = ops.plan_layout_op(
            node, [(tuple(int(d) for d in t.shape), t.dtype) for t in tensors]
        )
        if plan is None:
            return False
        readers = [self._reader(t) for t in tensors]
        replacements = []
        for output, folded in zip(node.outputs, plan, strict=True):
            if output.uses():
                value = ir.Value(
                    name=self._names.fresh(f"{output.name}_folded"),
                    type=ir.TensorType(folded.dtype),
                    shape=ir.Shape(folded.shape),
                    const_value=self._lazy_tensor(folded, readers),
                )
                node.graph.register_initializer(value)
                replacements.append((output, value))
        self._replace(node, replacements)
        return True

    def _reader(self, tensor: ir.TensorProtocol) -> Callable[[], np.ndarray]:
        """How to get ``tensor``'s array: for a fold of this pass, straight from its inputs."""
        known = self._computations.get(id(tensor))
        return known[1] if known is not None else lambda: read_array(tensor)

    def _lazy_tensor(
        self, folded: ops.FoldedOutput, readers: Sequence[Callable[[], np.ndarray]]
    ) -> ir.LazyTensor:
        """A tensor that computes ``folded`` from its inputs each time it is read.

        Folding does not read weights: only those a later rule (or serialisation) reads are
        computed, so the weights of layers that never fuse cost no memory. A chain of folds
        composes the computations, so no intermediate result is kept.
        """

        def compute() -> np.ndarray:
            return folded.compute([read() for read in readers])

        tensor = ir.LazyTensor(
            lambda: ir.Tensor(compute(), dtype=folded.dtype),
            folded.dtype,
            ir.Shape(folded.shape),
            cache=False,  # a rule reads a layer's weights transiently: keep nothing
        )
        self._computations[id(tensor)] = (tensor, compute)
        return tensor

    # -- rule 2 ------------------------------------------------------------------------------

    def _push_through_dequantize(self, node: ir.Node) -> bool:
        """Replace a layout op on dequantized constants by DequantizeLinear of moved constants."""
        try:
            results = self._pushed_weights(node)
        except OSError:  # external data that cannot be read: leave the node alone
            return False
        if results is None:
            return False
        replacements = []
        for output, weight in zip(node.outputs, results, strict=True):
            if output.uses():
                replacements.append((output, self._emit_dequantize(node, output, weight)))
        self._replace(node, replacements)
        return True

    def _pushed_weights(self, node: ir.Node) -> list[dq.QuantizedWeight] | None:
        """Per output of ``node``, the quantized weight it dequantizes from, or None."""
        op = node.op_type
        if op == "Concat":
            weights = [dq.read_quantized_weight(v) for v in node.inputs]
            if not weights or any(w is None for w in weights):
                return None
            axis = ops.concat_axis(node, len(weights[0].shape))
            opset = weights[0].node.version or self._opset
            joined = None if axis is None else dq.push_concat(weights, axis, opset)
            return None if joined is None else [joined]
        weight = dq.read_quantized_weight(node.inputs[0] if node.inputs else None)
        if weight is None or op == "Cast":  # Cast after DQ rounds differently from DQ to it
            return None
        pushed: list[dq.QuantizedWeight | None]
        if op == "Identity":
            pushed = [weight]
        elif op == "Transpose":
            perm = ops.transpose_perm(node, len(weight.shape))
            pushed = [None if perm is None else dq.push_transpose(weight, perm)]
        elif op in ("Reshape", "Squeeze", "Unsqueeze"):
            shape = ops.reshaped_shape(node, weight.shape)
            pushed = [None if shape is None else dq.push_reshape(weight, shape)]
        elif op == "Slice":
            kept = ops.slice_indices(node, weight.shape)
            pushed = [None if kept is None else dq.push_slice(weight, kept)]
        elif op == "Split":
            split = ops.split_sizes(node, weight.shape)
            if split is None or ops.unstacks(*split):
                return None
            axis, sizes = split
            pushed = []
            start = 0
            for size in sizes:
                kept: list[np.ndarray | None] = [None] * len(weight.shape)
                kept[axis] = np.arange(start, start + size, dtype=np.int64)
                pushed.append(dq.push_slice(weight, kept))
                start += size
        else:
            return None
        if any(w is None for w in pushed):
            return None
        return pushed

    def _emit_dequantize(
        self, node: ir.Node, output: ir.Value, weight: dq.QuantizedWeight
    ) -> ir.Value:
        """Insert, before ``node``, a DequantizeLinear of ``weight`` standing for ``output``."""
        graph = node.graph
        weight = dq.single_block_as_per_tensor(weight)
        data_dtype, scale_dtype, zero_point_dtype = weight.dtypes

        def operand(value: dq.Operand | None, suffix: str, dtype) -> ir.Value | None:
            if value is None or isinstance(value, ir.Value):
                return value
            name = self._names.fresh(f"{output.name}_{suffix}")
            if isinstance(value, dq.LazyArray):
                folded = ops.FoldedOutput(value.shape, dtype, lambda _: value.compute())
                tensor = self._lazy_tensor(folded, [])
            else:
                tensor = ir.Tensor(value, dtype=dtype)
            initializer = ir.Value(
                name=name, type=ir.TensorType(dtype), shape=tensor.shape, const_value=tensor
            )
            graph.register_initializer(initializer)
            return initializer

        inputs = [
            operand(weight.data, "quantized", data_dtype),
            operand(weight.scale, "scale", scale_dtype),
        ]
        if weight.zero_point is not None:
            inputs.append(operand(weight.zero_point, "zero_point", zero_point_dtype))
        attributes = dict(weight.node.attributes)
        attributes.pop("axis", None)
        attributes.pop("block_size", None)
        if weight.axis is not None:
            attributes["axis"] = ir.AttrInt64("axis", weight.axis)
        if weight.blocked:
            attributes["block_size"] = ir.AttrInt64("block_size", weight.block_size)
        dtype = _dequantized_dtype(attributes.get("output_dtype"), scale_dtype)
        result = ir.Value(type=ir.TensorType(dtype), shape=ir.Shape(weight.shape))
        new_node = ir.Node(
            "",
            "DequantizeLinear",
            inputs,
            attributes=list(attributes.values()),
            outputs=[result],
            version=weight.node.version,
            name=self._names.fresh(f"{node.name or output.name}_dequantize"),
        )
        graph.insert_before(node, new_node)
        return result

    # -- editing -----------------------------------------------------------------------------

    def _replace(self, node: ir.Node, replacements: Sequence[tuple[ir.Value, ir.Value]]) -> None:
        """Rewire users of ``node``'s outputs, remove it, hand its output names over."""
        old_inputs = list(node.inputs)
        for old, new in replacements:
            old.replace_all_uses_with(new)
        node.graph.remove(node, safe=True)
        for old, new in replacements:
            name = old.name
            # Renaming a value renames its const tensor too, which may be shared with the
            # original model: detach any tensor from the dropped value before clearing its name.
            old.const_value = None
            old.name = None
            new.name = name  # for an initializer this also re-keys graph.initializers
        for value in old_inputs:
            _drop_if_dead(value)
