"""Tests of the sample MoE layers (``onnx_moe_fuse.samples``) and the reference path.

Every test draws fresh random inputs; the seed is in every failure message. Set
``ONNX_MOE_FUSE_SEED`` to replay one.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
from helpers import env_seed, expert_operands, initializer, nonzero_rel_err

from onnx_moe_fuse.samples import (
    DEFAULT_SAMPLE,
    Sample,
    all_samples,
    default_sample,
    get_sample,
    sample_names,
)
from onnx_moe_fuse.samples.catalog import CONSTRUCTED_ROUTING
from onnx_moe_fuse.samples.text_form import GraphText
from onnx_moe_fuse.verify.ort_nodes import session
from onnx_moe_fuse.verify.reference import random_feeds, reference_evaluator, run_reference

REPO = Path(__file__).resolve().parents[2]
RTOL = 1e-4
NEAR_MISS_REASONS = {
    "sigmoid routing",
    "weights not constant",
    "not renormalised",
    "exact gelu",
}

SAMPLES: dict[str, Sample] = {s.name: s for s in all_samples()}
NAMES = list(SAMPLES)
DECOMPOSED = [n for n, s in SAMPLES.items() if s.spelling == "decomposed"]
GROUPED = [n for n, s in SAMPLES.items() if s.spelling == "GroupedMatMul"]
POSITIVE = [n for n, s in SAMPLES.items() if not s.is_near_miss]
NEAR_MISSES = [n for n, s in SAMPLES.items() if s.is_near_miss]


def feeds_for(sample: Sample, seed: int) -> dict[str, np.ndarray]:
    feeds = random_feeds(sample.model, seed, sample.dim_values)
    for name, value in feeds.items():
        assert np.abs(value).max() > 0, f"input {name} is all zeros (seed {seed})"
    return feeds


# -- catalogue ---------------------------------------------------------------------------------


def test_catalogue() -> None:
    assert sample_names() == NAMES
    assert len(NAMES) == len(set(NAMES))
    assert DEFAULT_SAMPLE in SAMPLES
    d = default_sample()
    assert (d.name, d.family, d.spelling, d.weights) == (
        "mixtral_dec_int4b32",
        "mixtral",
        "decomposed",
        "int4-block32",
    )
    assert d.expected == [("QMoE", 1)]
    families = {s.family for s in SAMPLES.values() if not s.is_near_miss}
    assert {"mixtral", "qwen3", "qwen2", "gptoss"} <= families
    assert {s.weights for s in SAMPLES.values()} >= {
        "float",
        "int4-block32",
        "int4-block128",
        "uint8-per-channel",
    }
    assert any(
        s.model.graph.input[0].type.tensor_type.shape.dim[0].dim_param == "B"
        for s in SAMPLES.values()
    )
    with pytest.raises(KeyError):
        get_sample("no_such_sample")


def test_get_sample_builds_fresh_equal_models() -> None:
    a, b = get_sample(DEFAULT_SAMPLE), get_sample(DEFAULT_SAMPLE)
    assert a.model is not b.model
    assert a.model.SerializeToString() == b.model.SerializeToString()


@pytest.mark.parametrize("name", NAMES)
def test_record_well_formed(name: str) -> None:
    s = SAMPLES[name]
    assert isinstance(s.model, onnx.ModelProto)
    assert s.description and s.family and s.weights
    assert s.spelling in ("GroupedMatMul", "decomposed")
    ops = {n.op_type for n in s.model.graph.node}
    assert ("GroupedMatMul" in ops) == (s.spelling == "GroupedMatMul")
    assert s.opset == {o.domain: o.version for o in s.model.opset_import}[""]
    assert s.opset == (29 if s.spelling == "GroupedMatMul" else 21)
    quantized = s.weights not in ("float",)
    assert ("DequantizeLinear" in ops) == quantized
    # token dims are symbolic
    dims = s.model.graph.input[0].type.tensor_type.shape.dim
    assert all(d.dim_param for d in dims[:-1]) and set(s.dim_values) == {
        d.dim_param for d in dims[:-1]
    }
    meta = {p.key: p.value for p in s.model.metadata_props}
    assert meta["onnx_moe_fuse.sample"] == name
    assert json.loads(meta["onnx_moe_fuse.expected"]) == [list(e) for e in s.expected]
    if s.twin is not None:
        twin = SAMPLES[s.twin]
        assert s.spelling == "GroupedMatMul" and twin.spelling == "decomposed"
        assert (twin.expected, twin.near_miss_reason) == (s.expected, s.near_miss_reason)
    else:
        assert s.spelling == "decomposed"
    if s.is_near_miss:
        return
    ((op, count),) = s.expected
    assert count == 1 and op == ("MoE" if s.weights == "float" else "QMoE")
    assert s.near_miss_reason is None
    assert s.expected_attributes["k"] >= 1
    assert dict(s.kept_ops)["MatMul"] >= 1


@pytest.mark.parametrize("name", NEAR_MISSES)
def test_near_miss_record(name: str) -> None:
    s = SAMPLES[name]
    assert s.expected == []
    assert s.near_miss_reason in NEAR_MISS_REASONS
    assert "Must NOT fuse" in s.description
    meta = {p.key: p.value for p in s.model.metadata_props}
    assert meta["onnx_moe_fuse.near_miss_reason"] == s.near_miss_reason
    assert not s.expected_attributes
    model = s.model
    if s.near_miss_reason == "weights not constant":
        inputs = {i.name for i in model.graph.input}
        assert {"fc1_gate_weight", "fc1_up_weight", "fc2_weight"} <= inputs


# -- checker -----------------------------------------------------------------------------------


def _gmm_in_private_domain(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy whose GroupedMatMul nodes sit in a private domain, default opset lowered to 28."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    for node in m.graph.node:
        if node.op_type == "GroupedMatMul" and node.domain == "":
            node.domain = "test.grouped_matmul"
    for imp in m.opset_import:
        if imp.domain == "":
            imp.version = onnx.defs.onnx_opset_version()
    m.opset_import.append(onnx.helper.make_opsetid("test.grouped_matmul", 1))
    return m


@pytest.mark.parametrize("name", NAMES)
def test_checker(name: str) -> None:
    s = SAMPLES[name]
    if s.opset <= onnx.defs.onnx_opset_version():
        onnx.checker.check_model(s.model, full_check=True)
        return
    # The installed onnx has no opset-29 schemas: the checker refuses GroupedMatMul itself.
    with pytest.raises(onnx.checker.ValidationError, match="GroupedMatMul"):
        onnx.checker.check_model(s.model)
    # Everything else must pass with GroupedMatMul moved aside.
    onnx.checker.check_model(_gmm_in_private_domain(s.model))


# -- numerics ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", DECOMPOSED)
def test_decomposed_runs_in_ort_like_reference(name: str) -> None:
    s = SAMPLES[name]
    seed = env_seed()
    feeds = feeds_for(s, seed)
    ref = run_reference(s.model, feeds, check_shapes=True)
    names = [o.name for o in s.model.graph.output]
    sess = session(s.model, threads=None, log_severity_level=3)
    got = dict(zip(names, sess.run(None, feeds), strict=True))
    for out, expected in ref.items():
        assert got[out].shape == expected.shape, f"{name}/{out} (seed {seed})"
        err = nonzero_rel_err(got[out], expected)
        assert err <= RTOL, f"{name}/{out}: ORT vs reference rel err {err:.2e} (seed {seed})"


@pytest.mark.parametrize("name", GROUPED)
def test_grouped_matmul_matches_decomposed_twin(name: str) -> None:
    s = SAMPLES[name]
    twin = SAMPLES[s.twin or ""]
    seed = env_seed()
    feeds = feeds_for(s, seed)
    assert feeds.keys() == feeds_for(twin, seed).keys()
    a = run_reference(s.model, feeds, check_shapes=True)
    b = run_reference(twin.model, feeds, check_shapes=True)
    assert a.keys() == b.keys()
    for out in a:
        err = nonzero_rel_err(a[out], b[out])
        assert err <= RTOL, f"{name} vs {twin.name}/{out}: rel err {err:.2e} (seed {seed})"


# -- the recorded fusion is exact --------------------------------------------------------------


def fused_node_model(s: Sample, attrs: dict[str, int | float | str], op: str) -> onnx.ModelProto:
    """A one-node model ``op(tokens, logits)`` holding ``s``'s experts in ORT's layout."""
    m = s.model
    g = GraphText("fused")
    h = m.graph.input[0].type.tensor_type.shape.dim[-1].dim_value
    e = initializer(m, "router_weight").shape[1]
    g.add_input(f"float[M,{h}]", "tokens")
    g.add_input(f"float[M,{e}]", "logits")
    g.add_output(f"float[M,{h}]", "moe_out")
    bits = None if op == "MoE" else int(attrs["expert_weight_bits"])
    inputs = ["tokens", "logits"]
    for key, value in expert_operands(m, op, bits).items():
        inputs.append("" if value is None else g.add_initializer(key, value))
    while inputs[-1] == "":
        inputs.pop()
    g.node(op, inputs, "moe_out", domain="com.microsoft", **attrs)
    return g.to_model(21, extra_opsets={"com.microsoft": 1})


def layer_values(s: Sample, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Tokens ``[M, H]``, router logits ``[M, E]`` and the routed-experts output ``[M, H]``."""
    values = reference_evaluator(s.model).run(None, feeds, intermediate=True)
    logits = values.get("router_logits_biased", values["router_logits"])
    tokens = values.get("tokens", feeds["x"])
    if "moe_out" in values:
        out = values["moe_out"]
    else:
        out = values["layer_out"] if "layer_out" in values else values["y"]
    return {"tokens": tokens, "logits": logits, "moe_out": out}


@pytest.mark.parametrize("name", [n for n in POSITIVE if n not in CONSTRUCTED_ROUTING])
def test_expected_fusion_is_exact(name: str) -> None:
    """The recorded op and attributes, fed the sample's weights, compute the sample's layer."""
    s = SAMPLES[name]
    ((op, _),) = s.expected
    fused = fused_node_model(s, s.expected_attributes, op)
    seed = env_seed()
    v = layer_values(s, feeds_for(s, seed))
    feeds = {"tokens": v["tokens"], "logits": v["logits"]}
    ref = run_reference(fused, feeds, check_shapes=True)["moe_out"]
    err = nonzero_rel_err(ref, v["moe_out"])
    assert err <= RTOL, f"{name}: oracle {op} vs layer rel err {err:.2e} (seed {seed})"
    got = session(fused, threads=None, log_severity_level=3).run(None, feeds)[0]
    err = nonzero_rel_err(got, v["moe_out"])
    assert err <= RTOL, f"{name}: ORT {op} vs layer rel err {err:.2e} (seed {seed})"


_QMOE_INT4_SWIGLU: dict[str, int | float | str] = {
    "activation_type": "swiglu",
    "swiglu_fusion": 1,
    "expert_weight_bits": 4,
    "block_size": 32,
}
# The fused node a careless rule would emit for a near miss (those where one exists).
NEAREST_FUSION: dict[str, tuple[str, dict[str, int | float | str]]] = {
    "sigmoid routing": ("QMoE", {**_QMOE_INT4_SWIGLU, "k": 2, "normalize_routing_weights": 1}),
    "not renormalised": ("QMoE", {**_QMOE_INT4_SWIGLU, "k": 4, "normalize_routing_weights": 0}),
}


@pytest.mark.parametrize(
    "name", [n for n in NEAR_MISSES if SAMPLES[n].near_miss_reason in NEAREST_FUSION]
)
def test_near_miss_is_real(name: str) -> None:
    """The nearest fused node computes something else (the refusal is not over-cautious)."""
    s = SAMPLES[name]
    op, attrs = NEAREST_FUSION[s.near_miss_reason or ""]
    seed = env_seed()
    v = layer_values(s, feeds_for(s, seed))
    fused = fused_node_model(s, attrs, op)
    got = run_reference(fused, {"tokens": v["tokens"], "logits": v["logits"]})["moe_out"]
    assert nonzero_rel_err(got, v["moe_out"]) > 1e-2, f"{name}: fusing would be exact (seed {seed})"


# -- reference helpers -------------------------------------------------------------------------


def test_random_feeds_shapes_and_seed() -> None:
    s = get_sample("qwen2_dec_f32_rank3")
    a = random_feeds(s.model, 7, {"B": 4, "S": 2})
    b = random_feeds(s.model, 7, {"B": 4, "S": 2})
    c = random_feeds(s.model, 8, {"B": 4, "S": 2})
    assert list(a) == ["x"] and a["x"].shape == (4, 2, 64) and a["x"].dtype == np.float32
    np.testing.assert_array_equal(a["x"], b["x"])
    assert not np.array_equal(a["x"], c["x"])
    assert random_feeds(get_sample(DEFAULT_SAMPLE).model, 1)["x"].shape == (5, 64)
    inputs = random_feeds(get_sample("nearmiss_weights_not_const_dec_f32").model, 1)
    assert inputs["fc2_weight"].shape == (8, 32, 64)


def test_reference_runs_declared_opset_29() -> None:
    s = get_sample("mixtral_gmm_f32")
    assert s.opset > onnx.defs.onnx_opset_version() or s.opset == 29
    seed = env_seed()
    out = run_reference(s.model, feeds_for(s, seed))
    assert out["y"].shape == (5, 64) and np.isfinite(out["y"]).all(), f"seed {seed}"


# -- generator script --------------------------------------------------------------------------


def test_generate_script_writes_index(tmp_path: Path) -> None:
    script = REPO / "sample_models" / "generate.py"
    only = [DEFAULT_SAMPLE, "mixtral_gmm_int4b32", "nearmiss_erf_gelu_dec_f32"]
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path), "--only", *only],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["default_sample"] == DEFAULT_SAMPLE
    assert [e["name"] for e in index["samples"]] == only
    for entry in index["samples"]:
        s = SAMPLES[entry["name"]]
        assert entry["expected"] == [list(x) for x in s.expected]
        assert entry["description"] == s.description
        assert entry["near_miss_reason"] == s.near_miss_reason
        model = onnx.load(str(tmp_path / entry["file"]))
        assert model.SerializeToString() == s.model.SerializeToString()


def test_generate_all_in_process(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "onnx_moe_fuse_sample_generate", REPO / "sample_models" / "generate.py"
    )
    assert spec is not None and spec.loader is not None
    generate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generate)
    assert generate.main([str(tmp_path)]) == 0
    index = json.loads((tmp_path / "index.json").read_text())
    every = sample_names(kind="all")  # the MoE samples and the QKV ones
    assert [e["name"] for e in index["samples"]] == every
    assert set(NAMES) < set(every)
    assert all((tmp_path / f"{n}.onnx").is_file() for n in every)


@pytest.mark.parametrize("name", [n for n in NAMES if SAMPLES[n].family == "gptoss"])
def test_gptoss_clamps_are_active(name: str) -> None:
    """Random inputs push FC1 outputs past the limit 7, so a fusion that drops it is caught."""
    s = SAMPLES[name]
    seed = env_seed()
    v = reference_evaluator(s.model).run(None, feeds_for(s, seed), intermediate=True)
    gate_clamped = np.mean(v["gate"] > 7.0)
    up_clamped = np.mean(np.abs(v["up"]) > 7.0)
    assert gate_clamped > 0.02 and up_clamped > 0.04, f"{name} (seed {seed})"


def test_reference_qmoe_zero_point_inputs() -> None:
    """Explicit zero points (inputs 11, 12): symmetric ones change nothing; others match ORT."""
    s = SAMPLES[DEFAULT_SAMPLE]
    fused = fused_node_model(s, s.expected_attributes, "QMoE")
    seed = env_seed()
    v = layer_values(s, feeds_for(s, seed))
    feeds = {"tokens": v["tokens"], "logits": v["logits"]}
    plain = run_reference(fused, feeds)["moe_out"]
    node = fused.graph.node[-1]
    shapes = {t.name: tuple(t.dims) for t in fused.graph.initializer}
    for byte in (0x88, 0x78):
        m = onnx.ModelProto()
        m.CopyFrom(fused)
        qmoe = m.graph.node[-1]
        assert qmoe.op_type == "QMoE" and list(qmoe.input) == list(node.input)
        for i, w in ((1, "w1"), (2, "w2")):
            e, n, _ = shapes[w]
            zp = np.full((e, n, 1), byte, dtype=np.uint8)  # one block per row, K/32/2 bytes
            zp = np.repeat(zp, max(1, shapes[f"s{i}"][2] // 2), axis=2)
            m.graph.initializer.append(onnx.numpy_helper.from_array(zp, f"zp{i}"))
        qmoe.input.extend([""] * (11 - len(qmoe.input)) + ["zp1", "zp2"])
        got = run_reference(m, feeds)["moe_out"]
        if byte == 0x88:
            np.testing.assert_array_equal(got, plain, err_msg=f"seed {seed}")
        else:  # zero points 8 (even blocks) and 7 (odd blocks): ORT CPU is the reference
            want = session(m).run(None, feeds)[0]
            assert not np.allclose(got, plain), f"seed {seed}"
            err = np.abs(got - want).max() / np.abs(want).max()
            assert err < RTOL, f"seed {seed}: reference vs ORT {err:.2e}"
