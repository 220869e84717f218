"""A whole MoE layer in other spellings fuses once its spellings are normalised.

The catalogue's ``qwen3_dec_f32`` layer (Gather + MatMul experts, SwiGLU, ReduceSum combine) is
rewritten in spellings the layer rules do not know: (1) four ``Einsum``s (router, FC1 gate,
FC2, combine); (2) a ``Gemm`` router, ``Swish`` gate, ``Reciprocal`` renormalisation with the
reciprocal first, ``Tile`` token replication. Neither fuses as it is; after
:class:`NormalizeSpellingsPass` each fuses into one node, the normalised model computes what the
edited one does, and so does the fused model (ORT CPU, fresh random tokens). Run inside the
pipeline (the pass registered as its canonicalisation), the fused node is spliced into the
original, whose router keeps its own spelling: the replaced values carry their origin tags.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
from onnx import helper
from test_spellings_common import assert_same, normalise, session

import onnx_moe_fuse.pipeline.canonicalise as canonicalise_module
from onnx_moe_fuse import fuse
from onnx_moe_fuse.pipeline.fuse_moe_layers import FuseMoELayersPass
from onnx_moe_fuse.rewrites.canonical.spellings.normalize_spellings import NormalizeSpellingsPass
from onnx_moe_fuse.samples import get_sample

RTOL, ATOL = 1e-5, 1e-5


def _edit(replace: dict[str, list[onnx.NodeProto]], drop: set[str], opset: int | None = None):
    """The sample with the node making each key of ``replace`` swapped, those of ``drop`` gone."""
    model = get_sample("qwen3_dec_f32").model
    nodes = []
    for node in model.graph.node:
        out = node.output[0]
        if out in replace:
            nodes.extend(replace.pop(out))
        elif out not in drop:
            nodes.append(node)
    assert not replace, f"no node makes {sorted(replace)}"
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    if opset is not None:
        model.opset_import[0].version = opset
    onnx.checker.check_model(model, full_check=True)
    return model


def _einsum_layer() -> onnx.ModelProto:
    def einsum(inputs, out, equation):
        return [helper.make_node("Einsum", inputs, [out], equation=equation)]

    return _edit(
        {
            "router_logits": einsum(["x", "router_weight"], "router_logits", "th,he->te"),
            "fc1_gate_proj": einsum(
                ["x", "fc1_gate_selected_weight"], "fc1_gate_proj", "th,tkhi->tki"
            ),
            "fc2_proj": einsum(["swiglu", "fc2_selected_weight"], "fc2_proj", "tki,tkih->tkh"),
            "y": einsum(["fc2_proj", "routing_weights"], "y", "tkh,tk->th"),
        },
        drop={
            "fc1_gate_tokens",
            "fc1_gate_lhs",
            "fc1_gate_matmul",
            "fc2_lhs",
            "fc2_matmul",
            "routing_weights_3d",
            "weighted_expert_out",
        },
    )


def _op_spellings_layer() -> onnx.ModelProto:
    node = helper.make_node
    return _edit(
        {
            "router_logits": [node("Gemm", ["x", "router_weight"], ["router_logits"])],
            "gate_silu": [node("Swish", ["fc1_gate_proj"], ["gate_silu"])],
            "routing_weights": [
                node("Reciprocal", ["topk_sum"], ["topk_inv"]),
                node("Mul", ["topk_inv", "topk_probs"], ["routing_weights"]),
            ],
            "fc1_up_lhs": [node("Tile", ["fc1_up_tokens", "c_1_8_1_1"], ["fc1_up_lhs"])],
        },
        drop={"gate_sigmoid"},
        opset=24,  # Swish
    )


def _assert_fuses_after_normalising(model: onnx.ModelProto, rng, monkeypatch) -> None:
    with monkeypatch.context() as m:  # the rules alone do not take these spellings
        m.setattr(canonicalise_module, "canonicalisation_passes", lambda refusals=None: [])
        # (nor without this pass: the analysis of meaning's second round is switched off too)
        m.setattr(
            FuseMoELayersPass, "_by_meaning", lambda self, work, refusals, tracer, rules: tracer
        )
        assert not fuse(model).report.fusions
    normalised, modified = normalise(model)
    assert modified
    assert_same(model, normalised, rng, rtol=RTOL, atol=ATOL, dims={"T": 7})
    result = fuse(normalised)
    assert [f["op"] for f in result.report.fusions] == ["MoE"]
    x = rng.standard_normal((7, 64)).astype(np.float32)
    (expected,) = session(model).run(None, {"x": x})
    (got,) = session(result.model).run(None, {"x": x})
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)


def test_einsum_layer_fuses(rng, monkeypatch):
    _assert_fuses_after_normalising(_einsum_layer(), rng, monkeypatch)


def test_gemm_swish_reciprocal_tile_layer_fuses(rng, monkeypatch):
    _assert_fuses_after_normalising(_op_spellings_layer(), rng, monkeypatch)


def test_pipeline_splices_into_the_original(rng, monkeypatch):
    monkeypatch.setattr(
        canonicalise_module,
        "canonicalisation_passes",
        lambda refusals=None: [NormalizeSpellingsPass()],
    )
    for model, router_op in ((_einsum_layer(), "Einsum"), (_op_spellings_layer(), "Gemm")):
        result = fuse(model)
        assert [f["op"] for f in result.report.fusions] == ["MoE"]
        assert not result.report.canonicalisation  # the pass did not fail
        # the layer is one MoE node; the router outside it is the original's own spelling
        assert collections.Counter(n.op_type for n in result.model.graph.node) == {
            router_op: 1,
            "MoE": 1,
        }
        x = rng.standard_normal((7, 64)).astype(np.float32)
        (expected,) = session(model).run(None, {"x": x})
        (got,) = session(result.model).run(None, {"x": x})
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
