"""Tests of ``CanonicalExpertLoopPass``: a loop over all experts -> per-slot GroupedMatMul.

Hand-built loops (:mod:`loop_models`: the TorchScript and dynamo spellings of optimum-onnx's
patched forward, E in {2, 4}, k in {1, 2}, SwiGLU and Relu experts) are rewritten into the
per-slot form and keep their numbers in ORT CPU (GroupedMatMul decomposed into the Gather/MatMul
form ORT runs) on fresh random tokens, T = 1, T < E and more. Each mutation that breaks one link
of the proof leaves the model byte-identical with a reason naming the link, and
the pass records that reason, as it runs, for the loop's TopK.
"""

from __future__ import annotations

import collections

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
from helpers import decompose_grouped_matmul
from loop_models import MUTATIONS, LoopSpec, build_loop

import onnx_moe_fuse
from onnx_moe_fuse.rewrites.canonical.experts.loops.expert_loop import (
    CanonicalExpertLoopPass,
    expert_loop_refusals,
)
from onnx_moe_fuse.rewrites.graph.facts import label
from onnx_moe_fuse.rewrites.graph.refusals import EXPERT_LOOP, recorded

H = 16


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess.run(["out"], {"x": x})[0]


def _bytes(model: ir.Model) -> bytes:
    return ir.serde.serialize_model(model).SerializeToString()


SPECS = [
    LoopSpec(experts=e, k=k, spelling=sp, activation=act, seed=i)
    for i, (sp, act, e, k) in enumerate(
        (sp, act, e, k)
        for sp in ("torchscript", "dynamo")
        for act in ("swiglu", "relu")
        for e in (2, 4)
        for k in (1, 2)
    )
] + [LoopSpec(spelling=sp, plain_rows=True, seed=40) for sp in ("torchscript", "dynamo")]
SPECS += [
    LoopSpec(spelling=sp, activation=act, biases=True, seed=50 + i)
    for i, (sp, act) in enumerate(
        (sp, act) for sp in ("torchscript", "dynamo") for act in ("swiglu", "relu")
    )
]


def _spec_id(s: LoopSpec) -> str:
    plain, bias = "-plain" if s.plain_rows else "", "-bias" if s.biases else ""
    return f"{s.spelling}-{s.activation}-E{s.experts}k{s.k}{plain}{bias}"


@pytest.mark.parametrize("spec", SPECS, ids=_spec_id)
def test_loop_becomes_per_slot_grouped_matmul_with_the_same_numbers(spec: LoopSpec):
    proto = build_loop(spec)
    model = ir.serde.deserialize_model(proto)
    pss = CanonicalExpertLoopPass()
    assert pss(model).modified, pss.refusals
    ops = collections.Counter(n.op_type for n in model.graph)
    fc1 = 2 if spec.activation == "swiglu" else 1
    assert ops["GroupedMatMul"] == fc1 + 1
    biased = [n for n in model.graph if n.op_type == "GroupedMatMul" and len(n.inputs) == 4]
    assert len(biased) == (fc1 + 1 if spec.biases else 0)  # each bias stacked into [E, N]
    assert not {"NonZero", "OneHot", "ScatterElements", "ScatterND"} & set(ops)
    assert model.graph.outputs[0].name == "out"
    assert model.opset_imports[""] == 29
    rewritten = decompose_grouped_matmul(model)
    rng = np.random.default_rng(spec.seed + 100)
    for tokens in (1, spec.experts - 1, 7):
        x = rng.standard_normal((tokens, H)).astype(np.float32)
        want, got = _run(proto, x), _run(rewritten, x)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


_REASONS = {
    "missing_expert": ("experts [3] have no slice",),
    "repeated_expert": ("expert 2's slice of the mask is taken twice",),
    "shared_weight": ("experts 0 and 1 share the weight",),
    "weight_swapped": ("expert 0", "routing weight at"),
    "rows_by_slots": ("expert 0", "gathered by the slot ids"),
    "other_topk": ("routing weights", "whose ids build the mask"),
    "nonzero_start": ("accumulation", "not proved to be zeros"),
    "graph_output": ("region", "is a graph output"),
    "squeeze_slot_axis": ("squeezes the slot axis",),
}


@pytest.mark.parametrize("spelling", ["torchscript", "dynamo"])
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_broken_loops_stay_byte_identical_with_the_reason(mutation: str, spelling: str):
    model = ir.serde.deserialize_model(build_loop(LoopSpec(spelling=spelling, mutation=mutation)))
    before = _bytes(model)
    pss = CanonicalExpertLoopPass()
    assert not pss(model).modified
    assert _bytes(model) == before
    [refusal] = pss.refusals
    reason = refusal.reason
    assert all(w in reason for w in _REASONS[mutation]), reason
    assert refusal.stage == EXPERT_LOOP and refusal.topk.op_type == "TopK"
    assert expert_loop_refusals(model) == [(label(refusal.topk), reason)]
    assert recorded(pss.refusals, EXPERT_LOOP, refusal.topk) is refusal


def test_the_refusal_is_recorded_for_the_masking_topk_only():
    model = ir.serde.deserialize_model(build_loop(LoopSpec(mutation="other_topk")))
    topks = [n for n in model.graph if n.op_type == "TopK"]
    pss = CanonicalExpertLoopPass()
    pss(model)
    reasons = [recorded(pss.refusals, EXPERT_LOOP, t) for t in topks]
    assert reasons[0] is None and reasons[1] is not None  # only the masking TopK has a loop
    proved = ir.serde.deserialize_model(build_loop(LoopSpec()))
    pss = CanonicalExpertLoopPass()
    assert pss(proved).modified and pss.refusals == []


def test_pass_reads_no_expert_weights():
    model = ir.serde.deserialize_model(build_loop(LoopSpec(experts=2)))
    read: list[str] = []
    for name, value in list(model.graph.initializers.items()):
        tensor = value.const_value
        if tensor.size < H * 8:
            continue

        def load(tensor=tensor, name=name):
            read.append(name)
            return tensor

        value.const_value = ir.LazyTensor(load, tensor.dtype, tensor.shape, name=tensor.name)
    assert CanonicalExpertLoopPass()(model).modified
    assert read == []
    stacked = [v for v in model.graph.initializers.values() if len(v.shape or ()) == 3]
    assert stacked and all(isinstance(v.const_value, ir.LazyTensor) for v in stacked)


def _fuse_params():
    for spelling in ("torchscript", "dynamo"):
        for activation in ("swiglu", "relu"):
            for biases in (False, True):
                bias = "-bias" if biases else ""
                yield pytest.param(
                    spelling, activation, biases, id=f"{spelling}-{activation}{bias}"
                )


@pytest.mark.parametrize(("spelling", "activation", "biases"), list(_fuse_params()))
def test_fuse_writes_one_moe_with_the_loops_numbers(spelling: str, activation: str, biases: bool):
    proto = build_loop(LoopSpec(spelling=spelling, activation=activation, biases=biases, seed=7))
    result = onnx_moe_fuse.fuse(proto)
    assert [f["op"] for f in result.report.fusions] == ["MoE"], result.report.near_misses
    moe = next(n for n in result.model.graph.node if n.op_type == "MoE")
    assert (len(moe.input) > 3 and moe.input[3] != "") == biases  # fc1_experts_bias
    rng = np.random.default_rng(11)
    for tokens in (1, 3, 7):
        x = rng.standard_normal((tokens, H)).astype(np.float32)
        want, got = _run(proto, x), _run(result.model, x)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
