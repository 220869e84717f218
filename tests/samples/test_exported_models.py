"""The committed torch.onnx exports of transformers' MoE blocks (``sample_models/exported/``).

``sample_models/export_transformers.py`` made them (torch and transformers, in ``.venv-export``);
these tests need neither. Each model must load, pass the ONNX checker, run in ONNX Runtime's CPU
provider with graph optimisations off, and reproduce the PyTorch output stored beside it
(``<name>.npz``) within 1e-4 relative. Its record (``<name>.json``) must describe the file as
committed. See ``docs/exported-models.md``.

``causal_lm/`` holds whole 2-layer ``*ForCausalLM`` exports (input ``input_ids``, output
``logits``): each must reproduce the PyTorch logits stored beside it (float32 within 1e-4
relative, float16 within 2e-2), its dynamic ones on a prefix and on one batch row too, and its
``expected`` must follow the family's router (in float32 one MoE per layer for any top-k router
with per-selected non-negative weights; refused, naming the router, for the others).
"""

from __future__ import annotations

import functools
import json
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

REPO = Path(__file__).resolve().parents[2]
EXPORTED = REPO / "sample_models" / "exported"
INDEX = json.loads((EXPORTED / "index.json").read_text(encoding="utf-8"))
NAMES = [entry["name"] for entry in INDEX["models"]]
RECORDS = {n: json.loads((EXPORTED / f"{n}.json").read_text(encoding="utf-8")) for n in NAMES}
RTOL = 1e-4
MAX_BYTES = 1 << 20
BATCHED_MM = [n for n in NAMES if RECORDS[n]["experts_implementation"] == "batched_mm"]
# Exports whose graph only runs when every expert is hit (the TorchScript trace of the eager loop).
INPUT_DEPENDENT = [n for n in NAMES if RECORDS[n]["ort_fails_on"]]


def rel_err(actual: np.ndarray, expected: np.ndarray) -> float:
    scale = float(np.abs(expected).max())
    assert scale > 0, "reference output is all zeros: the test would prove nothing"
    return float(np.abs(actual.astype(np.float64) - expected).max() / scale)


def session(name: str) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    return ort.InferenceSession(
        str(EXPORTED / f"{name}.onnx"), opts, providers=["CPUExecutionProvider"]
    )


def reference(name: str) -> tuple[np.ndarray, np.ndarray]:
    with np.load(EXPORTED / f"{name}.npz") as data:
        return data["hidden_states"], data["output"]


def test_index_lists_every_export() -> None:
    on_disk = sorted(p.stem for p in EXPORTED.glob("*.onnx"))
    assert sorted(NAMES) == on_disk
    families = {RECORDS[n]["family"] for n in BATCHED_MM}
    assert families == {"mixtral", "qwen3_moe", "qwen2_moe", "gpt_oss"}
    assert {RECORDS[n]["exporter_kind"] for n in NAMES} == {
        "dynamo",
        "dynamo+transformers-table",
        "torchscript",
    }
    assert any(RECORDS[n]["experts_implementation"] != "batched_mm" for n in NAMES)
    # The eager loop does not export with the dynamo exporter: recorded, with its error.
    assert [f["name"] for f in INDEX["failed_exports"]] == ["mixtral_eager_dynamo"]
    assert "GuardOnDataDependentSymNode" in INDEX["failed_exports"][0]["error"]


@pytest.mark.parametrize("name", NAMES)
def test_file_small_self_contained_and_valid(name: str) -> None:
    path = EXPORTED / f"{name}.onnx"
    assert path.stat().st_size <= MAX_BYTES
    assert not list(EXPORTED.glob(f"{name}.onnx.data")), "weights must be inside the file"
    model = onnx.load(str(path), load_external_data=False)
    for init in model.graph.initializer:
        assert init.data_location != onnx.TensorProto.EXTERNAL, init.name
    onnx.checker.check_model(model, full_check=True)
    (inp,) = model.graph.input
    assert inp.name == "hidden_states"
    dims = inp.type.tensor_type.shape.dim
    assert [d.dim_param or d.dim_value for d in dims] == ["batch", "sequence", 64]


@pytest.mark.parametrize("name", NAMES)
def test_matches_pytorch_reference(name: str) -> None:
    x, want = reference(name)
    assert x.shape == (2, 8, 64) and x.dtype == np.float32
    (got,) = session(name).run(None, {"hidden_states": x})
    assert got.shape == want.shape
    err = rel_err(got, want)
    assert err <= RTOL, f"{name}: ORT vs PyTorch max relative error {err:.3g}"


@pytest.mark.parametrize("name", [n for n in NAMES if n not in INPUT_DEPENDENT])
def test_dynamic_tokens_match_reference_rows(name: str) -> None:
    """Any slice of the reference input gives the same rows of the reference output.

    Tokens are independent in an MoE block: one token, an odd run, one batch row.
    """
    x, want = reference(name)
    sess = session(name)
    for sl in (np.s_[0:1, 0:1], np.s_[1:2, 3:8], np.s_[0:2, 2:5], np.s_[1:2, :]):
        (got,) = sess.run(None, {"hidden_states": np.ascontiguousarray(x[sl])})
        assert got.shape == want[sl].shape
        err = rel_err(got, want[sl])
        assert err <= RTOL, f"{name} on {x[sl].shape}: max relative error {err:.3g}"


@pytest.mark.parametrize("name", INPUT_DEPENDENT)
def test_traced_eager_loop_fails_when_an_expert_is_not_hit(name: str) -> None:
    """The traced eager loop fails in ORT on one token.

    The TorchScript trace unrolled the loop over the experts the example input hit: one token hits
    only k < E experts, and ORT fails, so the graph's meaning depends on its input.
    """
    x, _ = reference(name)
    with pytest.raises(Exception, match="Split"):
        session(name).run(None, {"hidden_states": np.ascontiguousarray(x[0:1, 0:1])})


@pytest.mark.parametrize("name", NAMES)
def test_record_describes_committed_file(name: str) -> None:
    rec = RECORDS[name]
    model = onnx.load(str(EXPORTED / f"{name}.onnx"))
    assert rec["file"] == f"{name}.onnx"
    assert rec["file_bytes"] == (EXPORTED / rec["file"]).stat().st_size
    assert rec["op_histogram"] == dict(Counter(n.op_type for n in model.graph.node))
    assert rec["node_count"] == len(model.graph.node)
    assert rec["opset_import"] == {(o.domain or "ai.onnx"): o.version for o in model.opset_import}
    for key in ("torch", "transformers", "onnxscript"):
        assert rec["versions"][key]
    assert rec["versions"]["torch"].startswith("2.13.")
    assert max(rec["ort_vs_torch_max_rel_err"].values()) <= RTOL
    computes = rec["computes"]
    for key in ("routing", "renormalised", "top_k", "num_experts", "activation", "swiglu_order"):
        assert key in computes, key
    # What it must fuse into: [[op, count], ...] (empty: must stay unchanged), with the
    # attributes the fused node must carry, checked by a hand-built MoE in ORT.
    if rec["expected"]:
        assert rec["expected"] == [["MoE", 1]]
        attrs = rec["expected_attributes"]
        assert attrs["k"] == computes["top_k"]
        assert attrs["normalize_routing_weights"] == int(computes["renormalised"])
        assert attrs["activation_type"] == "swiglu" and attrs["swiglu_fusion"] == 1
        assert rec["expected_fusion_check"]["max_rel_err"] <= RTOL
        ops = Counter(n.op_type for n in model.graph.node)
        for op, count in rec["kept_ops"]:
            assert ops[op] >= count, (op, ops[op], count)
    else:
        assert rec["expected_attributes"] is None
        assert rec["expected_note"]
        if rec["computes"]["top_k"] > 1 and "input scaled" in rec["computes"]["combine"]:
            # Llama4 with k > 1: no fused node computes it, so there is no equivalent to check
            assert "equivalent_moe_check" not in rec
        else:
            assert rec["equivalent_moe_check"]["max_rel_err"] <= RTOL


@pytest.mark.parametrize("name", BATCHED_MM)
def test_batched_mm_spellings(name: str) -> None:
    """The spellings the issue names, pinned.

    A Gemm router, GatherND of the stacked expert weights, tokens repeated by
    Unsqueeze/Expand/Reshape, batched MatMul then Squeeze, and a Split (concatenated gate/up) or
    two step-2 Slices (gpt-oss, interleaved) with Clip clamps.
    """
    model = onnx.load(str(EXPORTED / f"{name}.onnx"))
    ops = Counter(n.op_type for n in model.graph.node)
    assert not {"Loop", "If", "Scan", "NonZero", "ScatterND", "ScatterElements"} & set(ops)
    assert ops["Gemm"] >= 1 and ops["TopK"] == 1 and ops["Softmax"] == 1
    rank3 = {i.name for i in model.graph.initializer if len(i.dims) == 3}
    gathers = [n for n in model.graph.node if n.op_type == "GatherND"]
    assert len(rank3) == 2 and rank3 <= {n.input[0] for n in gathers}
    assert ops["MatMul"] == 2 and ops["Squeeze"] >= 2
    sp = RECORDS[name]["spellings"]
    # torchlib repeats tokens with Expand; transformers' own translation table with Tile.
    repeat = "Tile" if RECORDS[name]["exporter_kind"] == "dynamo+transformers-table" else "Expand"
    assert ops[repeat] == 1
    assert sp["repeat_tokens"] == [f"{repeat}(Unsqueeze(Reshape(input)))"]
    if RECORDS[name]["family"] == "gpt_oss":
        assert sp["router"] == ["Gemm -> TopK", "TopK -> Softmax"]
        assert ops["Split"] == 0 and [s["steps"] for s in sp["slices"]] == [[2], [2]]
        assert sp["clips"] == [{"min": None, "max": 7.0}, {"min": -7.0, "max": 7.0}]
        assert ops["GatherND"] == 4  # weights and biases of both projections
    else:
        assert sp["router"] == ["Gemm -> Softmax", "Softmax -> TopK"]
        assert ops["Split"] == 1 and ops["Slice"] == 0 and ops["Clip"] == 0
        assert ops["GatherND"] == 2


# -- whole 2-layer *ForCausalLM models (sample_models/exported/causal_lm/) -----------------------

CAUSAL = EXPORTED / "causal_lm"
CAUSAL_INDEX = json.loads((CAUSAL / "index.json").read_text(encoding="utf-8"))
CAUSAL_NAMES = [entry["name"] for entry in CAUSAL_INDEX["models"]]
CAUSAL_RECORDS = {
    n: json.loads((CAUSAL / f"{n}.json").read_text(encoding="utf-8")) for n in CAUSAL_NAMES
}
CAUSAL_DYNAMIC = [n for n in CAUSAL_NAMES if CAUSAL_RECORDS[n]["dynamic_shapes"]]
#: ORT vs PyTorch logits, max |diff| / max |ref|: float16 rounds differently op by op.
CAUSAL_RTOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}
#: The families also exported in float16 and bfloat16 at opset 18 (the export script's
#: ``HALF_OPSET18``): one of each router kind the fuser meets in half precision.
HALF_OPSET18 = ("mixtral", "qwen3_moe", "gpt_oss", "deepseek_v3")
#: Their bfloat16 exports where opset 18 cannot type bfloat16 (TopK takes it from opset 24 on)
BF16_OPSET = {"gpt_oss": 24, "deepseek_v3": 24}
#: The logits' element type per dtype.
CAUSAL_OUT = {
    "float32": onnx.TensorProto.FLOAT,
    "float16": onnx.TensorProto.FLOAT16,
    "bfloat16": onnx.TensorProto.BFLOAT16,
}
CAUSAL_MAX_BYTES = 2 << 20
CAUSAL_MAX_TOTAL_BYTES = 64 << 20
#: What each family's router is, from transformers' modeling code (stated here independently of
#: the records, which the export script writes). In float32: softmax top-k and top-k softmax
#: fuse into MoE per layer with their normalisation pinned; the other top-k routers (sigmoid
#: scores, a selection-only correction bias, group-limited top-k, scaling factors, clamped
#: renormalisation) are a top-k selection with per-selected non-negative weights, which MoE
#: carries exactly, so they fuse with only the op and k pinned; the rest must be refused naming
#: the router.
ROUTER_FORMS = {
    "mixtral": "softmax_topk",
    "qwen3_moe": "softmax_topk",
    "qwen2_moe": "softmax_topk",
    "olmoe": "softmax_topk",
    "qwen3_next": "softmax_topk",
    "gpt_oss": "topk_softmax",
    "granitemoe": "topk_softmax",
    "phimoe": "sparsemixer",
    "deepseek_v3": "sigmoid_bias_group_topk",
    "glm4_moe": "sigmoid_bias_group_topk",
    "dots1": "sigmoid_bias_group_topk",
    "exaone_moe": "sigmoid_bias_group_topk",
    "minimax_m2": "sigmoid_bias_topk",
    "afmoe": "sigmoid_bias_topk",
    "lfm2_moe": "sigmoid_bias_topk",
    "ernie4_5_moe": "softmax_bias_topk",
    "deepseek_v2": "softmax_group_topk",
    "deepseek_v2_greedy": "softmax_topk_scaled",
    "llama4": "sigmoid_topk_dense",
    "jetmoe": "topk_softmax",
}
#: Families whose float16 export cannot run in ORT CPU (recorded as a failed export):
#: JetMoE's index_add exports to ScatterND(reduction="add"), which ORT 1.32 CPU has no float16
#: kernel for.
FLOAT16_FAILS_IN_ORT = {"jetmoe": "MLFloat16 data type is not supported with ScatterND"}
NORMALISED_ROUTERS = {"softmax_topk", "topk_softmax"}
#: routers whose top-1 score scales the expert input (Llama4): fused at k = 1
INPUT_SCALED_ROUTERS = {"sigmoid_topk_dense"}
TOPK_ROUTERS = {
    "sparsemixer",  # PhiMoE: two top-1 rounds are the columns of one TopK
    "sigmoid_bias_group_topk",
    "sigmoid_bias_topk",
    "softmax_bias_topk",
    "softmax_group_topk",
    "softmax_topk_scaled",
}


def config_top_k(config: dict) -> int:
    """The record's top-k (``to_diff_dict`` keeps the family's own name: ERNIE's ``moe_k``)."""
    return config.get("num_experts_per_tok", config.get("moe_k", 2))


@functools.cache
@functools.cache
def _upcast():
    """``sample_models/upcast.py``'s ``upcast_to_float32`` (torch-free; loaded by path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("upcast", REPO / "sample_models" / "upcast.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.upcast_to_float32


def causal_session(name: str) -> ort.InferenceSession:
    """ORT CPU on the export; on its float32 twin for bfloat16 (ORT CPU has no bfloat16 Mul)."""
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    path = CAUSAL / f"{name}.onnx"
    source: str | bytes = str(path)
    if CAUSAL_RECORDS[name]["dtype"] == "bfloat16":
        source = _upcast()(onnx.load(str(path))).SerializeToString()
    return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])


def causal_reference(name: str) -> tuple[np.ndarray, np.ndarray]:
    with np.load(CAUSAL / f"{name}.npz") as data:
        return data["input_ids"], data["logits"]


def test_causal_index_lists_every_file() -> None:
    files = sorted(p.name for p in CAUSAL.iterdir())
    want = sorted(
        ["index.json"] + [f"{n}{s}" for n in CAUSAL_NAMES for s in (".onnx", ".npz", ".json")]
    )
    assert files == want
    assert len(set(CAUSAL_NAMES)) == len(CAUSAL_NAMES)
    failed = CAUSAL_INDEX["failed_exports"]
    assert not {f["name"] for f in failed} & set(CAUSAL_NAMES)
    for f in failed:
        assert f["error"].strip(), f["name"]
    for entry in CAUSAL_INDEX["models"]:
        rec = CAUSAL_RECORDS[entry["name"]]
        assert {k: rec[k] for k in entry} == entry
    # The top-level index points at this one.
    assert INDEX["causal_lm"]["index"] == "causal_lm/index.json"


def test_causal_set_is_small() -> None:
    sizes = {p.name: p.stat().st_size for p in CAUSAL.iterdir()}
    assert max(sizes.values()) <= CAUSAL_MAX_BYTES
    assert sum(sizes.values()) <= CAUSAL_MAX_TOTAL_BYTES


def test_causal_covers_the_families() -> None:
    """Every family is exported or its failures are recorded, each in float32 and float16.

    The half-precision opset-18 families in bfloat16 too.
    """
    families = {CAUSAL_RECORDS[n]["family"] for n in CAUSAL_NAMES}
    failed_families = {f["family"] for f in CAUSAL_INDEX["failed_exports"]}
    assert families | failed_families == set(ROUTER_FORMS)
    for family in families:
        dtypes = {
            CAUSAL_RECORDS[n]["dtype"]
            for n in CAUSAL_NAMES
            if CAUSAL_RECORDS[n]["family"] == family
        }
        want = {"float32", "float16"} | ({"bfloat16"} if family in HALF_OPSET18 else set())
        if family in FLOAT16_FAILS_IN_ORT:  # recorded as failed, with ORT's reason
            failed = [
                f for f in CAUSAL_INDEX["failed_exports"]
                if f["family"] == family and f["dtype"] == "float16"
            ]  # fmt: skip
            assert failed and all(FLOAT16_FAILS_IN_ORT[family] in f["error"] for f in failed)
            want = want - {"float16"}
        assert dtypes == want, family
    for family in HALF_OPSET18:
        half = CAUSAL_RECORDS[f"{family}_batched_mm_dynamic_op18_fp16"]
        assert (half["dtype"], half["opset"]) == ("float16", 18)
        opset = BF16_OPSET.get(family, 18)
        bf16 = CAUSAL_RECORDS[f"{family}_batched_mm_dynamic_op{opset}_bf16"]
        assert (bf16["dtype"], bf16["opset"]) == ("bfloat16", opset)


@pytest.mark.parametrize("name", CAUSAL_NAMES)
def test_causal_file_valid_and_shaped_as_recorded(name: str) -> None:
    rec = CAUSAL_RECORDS[name]
    model = onnx.load(str(CAUSAL / f"{name}.onnx"), load_external_data=False)
    for init in model.graph.initializer:
        assert init.data_location != onnx.TensorProto.EXTERNAL, init.name
    onnx.checker.check_model(model)
    assert rec["file_bytes"] == (CAUSAL / rec["file"]).stat().st_size
    assert rec["op_histogram"] == dict(Counter(n.op_type for n in model.graph.node))
    assert rec["node_count"] == len(model.graph.node)
    assert rec["opset_import"].get("ai.onnx") == rec["opset"]
    assert rec["versions"]["torch"].startswith("2.13.")
    (inp,) = model.graph.input
    (out,) = model.graph.output
    assert (inp.name, out.name) == ("input_ids", "logits")
    assert inp.type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert out.type.tensor_type.elem_type == CAUSAL_OUT[rec["dtype"]]
    dims = [d.dim_param or d.dim_value for d in inp.type.tensor_type.shape.dim]
    if rec["dynamic_shapes"]:
        assert all(isinstance(d, str) for d in dims), dims
    else:
        assert dims == [2, 8]


@pytest.mark.parametrize("name", CAUSAL_NAMES)
def test_causal_matches_pytorch_logits(name: str) -> None:
    rec = CAUSAL_RECORDS[name]
    ids, want = causal_reference(name)
    assert ids.shape == (2, 8) and ids.dtype == np.int64
    # bfloat16 logits are stored widened to float32 (numpy has no bfloat16 of its own)
    assert want.dtype == np.dtype(rec["dtype"] if rec["dtype"] != "bfloat16" else "float32")
    (got,) = causal_session(name).run(None, {"input_ids": ids})
    assert got.shape == want.shape == (2, 8, rec["config"].get("vocab_size", 128))
    err = rel_err(got.astype(np.float32), want.astype(np.float32))
    tol = CAUSAL_RTOL[rec["dtype"]]
    assert rec["reference"]["rtol"] <= tol
    assert err <= tol, f"{name}: ORT vs PyTorch logits max relative error {err:.3g}"


@pytest.mark.parametrize("name", CAUSAL_DYNAMIC)
def test_causal_dynamic_prefix_and_row_give_reference_logits(name: str) -> None:
    """A causal LM's logits on a prefix, or on one batch row, are those rows of the reference.

    Checks the dynamic batch and sequence without torch: one token, an odd prefix, one row.
    """
    rec = CAUSAL_RECORDS[name]
    ids, want = causal_reference(name)
    tol = CAUSAL_RTOL[rec["dtype"]]
    for sl in (np.s_[0:1, 0:1], np.s_[0:2, 0:5], np.s_[1:2, :]):
        (got,) = causal_session(name).run(None, {"input_ids": np.ascontiguousarray(ids[sl])})
        assert got.shape == want[sl].shape
        err = rel_err(got.astype(np.float32), want[sl].astype(np.float32))
        assert err <= tol, f"{name} on {ids[sl].shape}: max relative error {err:.3g}"


@pytest.mark.parametrize("name", CAUSAL_NAMES)
def test_causal_expected_follows_the_router(name: str) -> None:
    """``expected``: MoE per top-k layer; else refused, naming the router or the target.

    The target: bfloat16 on the default target ort-cpu, which has no bfloat16 MoE kernel.
    """
    rec = CAUSAL_RECORDS[name]
    form = ROUTER_FORMS[rec["family"]]
    assert rec["router"]["form"] == form
    layers = rec["expected_layers"]
    assert [e["layer"] for e in layers] == list(range(rec["config"].get("num_hidden_layers", 2)))
    moe_layers = [e for e in layers if e["outcome"] != "no MoE"]
    assert moe_layers, "a MoE model without a MoE layer"
    half = rec["dtype"] != "float32"
    fusable = 0
    for e in moe_layers:
        fusable += form in NORMALISED_ROUTERS | TOPK_ROUTERS | INPUT_SCALED_ROUTERS
        if rec["dtype"] == "bfloat16" and form in NORMALISED_ROUTERS | TOPK_ROUTERS:
            assert (e["outcome"], e["refusal_names"]) == ("refused", "target")
        elif form in NORMALISED_ROUTERS:
            assert e["outcome"] == "MoE"
            attrs = e["attributes"]
            # a half-precision layer is fed as its selection and weights: the construction
            # chooses the normalisation
            if half:
                assert "normalize_routing_weights" not in attrs
            else:
                assert attrs["normalize_routing_weights"] == int(rec["router"]["renormalised"])
            assert attrs["k"] == config_top_k(rec["config"])
            assert attrs["activation_type"] == "swiglu" and attrs["swiglu_fusion"] == 1
        elif form in TOPK_ROUTERS:
            # the construction chooses normalisation and the rest: only the op and k are pinned
            assert e["outcome"] == "MoE"
            assert e["attributes"] == {"k": config_top_k(rec["config"])}
        elif form in INPUT_SCALED_ROUTERS:
            # Llama4 top-1: the experts read the tokens scaled by their score, weight 1
            assert config_top_k(rec["config"]) == 1
            assert e["outcome"] == "MoE" and e["attributes"]["k"] == 1
        else:
            assert (e["outcome"], e["refusal_names"]) == ("refused", "router")
    fused = sum(e["outcome"] == "MoE" for e in layers)
    assert rec["expected"] == ([["MoE", fused]] if fused else [])
    if half:  # ORT CUDA has float16 and bfloat16 MoE kernels: every fusable layer fuses there
        assert rec["expected_ort_cuda"] == ([["MoE", fusable]] if fusable else [])
