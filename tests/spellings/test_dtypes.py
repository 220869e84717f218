"""The generator's dtype axis: every supported spelling in float16 and bfloat16 too.

A generated layer (``build_case``, float32) is retyped wholesale to float16 or bfloat16 (every
float32 tensor, value and cast: ``sample_models/upcast.retype_floats``), as a ``model.half()``
export without upcasts is. Then:

* float16: it fuses into the op its float32 case records (MoE, or QMoE with float16 scales),
  k and the activation as recorded (the routing attributes are the construction's: a
  half-precision layer is always fed its own selection and weights), and the fused model
  matches ORT CPU on the float16 original within float16's tolerance (1e-2 of max |output|),
  on fresh tokens; the numpy reference of the float32 case is not used (float16 logits tie
  where float64 ones do not, and the fused node follows the model's own TopK);
* bfloat16: ort-cpu refuses it naming the target and the dtype (no bfloat16 MoE/QMoE kernel
  in ORT 1.32 CPU), the model unchanged; ort-cuda fuses it into the same op, but for
  per-channel asymmetric zero points, which ORT CUDA's QMoE does not take (refused, named);
* a mutant (one place broken) in float16 is still refused and left byte-identical.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np
import onnx
from hypothesis import assume, given, settings

from onnx_moe_fuse import fuse

from .build import build_case
from .outcomes import fused_nodes, node_attributes, relative_error, session, token_shape
from .strategies import MEANING_AXES, LayerCase, expected, supported_cases, supported_mutants

CI = settings.get_profile("spellings-ci")
HALF_TOLERANCE = 1e-2
FLOAT16 = onnx.TensorProto.FLOAT16
BFLOAT16 = onnx.TensorProto.BFLOAT16
#: the attributes a half-precision fusion keeps from the float32 case (the routing ones are
#: the construction's)
KEPT = ("k", "activation_type", "swiglu_fusion", "expert_weight_bits", "block_size")


@functools.cache
def _retype():
    path = Path(__file__).resolve().parents[2] / "sample_models" / "upcast.py"
    spec = importlib.util.spec_from_file_location("upcast", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.retype_floats


def _half_runnable(case: LayerCase) -> bool:
    """A case whose float16 twin is expected to fuse: all but the scatter combines.

    ORT CPU has no float16 ScatterElements/ScatterND with reduction "add" for the original's
    reference run. Hand-written activations take part: a written-out exp that overflows float16
    where the fused op's rounded output does too agrees (``behaviour.probes.in_dtype``).
    """
    return case.axis_values().get("combine") not in MEANING_AXES["combine"]


def _twin(case: LayerCase, elem: int) -> onnx.ModelProto:
    return _retype()(build_case(case).model, onnx.TensorProto.FLOAT, elem)


@settings(CI, max_examples=40)
@given(supported_cases().filter(_half_runnable))
def test_float16_twin_fuses_and_matches_the_original(case: LayerCase) -> None:
    want = expected(case)
    model = _twin(case, FLOAT16)
    result = fuse(model)
    nodes = fused_nodes(result.model)
    assert [n.op_type for n in nodes] == [want.op], (case.label(), result.report.near_misses)
    got = node_attributes(nodes[0])
    for name in KEPT:
        if name in want.attributes and not isinstance(want.attributes[name], set):
            assert got[name] == want.attributes[name], (case.label(), name, got[name])
    rng = np.random.default_rng(case.seed + 2)
    original, fused = session(model), session(result.model)
    for _ in range(2):
        x = rng.standard_normal(token_shape(case, rng)).astype(np.float16)
        want_out = original.run(None, {"x": x})[0].astype(np.float64)
        err = relative_error(fused.run(None, {"x": x})[0], want_out)
        assert err <= HALF_TOLERANCE, f"{case.label()}: fused vs original {err:.1e}"


@settings(CI, max_examples=15)
@given(supported_cases().filter(_half_runnable))
def test_bfloat16_twin_fuses_for_cuda_only(case: LayerCase) -> None:
    # Switch's ArgMax becomes a TopK, which takes bfloat16 only from opset 24 (the spelling
    # pass leaves a bfloat16 ArgMax before it as it is: such a layer stays unfused)
    assume(not (case.routing == "argmax_top1" and case.opset_version < 24))
    want = expected(case)
    model = _twin(case, BFLOAT16)
    cpu = fuse(model)
    assert cpu.report.fusions == [], case.label()
    assert cpu.model.SerializeToString() == model.SerializeToString()
    reasons = [m["reason"] for m in cpu.report.near_misses if m["part"] == "target"]
    assert reasons and all("ort-cpu" in r and "bfloat16" in r for r in reasons), case.label()
    cuda = fuse(model, target="ort-cuda")
    if case.quantized and case.zero_point == "asymmetric" and case.granularity == "channel":
        # ORT CUDA's QMoE takes zero points block-wise only (fuser/contract/targets.py): a
        # per-channel asymmetric layer is refused for ort-cuda naming them, left unchanged
        assert fused_nodes(cuda.model) == [], case.label()
        assert cuda.model.SerializeToString() == model.SerializeToString()
        reasons = [m["reason"] for m in cuda.report.near_misses]
        assert any("ort-cuda" in r and "zero points" in r for r in reasons), reasons
        return
    assert [n.op_type for n in fused_nodes(cuda.model)] == [want.op], case.label()


@settings(CI, max_examples=20)
@given(supported_mutants())
def test_float16_mutant_is_still_refused(case: LayerCase) -> None:
    model = _twin(case, FLOAT16)
    result = fuse(model)
    assert fused_nodes(result.model) == [], (case.label(), case.mutation)
    assert result.model.SerializeToString() == model.SerializeToString()
    assert result.report.near_misses, case.label()
