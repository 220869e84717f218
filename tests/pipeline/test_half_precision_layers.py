"""Small float16 / bfloat16 layers: the fused node's dtype, routing ties, the casts it looks through.

Built from the hand-written ReLU layer ``reciprocal_renorm`` (``onnx_moe_fuse.samples``), turned
into what a half-precision export writes: weights, tokens and output in float16 (or bfloat16),
the router softmax computed in float32 (``Cast`` of the logits up, torch's ``.float()``), and
the float32 routing weights either cast down to the experts' type before the combine (Qwen3's
spelling) or multiplied into FC2's output cast up to float32, summed in float32 and cast back
(Mixtral's). Each is fused and run in ORT CPU against the original on fresh inputs.

Ties: three experts get the same router column, so their float16 logits are equal on every
token, and the top-k takes two of three tied experts on most rows. ONNX TopK keeps the lowest
indices, ORT's own MoE routing the highest: a fused node left to route by itself would use
other experts. The half-precision layer is fed its own TopK selection, so the fused model
matches the original on every row (and a float32 twin of the layer, where ties are as rare as
random inputs make them, keeps ORT's own softmax routing).

Twins: every hand-written layer that fuses (``onnx_moe_fuse.samples.handwritten``: MoE and
QMoE, dense and sparse forms, every router family), retyped wholesale to float16 (scales too)
or bfloat16 (``sample_models/upcast.retype_floats``): float16 fuses into the same op on ORT CPU
(QMoE also for ort-webgpu where it is swiglu) and matches the original on a decode step and a
prefill; bfloat16 is refused on ort-cpu and fuses for ort-cuda, its float32 twin matching.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_moe_fuse import fuse
from onnx_moe_fuse.samples.handwritten_sparse import reciprocal_renorm
from onnx_moe_fuse.verify.checker import verify
from onnx_moe_fuse.verify.ort_nodes import session

HALF = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
TIED = (0, 1, 2)  # experts whose router columns are equal (E = 6, k = 3)


def _half_layer(dtype: str, combine: str, tie: bool = True) -> onnx.ModelProto:
    """``reciprocal_renorm`` as a ``dtype`` export: router in float32, combine ``combine``.

    ``combine``: ``"cast_weights"`` (the float32 weights cast to ``dtype``, Qwen3's export) or
    ``"sum_float32"`` (FC2's output cast up, weighted and summed in float32, cast back:
    Mixtral's).
    """
    model = reciprocal_renorm().model
    g = model.graph
    elem = HALF[dtype]
    inits = []
    for t in g.initializer:
        if t.data_type == TensorProto.FLOAT:
            array = numpy_helper.to_array(t)
            if t.name == "router" and tie:
                array = array.copy()
                array[:, list(TIED)] = array[:, [TIED[0]]]
            t = helper.make_tensor(t.name, elem, array.shape, array.flatten().tolist())
        inits.append(t)
    del g.initializer[:]
    g.initializer.extend(inits)
    for v in (*g.input, *g.output):
        v.type.tensor_type.elem_type = elem
    nodes = list(g.node)
    by_out = {o: n for n in nodes for o in n.output}
    by_out["probs"].input[0] = "logits_f32"  # the router's softmax in float32
    new = [helper.make_node("Cast", ["logits"], ["logits_f32"], to=TensorProto.FLOAT)]
    if combine == "cast_weights":
        by_out["weights_3d"].input[0] = "top_w_half"
        new.append(helper.make_node("Cast", ["top_w"], ["top_w_half"], to=elem))
    else:
        by_out["weighted"].input[0] = "fc2_out_f32"
        by_out["y"].output[0] = "y_f32"
        new.append(helper.make_node("Cast", ["fc2_out"], ["fc2_out_f32"], to=TensorProto.FLOAT))
        new.append(helper.make_node("Cast", ["y_f32"], ["y"], to=elem))
    del g.node[:]
    for n in nodes:  # each new Cast right after the node its input comes from
        g.node.append(n)
        for c in new:
            if c.input[0] in n.output:
                g.node.append(c)
    onnx.checker.check_model(model, full_check=True)
    # value types declared, as exporters write them (the casts are looked through where the
    # graph says what they cast from)
    return onnx.shape_inference.infer_shapes(model, strict_mode=True)


def _inputs(model: onnx.ModelProto, seed: int, tokens: int = 9) -> dict[str, np.ndarray]:
    elem = model.graph.input[0].type.tensor_type.elem_type
    dtype = helper.tensor_dtype_to_np_dtype(elem)
    x = np.random.default_rng(seed).standard_normal((tokens, 32)).astype(dtype)
    return {"x": x}


def _rel_err(original: onnx.ModelProto, fused: onnx.ModelProto, seed: int) -> float:
    feeds = _inputs(original, seed)
    (want,) = session(original).run(None, feeds)
    (got,) = session(fused).run(None, feeds)
    want, got = want.astype(np.float64), got.astype(np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("combine", ["cast_weights", "sum_float32"])
def test_float16_layer_with_float32_router_fuses_in_float16(combine: str) -> None:
    original = _half_layer("float16", combine)
    result = fuse(original)
    (fusion,) = result.report.fusions
    assert fusion["op"] == "MoE" and fusion["dtype"] == "float16"
    assert fusion["routing"]["construction"] == "logits"  # fed its own selection and weights
    assert "float16" in fusion["routing"]["why"]
    (node,) = [n for n in result.model.graph.node if n.op_type == "MoE"]
    inferred = onnx.shape_inference.infer_shapes(result.model, strict_mode=True)
    types = {v.name: v.type.tensor_type.elem_type for v in inferred.graph.value_info}
    types.update((v.name, v.type.tensor_type.elem_type) for v in inferred.graph.input)
    assert types[node.input[0]] == types[node.input[1]] == TensorProto.FLOAT16
    for seed in (1, 2):
        err = _rel_err(original, result.model, seed)
        assert err <= 5e-3, f"{combine}: rel err {err:.2e}"


@pytest.mark.parametrize("combine", ["cast_weights", "sum_float32"])
def test_tied_float16_logits_select_the_models_experts(combine: str) -> None:
    """Rows whose top-k cuts through tied experts: ORT's own routing would pick others."""
    original = _half_layer("float16", combine, tie=True)
    feeds = _inputs(original, 3)
    x = feeds["x"].astype(np.float64)
    router = numpy_helper.to_array(
        next(t for t in original.graph.initializer if t.name == "router")
    ).astype(np.float64)
    logits = (x @ router).astype(np.float16)
    cut = [np.sort(row)[::-1][2] == row[TIED[0]] for row in logits]  # the 3rd place is tied
    assert sum(cut) >= 3  # the test means something: most rows split the tied group
    fused = fuse(original).model
    for seed in (3, 4, 5):
        err = _rel_err(original, fused, seed)
        assert err <= 5e-3, f"{combine}: rel err {err:.2e} (other experts selected?)"


def test_float16_layer_passes_verify() -> None:
    original = _half_layer("float16", "sum_float32")
    report = verify(original, fuse(original).model, seeds=(0, 1))
    assert report.passed, report.summary()
    assert report.paths["wgpu"].status == "passed" and report.paths["ort"].status == "passed"


def test_bfloat16_layer_refused_on_ort_cpu_fused_for_cuda() -> None:
    original = _half_layer("bfloat16", "cast_weights")
    cpu = fuse(original)
    assert cpu.report.fusions == []
    (miss,) = [m for m in cpu.report.near_misses if m["part"] == "target"]
    assert "ort-cpu has no bfloat16 MoE kernel" in miss["reason"] and "ort-cuda" in miss["reason"]
    assert cpu.model.SerializeToString() == original.SerializeToString()
    cuda = fuse(original, target="ort-cuda")
    (fusion,) = cuda.report.fusions
    assert fusion["op"] == "MoE"
    report = verify(original, cuda.model, seeds=(0,))
    assert report.passed, report.summary()  # WebGPU path (float32 compute, bfloat16 I/O)


def test_float32_layer_keeps_its_own_softmax_routing() -> None:
    """The same layer in float32 (no casts): ORT's softmax routing as before, no construction."""
    result = fuse(reciprocal_renorm().model)
    (fusion,) = result.report.fusions
    assert fusion.get("routing") is None and fusion["dtype"] == "float32"


# -- every hand-written layer that fuses, as its float16 and bfloat16 twins ---------------------


def _retype():
    """``sample_models/upcast.py``'s ``retype_floats`` (torch-free; loaded by path)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "sample_models" / "upcast.py"
    spec = importlib.util.spec_from_file_location("upcast", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.retype_floats


def _fusing_layers() -> list[str]:
    from onnx_moe_fuse.samples.handwritten import HANDWRITTEN
    from onnx_moe_fuse.samples.handwritten_graph import Fused

    return [n for n, build in HANDWRITTEN.items() if isinstance(build().expected, Fused)]


def _twin(name: str, elem: int) -> tuple[onnx.ModelProto, str]:
    """The hand-written layer ``name`` with every float32 tensor and value made ``elem``."""
    from onnx_moe_fuse.samples.handwritten import HANDWRITTEN

    layer = HANDWRITTEN[name]()
    return _retype()(layer.model, TensorProto.FLOAT, elem), layer.expected.op


def _feeds(model: onnx.ModelProto, tokens: int, seed: int) -> dict[str, np.ndarray]:
    out = {}
    for v in model.graph.input:
        t = v.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else tokens for d in t.shape.dim]
        dtype = helper.tensor_dtype_to_np_dtype(t.elem_type)
        out[v.name] = np.random.default_rng(seed).standard_normal(dims).astype(dtype)
    return out


def _max_rel(a: onnx.ModelProto, b: onnx.ModelProto, tokens: int, seed: int) -> float:
    feeds = _feeds(a, tokens, seed)
    (want,) = session(a).run(None, feeds)
    (got,) = session(b).run(None, feeds)
    want, got = want.astype(np.float64), got.astype(np.float64)
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("name", _fusing_layers())
def test_float16_twin_of_every_fusing_layer_fuses_and_matches(name: str) -> None:
    """MoE and QMoE (float16 scales) in float16 on ORT CPU; QMoE for ort-webgpu too."""
    model, op = _twin(name, TensorProto.FLOAT16)
    result = fuse(model)
    assert [f["op"] for f in result.report.fusions] == [op], result.report.near_misses
    dims = model.graph.input[0].type.tensor_type.shape.dim
    static = all(d.HasField("dim_value") for d in dims)
    for tokens, seed in ((7, 1),) if static else ((1, 0), (7, 1)):  # decode step and prefill
        err = _max_rel(model, result.model, tokens, seed)
        assert err <= 5e-3, f"{name} on {tokens} tokens: rel err {err:.2e}"
    if op == "QMoE":  # onnxruntime-webgpu's QMoE: float16 too, swiglu only
        webgpu = fuse(model, target="ort-webgpu")
        swiglu = result.report.fusions[0]["attributes"]["activation_type"] == "swiglu"
        assert [f["op"] for f in webgpu.report.fusions] == ([op] if swiglu else [])


@pytest.mark.parametrize("name", _fusing_layers())
def test_bfloat16_twin_fuses_for_cuda_only(name: str) -> None:
    """ort-cpu refuses bfloat16 (no kernel); ort-cuda fuses it.

    MoE, and QMoE (which CUDA registers for float16/bfloat16 only); the fused model's float32
    twin matches the layer's.
    """
    model, op = _twin(name, TensorProto.BFLOAT16)
    cpu = fuse(model)
    assert cpu.report.fusions == []
    assert any("bfloat16" in m["reason"] and m["part"] == "target" for m in cpu.report.near_misses)
    cuda = fuse(model, target="ort-cuda")
    assert [f["op"] for f in cuda.report.fusions] == [op], cuda.report.near_misses
    up = _retype()
    wide = (
        up(model, TensorProto.BFLOAT16, TensorProto.FLOAT),
        up(cuda.model, TensorProto.BFLOAT16, TensorProto.FLOAT),
    )
    err = _max_rel(*wide, 7, 2)
    assert err <= 1e-2, f"{name}: float32 twins rel err {err:.2e}"


def test_float32_weights_cast_down_to_a_float16_layer_fuse() -> None:
    """A mixed-precision export keeps float32 weights and casts them to the layer's float16.

    The cast folds on the constants (to exactly what ORT's Cast computes), and the layer fuses
    into a float16 MoE with those float16 weights.
    """
    model = _half_layer("float16", "cast_weights", tie=False)
    g = model.graph
    casts = []
    for t in list(g.initializer):
        if t.name in ("w1", "w2"):
            wide = numpy_helper.to_array(t).astype(np.float32)
            g.initializer.remove(t)
            g.initializer.append(numpy_helper.from_array(wide, f"{t.name}_f32"))
            cast = helper.make_node("Cast", [f"{t.name}_f32"], [t.name], to=TensorProto.FLOAT16)
            casts.append(cast)
    for c in reversed(casts):
        g.node.insert(0, c)
    onnx.checker.check_model(model, full_check=True)
    result = fuse(model)
    assert [f["op"] for f in result.report.fusions] == ["MoE"], result.report.near_misses
    for seed in (1, 2):
        assert _rel_err(model, result.model, seed) <= 5e-3


def test_float32_combine_sum_undeclared_still_gets_its_type_back() -> None:
    """The float32 sum's type comes from the combine's widening Cast, declared or not.

    The fused float16 output is cast up before the model's own cast back down.
    """
    model = _half_layer("float16", "sum_float32", tie=False)
    g = model.graph
    # a float32 consumer of the sum (a residual in float32) before the cast back
    (back,) = [n for n in g.node if n.output[0] == "y"]
    back.input[0] = "y_res"
    g.node.insert(list(g.node).index(back), helper.make_node("Add", ["y_f32", "res"], ["y_res"]))
    g.initializer.append(numpy_helper.from_array(np.full((32,), 0.5, np.float32), "res"))
    kept = [v for v in g.value_info if v.name != "y_f32"]
    del g.value_info[:]
    g.value_info.extend(kept)
    onnx.checker.check_model(model, full_check=True)
    result = fuse(model)
    (fusion,) = result.report.fusions
    assert fusion["dtype"] == "float16"
    onnx.checker.check_model(result.model, full_check=True)  # types agree everywhere
    casts = [n for n in result.model.graph.node if n.op_type == "Cast"]
    assert any(helper.get_attribute_value(c.attribute[0]) == TensorProto.FLOAT for c in casts)
    assert _rel_err(model, result.model, 4) <= 5e-3


def test_float32_layer_with_a_float16_router_is_fed_its_selection() -> None:
    """A float32 layer whose router runs in float16 (logits cast up): its ties are float16's.

    Three tied router columns again: the node is fed the model's own selection (the logits
    construction), and the fused model matches the original on every row.
    """
    model = reciprocal_renorm().model
    g = model.graph
    for t in list(g.initializer):
        if t.name == "router":
            array = numpy_helper.to_array(t).copy()
            array[:, list(TIED)] = array[:, [TIED[0]]]
            g.initializer.remove(t)
            g.initializer.append(numpy_helper.from_array(array.astype(np.float16), "router"))
    (mm,) = [n for n in g.node if n.output[0] == "logits"]
    mm.input[0], mm.output[0] = "x16", "logits16"
    at = list(g.node).index(mm)
    g.node.insert(at, helper.make_node("Cast", ["x"], ["x16"], to=TensorProto.FLOAT16))
    g.node.insert(at + 2, helper.make_node("Cast", ["logits16"], ["logits"], to=TensorProto.FLOAT))
    onnx.checker.check_model(model, full_check=True)
    model = onnx.shape_inference.infer_shapes(model, strict_mode=True)
    result = fuse(model)
    (fusion,) = result.report.fusions
    assert fusion["dtype"] == "float32" and fusion["routing"]["construction"] == "logits"
    for seed in (3, 4):
        assert _rel_err(model, result.model, seed) <= 1e-5


OPTIMUM = ("qwen3_moe_optimum", "qwen3_moe_optimum_dynamo", "qwen3_moe_optimum_no_norm")


@pytest.mark.parametrize("name", OPTIMUM)
def test_float16_twin_of_optimums_expert_loop_fuses(name: str) -> None:
    """optimum-onnx's loop over all experts (``sample_models/exported/optimum``) in float16.

    The expert-loop pass takes the float16 loop; the layer fuses into a float16 MoE and
    ``--verify``'s check passes (ORT CPU cannot run the float16 original of the dynamo export:
    no float16 ScatterND with reduction 'add', so the reference path is the judge there).
    """
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "sample_models" / "exported" / "optimum"
    model = _retype()(onnx.load(path / f"{name}.onnx"), TensorProto.FLOAT, TensorProto.FLOAT16)
    result = fuse(model)
    assert [(f["op"], f["dtype"]) for f in result.report.fusions] == [("MoE", "float16")]
    report = verify(model, result.model, seeds=(0, 1))
    assert report.passed, report.summary()
    assert report.paths["wgpu"].status == report.paths["ort"].status == "passed"
