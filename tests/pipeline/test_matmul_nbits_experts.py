"""Experts quantised by ORT's own quantiser (``MatMulNBitsQuantizer``) fuse into QMoE, codes kept.

``onnxruntime.quantization.matmul_nbits_quantizer.MatMulNBitsQuantizer`` turns every MatMul
with a constant 2-D weight into ``com.microsoft.MatMulNBits``. Applied to float samples whose
experts are per-expert MatMuls (the hand-written loop over the experts with Equal masks, and
optimum-onnx's Qwen3-MoE export, which runs every expert), the fuser must emit one QMoE whose
codes are the MatMulNBits codes bit for bit (no requantisation: FC1 rows interleave gate and up,
FC2 rows are the down projection's) and whose output matches ORT on the MatMulNBits original.
The canonical pass (``rewrites/canonical/weights/nbits_weights.py``) alone: the same numbers in
ORT, and nodes it cannot read left as they are.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from helpers import rel_err
from onnx import helper, numpy_helper

from onnx_moe_fuse import fuse
from onnx_moe_fuse.contract.packing import unpack_bits, unpack_qmoe_zero_points
from onnx_moe_fuse.rewrites.canonical.weights.nbits_weights import NBitsWeightsPass
from onnx_moe_fuse.samples.handwritten import HANDWRITTEN
from onnx_moe_fuse.verify.ort_nodes import session

quantizer = pytest.importorskip("onnxruntime.quantization.matmul_nbits_quantizer")

OPTIMUM = Path(__file__).resolve().parents[2] / "sample_models" / "exported" / "optimum"


def _quantised(model: onnx.ModelProto, bits: int, block: int, symmetric: bool) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)  # the quantiser edits the model it is given
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    q = quantizer.MatMulNBitsQuantizer(copy, bits=bits, block_size=block, is_symmetric=symmetric)
    q.process()
    return q.model.model


def _consts(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _nbits(model: onnx.ModelProto, weight: str) -> onnx.NodeProto:
    """The MatMulNBits node that replaced the MatMul by the float initializer ``weight``."""
    (node,) = [
        n
        for n in model.graph.node
        if n.op_type == "MatMulNBits" and n.input[1].startswith(f"{weight}_Q")
    ]
    return node


def _codes(model: onnx.ModelProto, node: onnx.NodeProto) -> np.ndarray:
    """A MatMulNBits node's codes ``[N, K]`` as stored (K a multiple of the block)."""
    attrs = {a.name: a.i for a in node.attribute}
    b = _consts(model)[node.input[1]]
    return unpack_bits(b.reshape(attrs["N"], -1), attrs["bits"])[:, : attrs["K"]]


@pytest.mark.parametrize(
    ("bits", "block", "symmetric"),
    [(4, 16, True), (4, 32, False), (8, 128, True), (8, 128, False)],
)
def test_expert_loop_fuses_with_the_quantisers_codes(bits, block, symmetric, rng) -> None:
    float_model = HANDWRITTEN["dense_equal_loop_float"]().model
    original = _quantised(float_model, bits, block, symmetric)
    result = fuse(original)
    (fusion,) = result.report.fusions
    assert fusion["op"] == "QMoE" and fusion["attributes"]["expert_weight_bits"] == bits
    (qmoe,) = [n for n in result.model.graph.node if n.op_type == "QMoE"]
    fused = _consts(result.model)
    fc1 = unpack_bits(fused[qmoe.input[2]], bits)  # [E, 2I, H]
    fc2 = unpack_bits(fused[qmoe.input[5]], bits)  # [E, H, I]
    for e in range(fc1.shape[0]):
        gate, up, down = (_nbits(original, f"expert{e}.{p}") for p in ("gate", "up", "down"))
        np.testing.assert_array_equal(fc1[e, 0::2], _codes(original, gate))
        np.testing.assert_array_equal(fc1[e, 1::2], _codes(original, up))
        np.testing.assert_array_equal(fc2[e], _codes(original, down))
        if not symmetric:  # the quantiser's zero points, in QMoE's packing
            zp = unpack_qmoe_zero_points(
                fused[qmoe.input[12]],
                bits,
                fc2.shape[1],
                None if bits == 8 else fc2.shape[2] // block,
            )
            nb = zp.shape[2]
            want = _consts(original)[down.input[3]].reshape(fc2.shape[1], -1)
            want = unpack_bits(want, bits)[:, :nb] if bits == 4 else want[:, :nb]
            np.testing.assert_array_equal(zp[e], want)
    assert (len(qmoe.input) > 11) == (not symmetric)
    # the working copy's DQ form stays there: the router's MatMulNBits is kept as it was
    kept = [n.op_type for n in result.model.graph.node if n.domain == "com.microsoft"]
    assert sorted(kept) == ["MatMulNBits", "QMoE"], kept
    assert not any(n.op_type == "DequantizeLinear" for n in result.model.graph.node)
    feeds = {"input": rng.standard_normal((7, 64)).astype(np.float32)}
    want = session(original).run(None, feeds)[0]
    assert rel_err(session(result.model).run(None, feeds)[0], want) < 1e-5


@pytest.mark.parametrize("bits", [4, 8])
def test_optimum_qwen3_dense_experts_fuse(bits, rng) -> None:
    """optimum's Qwen3-MoE (every expert on every token), I = 40: blocks of 128 are one per row."""
    float_model = onnx.load(OPTIMUM / "qwen3_moe_optimum.onnx")
    original = _quantised(float_model, bits, 128, symmetric=bits == 4)
    assert sum(n.op_type == "MatMulNBits" for n in original.graph.node) > 20
    result = fuse(original)
    assert [f["op"] for f in result.report.fusions] == ["QMoE"], result.report.near_misses
    assert not any(n.op_type == "DequantizeLinear" for n in result.model.graph.node)
    x = np.load(OPTIMUM / "qwen3_moe_optimum.npz")["hidden_states"]
    feeds = {"hidden_states": x + 0.1 * rng.standard_normal(x.shape).astype(np.float32)}
    want = session(original).run(None, feeds)[0]
    assert rel_err(session(result.model).run(None, feeds)[0], want) < 1e-5


def test_blocks_that_do_not_divide_the_inner_size_are_refused() -> None:
    """I = 40 in blocks of 32: MatMulNBits pads the last block, QMoE cannot: refused, why."""
    original = _quantised(onnx.load(OPTIMUM / "qwen3_moe_optimum.onnx"), 4, 32, True)
    result = fuse(original)
    assert not result.report.fusions
    assert any(
        "block size 32 does not divide K = 40" in m["reason"] for m in result.report.near_misses
    )


def test_a_quantised_router_stays_and_the_float_experts_fuse(rng) -> None:
    """The quantiser also takes the router's MatMul: it stays (MatMulNBits), the experts fuse."""
    float_model = HANDWRITTEN["swish_silu"]().model
    original = _quantised(float_model, 4, 32, True)
    result = fuse(original)
    assert [f["op"] for f in result.report.fusions] == ["MoE"], result.report.near_misses
    assert sum(n.op_type == "MatMulNBits" for n in result.model.graph.node) == 1
    name = original.graph.input[0].name
    h = original.graph.input[0].type.tensor_type.shape.dim[1].dim_value
    feeds = {name: rng.standard_normal((5, h)).astype(np.float32)}
    want = session(original).run(None, feeds)[0]
    assert rel_err(session(result.model).run(None, feeds)[0], want) < 1e-5


def _one_nbits(rng, inputs: list[str], extra: dict[str, np.ndarray], k=64, n=16, bits=4, block=32):
    w = rng.standard_normal((k, n)).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("MatMul", ["a", "w"], ["y"])],
        "one",
        [helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, ["T", k])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["T", n])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    model = _quantised(model, bits, block, symmetric=False)
    node = model.graph.node[0]
    for name, value in extra.items():
        model.graph.initializer.append(numpy_helper.from_array(value, name))
    node.input.extend(inputs)
    return model


def test_the_pass_computes_the_same_in_ort_and_leaves_what_it_cannot_read(rng) -> None:
    model = _one_nbits(rng, [], {})
    ir_model = ir.serde.deserialize_model(model)
    assert NBitsWeightsPass()(ir_model).modified
    ops = [n.op_type for n in ir_model.graph]
    assert ops == ["DequantizeLinear", "MatMul"], ops
    canon = ir.serde.serialize_model(ir_model)
    feeds = {"a": rng.standard_normal((5, 64)).astype(np.float32)}
    want = session(model).run(None, feeds)[0]
    assert rel_err(session(canon).run(None, feeds)[0], want) < 1e-6
    # a bias (input 5) or a g_idx (input 4): left as they are
    for inputs, extra in (
        (["", "bias"], {"bias": np.ones(16, np.float32)}),
        (["gidx"], {"gidx": np.arange(64, dtype=np.int32) // 32}),
    ):
        other = ir.serde.deserialize_model(_one_nbits(rng, inputs, extra))
        assert not NBitsWeightsPass()(other).modified
        assert [n.op_type for n in other.graph] == ["MatMulNBits"]
