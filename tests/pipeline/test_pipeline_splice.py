"""The pipeline fuses on a canonicalised working copy and splices into the original model.

What these pin: the original is only changed inside a fused layer's region (every other node,
name and initializer stays byte-identical); the router must read the experts' token rows; the
splice refuses a region whose inputs the fused node does not take; a canonicalisation pass that
fails is skipped and reported, never raised.
"""

from __future__ import annotations

import onnx
import onnx.parser
import onnx_ir as ir
import pytest
from helpers import env_seed, nonzero_rel_err
from onnx import helper

from onnx_moe_fuse import fuse
from onnx_moe_fuse.pipeline.splice import (
    origin_tail,
    splice_fused_node,
    tag_origin,
)
from onnx_moe_fuse.rewrites.graph.refusals import Refusal
from onnx_moe_fuse.samples import get_sample
from onnx_moe_fuse.verify.ort_nodes import session
from onnx_moe_fuse.verify.reference import random_feeds, run_reference

SAMPLE = "mixtral_dec_f32"


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    return m


def _node(model: onnx.ModelProto, output: str) -> onnx.NodeProto:
    return next(n for n in model.graph.node if output in n.output)


def _refused(model: onnx.ModelProto, part: str, *words: str) -> dict:
    result = fuse(model)
    assert not result.report.fusions
    assert result.model.SerializeToString() == model.SerializeToString()
    misses = [m for m in result.report.near_misses if m["part"] == part]
    assert misses, result.report.near_misses
    assert any(all(w in m["reason"] for w in words) for m in misses), misses
    return misses[0]


def test_router_over_a_second_input_is_refused() -> None:
    """Same shape, other rows: the fused node would route token i by another tensor's row i."""
    m = _copy(get_sample(SAMPLE).model)
    x = m.graph.input[0]
    other = onnx.ValueInfoProto()
    other.CopyFrom(x)
    other.name = "x_router"
    m.graph.input.append(other)
    _node(m, "router_logits").input[0] = "x_router"
    miss = _refused(m, "routing", "router", "x_router", "token rows")
    assert miss["node"]


def test_router_over_a_slice_of_the_tokens_is_refused() -> None:
    m = _copy(get_sample(SAMPLE).model)
    router = _node(m, "router_logits")
    router.input[0] = "x_head"
    m.graph.initializer.extend(
        [
            helper.make_tensor("head_starts", onnx.TensorProto.INT64, [1], [0]),
            helper.make_tensor("head_ends", onnx.TensorProto.INT64, [1], [1]),
        ]
    )
    m.graph.node.insert(0, helper.make_node("Slice", ["x", "head_starts", "head_ends"], ["x_head"]))
    _refused(m, "routing", "x_head")


def test_router_through_a_row_preserving_reshape_fuses() -> None:
    """Tokens reshaped to rows and back (same last axis) are still the same rows."""
    m = _copy(get_sample(SAMPLE).model)
    _node(m, "router_logits").input[0] = "x_rows"
    m.graph.initializer.append(
        helper.make_tensor("rows_shape", onnx.TensorProto.INT64, [2], [-1, 64])
    )
    m.graph.node.insert(0, helper.make_node("Reshape", ["x", "rows_shape"], ["x_rows"]))
    result = fuse(m)
    assert [f["op"] for f in result.report.fusions] == ["MoE"], result.report.near_misses


def test_unfused_layer_and_everything_outside_stay_byte_identical() -> None:
    """Two layers in one graph, one fuses: the other layer's nodes are exactly as they were."""
    a, b = _copy(get_sample(SAMPLE).model), _copy(get_sample("nearmiss_erf_gelu_dec_f32").model)
    for m in (a, b):
        del m.metadata_props[:]
    merged = onnx.compose.merge_models(
        onnx.compose.add_prefix(a, "a_"), onnx.compose.add_prefix(b, "b_"), io_map=[]
    )
    result = fuse(merged)
    assert len(result.report.fusions) == 1
    kept = [
        n
        for n in result.model.graph.node
        if n.name.startswith("b_") or any(o.startswith("b_") for o in n.output)
    ]
    # serialising through onnx-ir drops explicitly-set empty strings (merge_models writes
    # name "" on every node), so compare with the original as onnx-ir writes it
    normal = ir.serde.serialize_model(ir.serde.deserialize_model(merged))
    want = [n for n in normal.graph.node if any(o.startswith("b_") for o in n.output)]
    assert [n.SerializeToString() for n in kept] == [n.SerializeToString() for n in want]
    b_inits = {
        i.name: i.SerializeToString() for i in merged.graph.initializer if i.name.startswith("b_")
    }
    got = {
        i.name: i.SerializeToString()
        for i in result.model.graph.initializer
        if i.name.startswith("b_")
    }
    assert got == b_inits


def test_splice_refuses_a_region_that_reads_a_graph_input() -> None:
    """A fused node that does not take an input the layer reads is never spliced."""
    model = ir.serde.deserialize_model(get_sample(SAMPLE).model)
    work = model.clone()
    tag_origin(work.graph)
    # a fake fused node that reads only the router logits: the region then reaches 'x'
    logits = next(v for n in work.graph for v in n.outputs if v.name == "router_logits")
    fake = ir.Node("com.microsoft", "MoE", [logits], num_outputs=1, name="fake")
    work.graph.append(fake)
    before = ir.serde.serialize_model(model).SerializeToString()
    with pytest.raises(Refusal, match="graph input") as info:
        splice_fused_node(model, fake, "y")
    assert info.value.part == "region" and info.value.value.name == "x"
    assert ir.serde.serialize_model(model).SerializeToString() == before


def test_a_failing_canonicalisation_pass_is_skipped_and_reported(monkeypatch) -> None:
    class Broken(ir.passes.InPlacePass):
        def call(self, model):  # noqa: D102
            next(iter(model.graph)).op_type = "Broken"  # half a rewrite, then a crash
            raise RuntimeError("boom")

    import onnx_moe_fuse.pipeline.canonicalise as canon

    monkeypatch.setattr(canon, "canonicalisation_passes", lambda refusals=None: [Broken()])
    s = get_sample(SAMPLE)
    result = fuse(s.model)
    assert [f["op"] for f in result.report.fusions] == ["MoE"]
    assert any("Broken" in line and "boom" in line for line in result.report.canonicalisation)


def test_recorded_refusals_are_those_of_the_last_canonicalisation_run(monkeypatch) -> None:
    """A pass that fails makes the sequence re-run on a fresh copy: earlier records are dropped."""

    class Records(ir.passes.InPlacePass):
        def __init__(self, refusals) -> None:
            super().__init__()
            self.refusals = refusals

        def call(self, model):  # noqa: D102
            topk = next(n for n in model.graph if n.op_type == "TopK")
            self.refusals.append(Refusal("left as it was").recorded_by("expert-loop", topk))
            return ir.passes.PassResult(model, modified=False)

    class Broken(ir.passes.InPlacePass):
        def call(self, model):  # noqa: D102
            raise RuntimeError("boom")

    import onnx_moe_fuse.pipeline.canonicalise as canon

    monkeypatch.setattr(
        canon, "canonicalisation_passes", lambda refusals=None: [Records(refusals), Broken()]
    )
    work = ir.serde.deserialize_model(get_sample(SAMPLE).model)
    refusals: list[Refusal] = []
    assert len(canon.canonicalise(work, refusals)) == 1
    [refusal] = refusals  # the first run's record named a node of the graph it dropped
    assert refusal.topk.graph is work.graph and refusal.stage == "expert-loop"


def test_fused_model_keeps_every_node_outside_the_region() -> None:
    """Nodes downstream of the layer output read the fused node; results match the original."""
    s = get_sample(SAMPLE)
    m = _copy(s.model)
    out = m.graph.output[0].name
    m.graph.node.append(helper.make_node("Relu", [out], ["after"], name="after_layer"))
    m.graph.output.append(helper.make_tensor_value_info("after", onnx.TensorProto.FLOAT, None))
    result = fuse(m)
    assert len(result.report.fusions) == 1
    assert _node(result.model, "after").name == "after_layer"
    feeds = random_feeds(s.model, env_seed(), s.dim_values)
    ref = run_reference(m, feeds)
    got = dict(
        zip([o.name for o in m.graph.output], session(result.model).run(None, feeds), strict=True)
    )
    for name, want in ref.items():
        assert nonzero_rel_err(got[name], want) <= 1e-5


def _toy_layer() -> tuple[ir.Model, ir.Model, ir.Node]:
    """A toy layer, its tagged working copy, and a fake fused node for the copy.

    ``y = Reshape(Relu(t), Shape(Relu(t)))``, the Shape also a graph output; the fake node reads
    only ``t`` and is not in the copy's graph yet.
    """
    proto = onnx.parser.parse_model("""<ir_version: 10, opset_import: ["" : 18]>
    g (float[T, 4] t) => (float[T, 4] y, int64[2] sh) {
      h = Relu(t)
      sh = Shape(h)
      y = Reshape(h, sh)
    }""")
    model = ir.serde.deserialize_model(proto)
    work = model.clone()
    tag_origin(work.graph)
    fake = ir.Node("com.microsoft", "MoE", [work.graph.inputs[0]], num_outputs=1, name="fake")
    return model, work, fake


def test_splice_refuses_a_kept_shape_of_a_replaced_value() -> None:
    """A Shape that must stay (its output escapes) but reads a removed value: refused, unchanged."""
    model, work, fake = _toy_layer()
    work.graph.append(fake)
    before = ir.serde.serialize_model(model).SerializeToString()
    with pytest.raises(Refusal, match="reads 'h', which the fused node replaces"):
        splice_fused_node(model, fake, "y")
    assert ir.serde.serialize_model(model).SerializeToString() == before


def test_origin_tail_follows_a_layout_chain_to_an_original_value() -> None:
    model, work, fake = _toy_layer()
    shape = ir.node(
        "Constant", [], attributes={"value": ir.tensor([-1, 4], dtype=ir.DataType.INT64)}
    )
    tail = ir.node("Reshape", [fake.outputs[0], shape.outputs[0]])
    tail.outputs[0].name = "y"  # the value stands for the original's 'y'
    work.graph.extend([fake, shape, tail])
    assert origin_tail(fake, "fused_out", model.graph) == (tail, "y")
    # the proved output has a counterpart itself: no tail
    assert origin_tail(fake, "h", model.graph) == (fake, "h")
    other = ir.node("Relu", [fake.outputs[0]])  # a second reader: no tail
    work.graph.append(other)
    assert origin_tail(fake, "fused_out", model.graph) == (fake, "fused_out")
