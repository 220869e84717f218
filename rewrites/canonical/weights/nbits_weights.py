"""MatMulNBits projections presented as ``MatMul`` of ``DequantizeLinear`` weights.

ONNX Runtime's own quantiser (``onnxruntime.quantization.matmul_nbits_quantizer``,
``MatMulNBitsQuantizer``) turns every ``MatMul`` with a constant 2-D weight into
``com.microsoft.MatMulNBits(A, B [N, k_blocks, blob], scales, zero_points?)``, which computes
``A @ W`` with ``W[k, n] = (code[n, k] - zp[n, k // block]) * scale[n, k // block]``. That is,
exactly, ``MatMul(A, DequantizeLinear(codes [K, N], scales [k_blocks, N], zp [k_blocks, N],
axis=0, block_size))`` with the codes as ``uint4`` (4-bit) or ``uint8`` (8-bit): the form the
expert recognisers read, in every expert form (loops over the experts, unrolled experts, dense
all-experts), and the one the router checks read. So this pass rewrites each such node on the
working copy; the QMoE emission then copies the same codes (no requantisation: ``code`` is
read, never recomputed from floats) and the zero points (explicit where the node has them,
the symmetric point written out where it has none).

The rewritten weights are ``ir.LazyTensor`` s over the node's own tensors (nothing is unpacked
until a rule reads them, and nothing is kept after). A node is left as it is unless every part
of it is known: 4- or 8-bit, a power-of-two block of 16 or more, constant ``B`` and float scales
of MatMulNBits' shapes, uint8 zero points or none, no ``g_idx`` and no bias
(``dense.nbits.nbits_is_supported``). ``accuracy_level`` only lets ORT quantise the
activations (int8) where the kernel can: the node's meaning is the exact product, which is what
the rewrite spells.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.contract.ops import MATMUL_NBITS
from onnx_moe_fuse.rewrites.canonical.experts.dense.nbits import (
    MS_DOMAIN,
    nbits_geometry,
    nbits_is_supported,
    nbits_tensor_arrays,
)
from onnx_moe_fuse.rewrites.graph.fresh_names import FreshNames

__all__ = ["NBitsWeightsPass"]


def _lazy(compute, index: int, dtype: ir.DataType, shape: tuple[int, ...]) -> ir.LazyTensor:
    """A tensor computing part ``index`` of ``compute()`` at each read (nothing cached)."""
    return ir.LazyTensor(
        lambda: ir.Tensor(compute()[index], dtype=dtype),
        dtype,
        ir.Shape(shape),
        cache=False,
    )


class NBitsWeightsPass(ir.passes.InPlacePass):
    """Rewrite ``MatMulNBits`` (constant weights) as ``MatMul(A, DequantizeLinear(...))``.

    The main graph only (expert layers live there). :attr:`count` says how many nodes were
    rewritten.
    """

    def __init__(self) -> None:
        """A pass with nothing rewritten yet."""
        super().__init__()
        self.count = 0

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Rewrite every readable MatMulNBits node of the main graph."""
        graph = model.graph
        nodes = [
            n
            for n in graph
            if n.op_type == MATMUL_NBITS.name and n.domain == MS_DOMAIN and nbits_is_supported(n)
        ]
        names = FreshNames(model, "nbits") if nodes else None
        for node in nodes:
            ins = MATMUL_NBITS.named_inputs(list(node.inputs))
            if ins["bias"] is not None or ins["A"] is None:
                continue
            assert names is not None
            self._rewrite(graph, node, names)
            self.count += 1
        return ir.passes.PassResult(model, bool(self.count))

    def _rewrite(self, graph: ir.Graph, node: ir.Node, names: FreshNames) -> None:
        k, n, bits, block = nbits_geometry(node)
        k_blocks = -(-k // block)
        ins = MATMUL_NBITS.named_inputs(list(node.inputs))
        b = ins["B"].const_value
        scales = ins["scales"].const_value
        zp = ins["zero_points"].const_value if ins["zero_points"] is not None else None

        def compute() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            return nbits_tensor_arrays((k, n, bits, block), b, scales, zp)

        code_type = ir.DataType.UINT4 if bits == 4 else ir.DataType.UINT8
        base = node.outputs[0].name or "nbits"
        tensors = (
            _lazy(compute, 0, code_type, (k, n)),
            _lazy(compute, 1, scales.dtype, (k_blocks, n)),
            _lazy(compute, 2, code_type, (k_blocks, n)),
        )
        values = []
        for suffix, tensor in zip(("codes", "scale", "zero_point"), tensors, strict=True):
            name = names(f"{base}_{suffix}")
            tensor.name = name
            value = ir.Value(name=name, shape=tensor.shape, type=ir.TensorType(tensor.dtype))
            value.const_value = tensor
            graph.register_initializer(value)
            values.append(value)
        dq = ir.node(
            "DequantizeLinear",
            values,
            attributes={"axis": 0, "block_size": block},
            name=names(f"{node.name or base}_dq"),
        )
        dq.outputs[0].name = names(f"{base}_weight")
        dq.outputs[0].dtype = scales.dtype
        dq.outputs[0].shape = ir.Shape((k, n))
        matmul = ir.node("MatMul", [ins["A"], dq.outputs[0]], name=names(f"{node.name or base}"))
        out = node.outputs[0]
        matmul.outputs[0].dtype = out.dtype if out.dtype is not None else scales.dtype
        matmul.outputs[0].shape = out.shape
        graph.insert_before(node, [dq, matmul])
        ir.convenience.replace_all_uses_with(out, matmul.outputs[0], replace_graph_outputs=True)
        graph.remove(node, safe=True)
        # the new output is that value (the same function under the same name): it takes the
        # name and the meta, so the pipeline's splice (which stops at values tagged as the
        # original's and finds them there by name) does not copy the DQ form into the model
        old = out.name
        out.name = None
        matmul.outputs[0].name = old
        for key, entry in out.meta.items():
            matmul.outputs[0].meta.setdefault(key, entry)
