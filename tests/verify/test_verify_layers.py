"""Per-layer verification (fuser/verify/layers.py, regions.py, reference_dq.py).

Each fused layer of a stacked int4 model is cut with its original region and compared on
fresh inputs: it passes on the fuser's output, fails naming the layer when one fused weight
byte is changed, refuses before any work when the estimate exceeds the memory available, and
the command line's --per-layer reaches it. The reference run's rewrites (experts gathered
before DequantizeLinear; each picked expert dequantised and multiplied alone) and its blocked
DequantizeLinear are checked against onnx's own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnx_moe_fuse.cli import EXIT_OK, EXIT_USAGE, main
from onnx_moe_fuse.io.model_io import load_model
from onnx_moe_fuse.samples.stacked import stacked_moe_model
from onnx_moe_fuse.streaming_io import fuse_file
from onnx_moe_fuse.verify import layers as layers_mod
from onnx_moe_fuse.verify.layers import VerifyMemoryError, verify_layers
from onnx_moe_fuse.verify.mapped_weights import (
    MAPPED_DOMAIN,
    UnpackFourBit,
    map_gathered_weights,
)
from onnx_moe_fuse.verify.reference_dq import DequantizeLinear, _as_float32
from onnx_moe_fuse.verify.reference_matmul import DequantizeMatMul, fuse_dequantize_matmul
from onnx_moe_fuse.verify.regions import select_before_dequantize

SMALL = {"hidden": 64, "inter": 32, "experts": 4}


@pytest.fixture(scope="module")
def fused_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("layers")
    src = folder / "m.onnx"
    onnx.save(stacked_moe_model(2, **SMALL, seed_key="per_layer"), src,
              save_as_external_data=True, location="m.onnx.data", size_threshold=0)  # fmt: skip
    out = folder / "f.onnx"
    result = fuse_file(src, out, jobs=1)
    assert len(result.report.fusions) == 2
    return src, out, result.report.fusions


def test_every_fused_layer_passes_against_its_region(fused_pair, device):
    src, out, fusions = fused_pair
    got = verify_layers(src, out, fusions, seeds=[3, 4])
    assert got["passed"] and got["mode"] == "per-layer"
    assert [r["layer"] for r in got["layers"]] == [f["name"] for f in fusions]
    for record in got["layers"]:
        assert record["paths"]["ort"]["status"] == "passed"
        assert record["paths"]["wgpu"]["status"] == "passed"
        assert 0 < record["max_rel"] < 1e-4 and record["seconds"] > 0
        assert 0 < record["cpu_seconds"] and record["peak_rss_mib"] <= got["estimate_mib"]


def test_a_changed_fused_weight_fails_that_layer_only(fused_pair, tmp_path, device):
    src, out, fusions = fused_pair
    bad = tmp_path / "f.onnx"
    (tmp_path / "f.onnx").write_bytes(out.read_bytes())
    data = bytearray((out.parent / "f.onnx.data").read_bytes())
    proto = onnx.load(str(out), load_external_data=False)
    second = fusions[1]["name"].split("/")[0]
    tensor = next(t for t in proto.graph.initializer
                  if t.name.startswith(second) and t.name.endswith("fc2_experts_weights"))  # fmt: skip
    offset = int(next(e.value for e in tensor.external_data if e.key == "offset"))
    data[offset : offset + 64] = bytes(b ^ 0x77 for b in data[offset : offset + 64])
    (tmp_path / "f.onnx.data").write_bytes(bytes(data))
    got = verify_layers(src, bad, fusions, seeds=[0])
    assert not got["passed"]
    assert [r["passed"] for r in got["layers"]] == [True, False]


def test_an_estimate_over_the_memory_available_is_refused_first(fused_pair, monkeypatch):
    src, out, fusions = fused_pair
    monkeypatch.setattr(layers_mod, "available_bytes", lambda: 1 << 20)
    ran = []
    monkeypatch.setattr(layers_mod, "verify", lambda *a, **k: ran.append(1))
    with pytest.raises(VerifyMemoryError, match=r"needs about .* but 1\.0 MB"):
        verify_layers(src, out, fusions, seeds=[0])
    assert not ran


def test_the_command_line_verifies_layer_by_layer(fused_pair, tmp_path, capsys, device):
    src, _, _ = fused_pair
    out, report = tmp_path / "o.onnx", tmp_path / "r.json"
    code = main([str(src), "-o", str(out), "--verify", "--per-layer", "--seeds", "1",
                 "--report", str(report), "--jobs", "2"])  # fmt: skip
    assert code == EXIT_OK, capsys.readouterr().err
    verification = json.loads(report.read_text())["verification"]
    assert verification["passed"] and len(verification["layers"]) == 2
    assert out.is_file() and "layer" in capsys.readouterr().out


def test_the_command_line_refuses_too_large_a_layer_with_exit_2(
    fused_pair, tmp_path, monkeypatch, capsys, device
):
    src, _, _ = fused_pair
    monkeypatch.setattr(layers_mod, "available_bytes", lambda: 1 << 20)
    code = main([str(src), "-o", str(tmp_path / "o.onnx"), "--verify", "--per-layer"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE, err
    assert "needs about" in err and not list(tmp_path.iterdir())


def test_per_layer_without_verify_is_refused(fused_pair, tmp_path, capsys):
    src, _, _ = fused_pair
    assert main([str(src), "-o", str(tmp_path / "o.onnx"), "--per-layer"]) == EXIT_USAGE
    assert "--per-layer" in capsys.readouterr().err


def _gather_dq_model(
    qtype: int, block: int, zero_point: bool, rng, e: int = 5, k: int = 64, n: int = 6
) -> tuple[onnx.ModelProto, dict]:
    signed = qtype in (TensorProto.INT4, TensorProto.INT8)
    lo, hi = (-8, 8) if qtype in (TensorProto.INT4, TensorProto.UINT4) else (-128, 128)
    lo, hi = (0, hi - lo) if not signed else (lo, hi)
    q = rng.integers(lo, hi, (e, k, n))
    s = rng.standard_normal((e, k // block, n)).astype(np.float32)
    z = rng.integers(lo, hi, (e, k // block, n))
    inits = [helper.make_tensor("q", qtype, q.shape, q.reshape(-1).tolist()),
             helper.make_tensor("s", TensorProto.FLOAT, s.shape, s.reshape(-1).tolist())]  # fmt: skip
    dq_in = ["q", "s"]
    if zero_point:
        inits.append(helper.make_tensor("z", qtype, z.shape, z.reshape(-1).tolist()))
        dq_in.append("z")
    nodes = [
        helper.make_node("DequantizeLinear", dq_in, ["w"], axis=1, block_size=block),
        helper.make_node("Gather", ["w", "idx"], ["sel"], axis=0),
        helper.make_node("MatMul", ["x", "sel"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("idx", TensorProto.INT64, [3, 2]),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 2, 1, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits,
    )  # fmt: skip
    feeds = {
        "idx": rng.integers(0, e, (3, 2)),
        "x": rng.standard_normal((3, 2, 1, k)).astype(np.float32),
    }
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25)]), feeds


@pytest.mark.parametrize(
    "qtype", [TensorProto.INT4, TensorProto.UINT4, TensorProto.INT8, TensorProto.UINT8]
)
@pytest.mark.parametrize("zero_point", [False, True])
def test_gathering_before_dequantizing_computes_the_same(qtype, zero_point, rng):
    model, feeds = _gather_dq_model(qtype, 16, zero_point, rng)
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    assert select_before_dequantize(rewritten) == 1
    assert [n.op_type for n in rewritten.graph.node].count("DequantizeLinear") == 1
    assert not any(n.output[0] == "w" for n in rewritten.graph.node)  # the whole stack: gone
    for ops in ([], [DequantizeLinear]):
        got = ReferenceEvaluator(rewritten, new_ops=ops).run(None, feeds)[0]
        np.testing.assert_array_equal(got, want)


def test_per_expert_scales_are_left_as_they_are(rng):
    model, _ = _gather_dq_model(TensorProto.INT8, 16, False, rng)
    model.graph.node[0].attribute[0].i = 0  # axis 0: one scale per expert, not gathered safely
    del model.graph.node[0].attribute[1:]
    assert select_before_dequantize(model) == 0


def _save_external(model: onnx.ModelProto, path) -> None:
    """``model`` with every initializer in raw bytes in ``path``'s data file (m.data)."""
    for t in model.graph.initializer:  # onnx moves only raw_data tensors out
        t.CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(t), t.name))
    onnx.save(model, path, save_as_external_data=True, location="m.data", size_threshold=0)


@pytest.mark.parametrize(
    "qtype", [TensorProto.INT4, TensorProto.UINT4, TensorProto.INT8, TensorProto.UINT8]
)
@pytest.mark.parametrize("n", [6, 5])
def test_mapped_weights_compute_what_loaded_weights_compute(qtype, n, rng, tmp_path):
    model, feeds = _gather_dq_model(qtype, 16, True, rng, n=n)
    want = ReferenceEvaluator(model).run(None, feeds)[0]  # onnx's own, weights in the proto
    _save_external(model, tmp_path / "m.onnx")
    cut = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    assert select_before_dequantize(cut) == 1
    weights = map_gathered_weights(cut, tmp_path)
    assert sorted(weights) == ["q", "s", "z"]
    assert all(isinstance(w, np.memmap) for w in weights.values())
    assert not cut.graph.initializer  # every weight read from its map, none loaded
    got = ReferenceEvaluator(cut, new_ops=[DequantizeLinear, UnpackFourBit]).run(
        None, {**feeds, **weights}
    )[0]
    np.testing.assert_array_equal(got, want)


def test_a_four_bit_expert_of_an_odd_count_of_codes_is_loaded(rng, tmp_path):
    model, feeds = _gather_dq_model(TensorProto.INT4, 3, False, rng, e=3, k=9, n=7)  # 63 codes
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    _save_external(model, tmp_path / "m.onnx")
    cut = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    select_before_dequantize(cut)
    weights = map_gathered_weights(cut, tmp_path)
    assert "q" not in weights and [t.name for t in cut.graph.initializer] == ["q"]
    loaded = load_model(cut, base_dir=tmp_path)
    got = ReferenceEvaluator(loaded, new_ops=[DequantizeLinear, UnpackFourBit]).run(
        None, {**feeds, **weights}
    )[0]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("dtype", ["int4", "uint4", "int8", "uint8"])
def test_one_byte_codes_become_the_floats_ml_dtypes_gives(dtype):
    codes = np.arange(256, dtype=np.uint8).view(onnx.helper.tensor_dtype_to_np_dtype(
        {"int4": TensorProto.INT4, "uint4": TensorProto.UINT4, "int8": TensorProto.INT8,
         "uint8": TensorProto.UINT8}[dtype]))  # fmt: skip
    np.testing.assert_array_equal(_as_float32(codes), codes.astype(np.float32))


@pytest.mark.parametrize("qtype", [TensorProto.INT4, TensorProto.UINT4])
def test_unpacking_picked_rows_gives_what_onnx_reads(qtype, rng):
    packed = rng.integers(0, 256, (3, 2, 12), dtype=np.uint8)  # 3 x 2 picked experts of 4 x 6
    node = helper.make_node("UnpackFourBit", ["p"], ["c"], domain=MAPPED_DOMAIN,
                            data_type=qtype, dims=[4, 6])  # fmt: skip
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("p", TensorProto.UINT8, [3, 2, 12])],
        [helper.make_tensor_value_info("c", qtype, None)],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 25),
                                                     helper.make_opsetid(MAPPED_DOMAIN, 1)])  # fmt: skip
    got = ReferenceEvaluator(model, new_ops=[UnpackFourBit]).run(None, {"p": packed})[0]
    whole = helper.make_tensor("w", qtype, [6, 4, 6], packed.tobytes(), raw=True)
    want = onnx.numpy_helper.to_array(whole).reshape(3, 2, 4, 6)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize(
    "qtype", [TensorProto.INT4, TensorProto.UINT4, TensorProto.INT8, TensorProto.UINT8]
)
@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("broadcast", [False, True])
def test_experts_multiplied_one_at_a_time_compute_what_onnx_computes(
    qtype, zero_point, broadcast, rng, tmp_path
):
    model, feeds = _gather_dq_model(qtype, 16, zero_point, rng)
    if broadcast:  # tokens shared by every picked expert: leading dims differ, computed whole
        feeds["x"] = feeds["x"][:1, :1]
        model.graph.input[1].CopyFrom(
            helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 1, 64])
        )
    want = ReferenceEvaluator(model).run(None, feeds)[0]
    _save_external(model, tmp_path / "m.onnx")
    cut = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    select_before_dequantize(cut)
    weights = map_gathered_weights(cut, tmp_path)
    assert fuse_dequantize_matmul(cut) == 1
    ops = [n.op_type for n in cut.graph.node]
    assert "MatMul" not in ops and "DequantizeLinear" not in ops
    four_bit = qtype in (TensorProto.INT4, TensorProto.UINT4)
    assert ops.count("UnpackFourBit") == (four_bit and zero_point)  # the codes' taken in
    got = ReferenceEvaluator(cut, new_ops=[DequantizeLinear, UnpackFourBit, DequantizeMatMul]).run(
        None, {**feeds, **weights}
    )[0]
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_a_dequantized_weight_read_twice_is_not_taken_in(rng):
    model, _ = _gather_dq_model(TensorProto.INT8, 16, False, rng)
    select_before_dequantize(model)
    model.graph.output.append(helper.make_tensor_value_info("sel", TensorProto.FLOAT, None))
    assert fuse_dequantize_matmul(model) == 0


def test_the_reference_process_runs_blas_on_one_thread():
    code = (
        "import ctypes, numpy\n"
        "from onnx_moe_fuse.io.processes import single_threaded_blas\n"
        "path = next((l.split()[-1] for l in open('/proc/self/maps') if 'openblas' in l.lower()),"
        " None)\n"
        "if path is None: print('no openblas'); raise SystemExit\n"
        "assert single_threaded_blas()\n"
        "lib = ctypes.CDLL(path)\n"
        "get = next(getattr(lib, n) for n in ('scipy_openblas_get_num_threads64_',"
        " 'openblas_get_num_threads64_', 'openblas_get_num_threads') if hasattr(lib, n))\n"
        "print(get())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, "OPENBLAS_NUM_THREADS": "2"})  # fmt: skip
    assert done.returncode == 0, done.stderr
    if done.stdout.strip() == "no openblas":
        pytest.skip("numpy's BLAS here is not OpenBLAS")
    assert done.stdout.strip() == "1"
