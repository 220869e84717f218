"""The analysis of meaning on sorted layers: histc counts, argsort rows, scaled tokens, a base.

Each equivalent layer fuses into one MoE node and matches the original in ORT CPU on fresh
tokens (two token counts); each trap is left byte-identical with a near miss naming its part
and node (see :mod:`.meaning_sorted_models`).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from onnx_moe_fuse.pipeline.canonicalise import canonicalise
from onnx_moe_fuse.rewrites.canonical.experts.meaning.contract import LayerParts
from onnx_moe_fuse.rewrites.canonical.experts.meaning.meaning_pass import analyse_topk
from tests.rewrites.canonical.experts.meaning_checks import assert_fuses, assert_refused
from tests.rewrites.canonical.experts.meaning_sorted_models import SORTED_TRAPS, histc_layer


@pytest.mark.parametrize(
    ("k", "scale_before", "base", "route_scale"),
    [(2, False, False, 1.0), (2, False, True, 2.0), (1, True, True, 1.0), (1, False, False, 1.0)],
)
def test_sorted_histc_layer_fuses(
    k: int, scale_before: bool, base: bool, route_scale: float
) -> None:
    model = histc_layer(seed=11, k=k, scale_before=scale_before, base=base, route_scale=route_scale)
    assert_fuses(model, seed=12)


def test_histc_counts_are_each_experts_count() -> None:
    """The histogram over [0, E) of the float ids is described as every expert's count."""
    work = ir.from_proto(histc_layer(seed=3))
    canonicalise(work)
    order = {id(n): i for i, n in enumerate(work.graph)}
    topk = next(n for n in work.graph if n.op_type == "TopK")
    found, parts = analyse_topk(topk, order)
    assert isinstance(parts, LayerParts)
    sub = next(n for n in work.graph if n.op_type == "Sub")
    counts = found.meaning(sub.outputs[0])
    assert counts is not None and "every expert" in counts.text()


@pytest.mark.parametrize("trap", SORTED_TRAPS)
def test_sorted_traps_refused(trap: str) -> None:
    miss = assert_refused(histc_layer(trap=trap, seed=13))
    if trap == "histc_off_by_one":
        assert miss["part"] == "fc1" and "Split" in miss["reason"], miss
        assert "M = " in miss["reason"], miss  # the mix the counts are instead
    if trap == "scale_before_top2":
        assert "k = 2 slots" in miss["reason"], miss


def test_off_by_one_trap_runs() -> None:
    """The trap is a valid model (its counts still sum to T*k): it computes another layer."""
    import onnxruntime as ort

    model = histc_layer(trap="histc_off_by_one", seed=13)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(5).standard_normal((7, 16)).astype(np.float32)
    assert np.isfinite(sess.run(None, {"x": x})[0]).all()
