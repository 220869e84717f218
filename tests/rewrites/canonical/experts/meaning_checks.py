"""The two outcomes the tests of the analysis of meaning assert: fused and exact, or refused and named.

``assert_fuses``: one MoE node, matching the original in ORT CPU within 1e-5 scale-aware on
fresh random tokens at each token count. ``assert_refused``: the model left byte-identical,
with near misses that each name a part and a node (never "not recognised").
"""

from __future__ import annotations

import numpy as np
import onnx

import onnx_moe_fuse
from tests.pipeline.meaning_refs import ort_run
from tests.rewrites.canonical.experts.meaning_models import H

TOL = 1e-5


def assert_fuses(model: onnx.ModelProto, seed: int, token_counts: tuple[int, ...] = (1, 7)) -> None:
    result = onnx_moe_fuse.fuse(model)
    ops = [n.op_type for n in result.model.graph.node]
    assert ops.count("MoE") == 1, (ops, result.report.near_misses)
    rng = np.random.default_rng(seed)
    for tokens in token_counts:
        x = rng.standard_normal((tokens, H)).astype(np.float32)
        want, got = ort_run(model, {"x": x}), ort_run(result.model, {"x": x})
        err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
        assert err <= TOL, f"rel err {err:.2e} at {tokens} tokens"


def assert_refused(model: onnx.ModelProto) -> dict:
    """The first near miss, after checking the model is unchanged and every miss points."""
    before = model.SerializeToString()
    result = onnx_moe_fuse.fuse(model)
    assert result.model.SerializeToString() == before
    assert result.report.near_misses, "a refused layer needs a near miss"
    for miss in result.report.near_misses:
        assert miss["part"] and miss["node"], miss
        assert not miss["reason"].startswith("not recognised"), miss
    return result.report.near_misses[0]
