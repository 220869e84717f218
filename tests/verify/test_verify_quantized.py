"""``verify(..., quantization=)`` for layers quantised on request: the measured tolerance.

The fused model is compared with the float original at the tolerance its report's measured
errors allow (:func:`onnx_moe_fuse.verify.quant_error.verify_tolerance`), named in each path's
notes; the same model fails the exact default; and a wrong node swapped in (the experts'
weights of another expert, or FC2's scales off by 10 %) fails at the measured tolerance.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from onnx_moe_fuse import fuse
from onnx_moe_fuse.samples import get_sample
from onnx_moe_fuse.verify import verify, verify_tolerance
from onnx_moe_fuse.verify.quant_error import VERIFY_FACTOR


def _tampered(model: onnx.ModelProto, input_slot: int, change) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    (node,) = [n for n in out.graph.node if n.op_type == "QMoE"]
    for i, t in enumerate(out.graph.initializer):
        if t.name == node.input[input_slot]:
            out.graph.initializer[i].CopyFrom(
                numpy_helper.from_array(change(numpy_helper.to_array(t)), t.name)
            )
    return out


def test_the_measured_tolerance_passes_the_quantised_model_and_is_named():
    original = get_sample("qwen3_dec_f32").model
    result = fuse(original, quantize="int4")
    tolerance = verify_tolerance(result.report.fusions)
    error = result.report.fusions[0]["quantization"]["max_rel_error"]
    assert tolerance.rtol == pytest.approx(VERIFY_FACTOR * error)
    report = verify(original, result.model, seeds=(0, 1), quantization=tolerance)
    assert report.passed, report.summary()
    for path in report.paths.values():
        assert any("quantised layers" in n and "not exact" in n for n in path.tolerance_notes)
    # the exact default does not hold: the quantised node is not the float layer
    assert not verify(original, result.model, seeds=(0,), paths=("ort",)).passed
    assert verify_tolerance(fuse(original).report.fusions) is None  # nothing quantised


@pytest.mark.parametrize(
    ("quantize", "slot", "change"),
    [
        ("int4", 2, lambda w: np.roll(w, 1, axis=0)),  # FC1 of the next expert
        ("int8", 6, lambda s: (s * 1.1).astype(s.dtype)),  # FC2's scales 10 % off
    ],
)
def test_a_wrong_node_fails_at_the_measured_tolerance(quantize, slot, change):
    original = get_sample("qwen3_dec_f32").model
    result = fuse(original, quantize=quantize)
    tolerance = verify_tolerance(result.report.fusions)
    wrong = _tampered(result.model, slot, change)
    report = verify(original, wrong, seeds=(0,), paths=("ort",), quantization=tolerance)
    assert not report.passed, report.summary()
    assert any("exceeds rtol" in m for m in report.messages)


def test_accuracy_level_4_adds_the_int8_activation_tolerance_on_the_ort_path():
    original = get_sample("qwen3_dec_f32").model
    result = fuse(original, quantize="int4", accuracy_level=4)
    tolerance = verify_tolerance(result.report.fusions)
    report = verify(original, result.model, seeds=(0,), paths=("ort",), quantization=tolerance)
    assert report.passed, report.summary()
    (note,) = report.paths["ort"].tolerance_notes
    assert "accuracy_level=4" in note and "int8 activations" in note
