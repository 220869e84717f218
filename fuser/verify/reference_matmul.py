"""Picked experts dequantised and multiplied one at a time (per-layer verification's reference run).

After :func:`.regions.select_before_dequantize` and :func:`.mapped_weights.map_gathered_weights`
an expert layer's reference run is, per FC part, ``Gather`` of the picked experts' codes (4-bit
ones then :class:`.mapped_weights.UnpackFourBit`), ``DequantizeLinear`` to float32 and
``MatMul`` with the tokens: for a Qwen3-30B-A3B layer 40 picked experts make 750 MiB of float32
weights per seed, allocated afresh by each node, to be read once by a matrix-vector product.
Those fresh pages cost more than the arithmetic (half the reference's CPU time was the kernel's).

:func:`fuse_dequantize_matmul` replaces each ``MatMul`` whose weight input is such a blocked
``DequantizeLinear`` (read by nothing else) with one :class:`DequantizeMatMul` node: for each
picked expert (each index of the leading dims) it unpacks and dequantises that expert's codes
with the same arithmetic (:func:`.reference_dq.dequantize`, :func:`.mapped_weights.
unpack_four_bit`) into one reused buffer and multiplies it with that expert's rows by numpy's
``matmul``: the same products as ``MatMul`` of the whole stack, expert by expert (numpy's batched
``matmul`` multiplies each matrix of the batch alone too; tested equal to onnx's evaluator on
the unfused nodes). Operands whose leading dims differ (broadcast) are computed whole, as before.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx.reference.op_run import OpRun

from onnx_moe_fuse.verify.mapped_weights import MAPPED_DOMAIN, unpack_four_bit
from onnx_moe_fuse.verify.reference_dq import dequantize
from onnx_moe_fuse.verify.regions import copy_node

__all__ = ["DequantizeMatMul", "fuse_dequantize_matmul"]


class DequantizeMatMul(OpRun):
    """``MatMul(a, DequantizeLinear(codes, scale, zero_point))``, one leading index at a time.

    ``packed_dims`` set: ``codes`` are 4-bit codes packed two a byte, one row per leading index
    (``UnpackFourBit``'s input; ``data_type`` their type); ``axis`` and ``block_size`` are the
    ``DequantizeLinear``'s (``axis`` counted from the end).
    """

    op_domain = MAPPED_DOMAIN

    def _run(  # type: ignore[override]
        self, a, codes, scale, zero_point=None, axis=-2, block_size=0, output_dtype=0,
        data_type=0, packed_dims=None,
    ):  # fmt: skip
        def weights(index: tuple[int, ...] | None) -> np.ndarray:
            c = codes if index is None else codes[index]
            if packed_dims:
                c = unpack_four_bit(c, data_type, packed_dims)
            s = scale if index is None else scale[index]
            z = zero_point if zero_point is None or index is None else zero_point[index]
            return dequantize(c, s, z, axis=axis, block_size=block_size, output_dtype=output_dtype)

        lead = codes.shape[:-1] if packed_dims else codes.shape[:-2]
        if not lead or a.shape[:-2] != lead or scale.shape[: len(lead)] != lead:
            return (np.matmul(a, weights(None)),)
        out = None
        for index in np.ndindex(*lead):
            product = np.matmul(a[index], weights(index))
            if out is None:
                out = np.empty((*lead, *product.shape), dtype=product.dtype)
            out[index] = product
        return (out,)


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def fuse_dequantize_matmul(model: onnx.ModelProto) -> int:
    """Each ``MatMul`` of a blocked, negative-axis ``DequantizeLinear`` made one node, in place.

    Only a ``DequantizeLinear`` read by that ``MatMul`` alone, with ``block_size`` set, its
    ``axis`` negative and within the last two dims (as :func:`.regions.select_before_dequantize`
    writes it); its ``UnpackFourBit`` input is taken in too when nothing else reads it. Returns
    how many were made.
    """
    g = model.graph
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
           for n in g.node for a in n.attribute):  # fmt: skip
        return 0
    producers = {out: n for n in g.node for out in n.output if out}
    readers: dict[str, int] = {}
    for n in g.node:
        for v in n.input:
            readers[v] = readers.get(v, 0) + 1
    for o in g.output:
        readers[o.name] = readers.get(o.name, 0) + 1
    dropped: set[int] = set()
    replaced: dict[int, onnx.NodeProto] = {}
    for mm in g.node:
        if mm.op_type != "MatMul" or mm.domain not in ("", "ai.onnx") or len(mm.input) != 2:
            continue
        dq = producers.get(mm.input[1])
        if dq is None or dq.op_type != "DequantizeLinear" or dq.domain not in ("", "ai.onnx"):
            continue
        attrs = _attrs(dq)
        if readers.get(dq.output[0]) != 1 or not attrs.get("block_size"):
            continue
        if attrs.get("axis", 1) not in (-1, -2):
            continue
        inputs = [mm.input[0], *dq.input]
        extra = {}
        unpack = producers.get(dq.input[0])
        if (
            unpack is not None
            and unpack.op_type == "UnpackFourBit"
            and unpack.domain == MAPPED_DOMAIN
            and readers.get(unpack.output[0]) == 1
        ):
            u = _attrs(unpack)
            inputs[1] = unpack.input[0]
            extra = {"data_type": u["data_type"], "packed_dims": list(u["dims"])}
            dropped.add(id(unpack))
        dropped.add(id(dq))
        fused = onnx.helper.make_node(
            "DequantizeMatMul", inputs, list(mm.output), name=f"{mm.name}/dequantized",
            domain=MAPPED_DOMAIN, **attrs, **extra,
        )  # fmt: skip
        replaced[id(mm)] = fused
    if not replaced:
        return 0
    nodes = [replaced.get(id(n), n) for n in g.node if id(n) not in dropped]
    nodes = [copy_node(n) for n in nodes]  # detached: the old list is cleared below
    del g.node[:]
    g.node.extend(nodes)
    if not any(o.domain == MAPPED_DOMAIN for o in model.opset_import):
        model.opset_import.append(onnx.helper.make_opsetid(MAPPED_DOMAIN, 1))
    return len(replaced)
