"""The analysis of meaning on makeMoE-style loops: token masks and weights read from E-wide scores.

Each equivalent layer (:mod:`.meaning_chosen_models`) fuses into one MoE node and matches the
original in ORT CPU on fresh tokens (two token counts); each trap is left byte-identical with a
near miss naming its part and node.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import pytest

from onnx_moe_fuse.pipeline.canonicalise import canonicalise
from onnx_moe_fuse.rewrites.canonical.experts.meaning.contract import LayerParts
from onnx_moe_fuse.rewrites.canonical.experts.meaning.meaning_pass import analyse_topk
from tests.rewrites.canonical.experts.meaning_checks import assert_fuses, assert_refused
from tests.rewrites.canonical.experts.meaning_chosen_models import (
    CHOSEN_TRAPS,
    FILL,
    H,
    chosen_layer,
)


@pytest.mark.parametrize(
    ("router", "mask"),
    [
        ("scatter", "any"),
        ("scatter", "sum_gt"),
        ("where", "sum_eq"),
        ("where", "any"),
        ("where_not", "sum_gt"),
        ("zeros", "sum_gt"),
    ],
)
def test_chosen_tokens_loop_fuses(router: str, mask: str) -> None:
    assert_fuses(chosen_layer(router=router, mask=mask, seed=21), seed=22)


def test_token_mask_is_the_tokens_that_chose_the_expert() -> None:
    """``ReduceMax`` over the slots of ``idx == e`` reads ``[e in idx[t, :]]``.

    The weights are read from the softmax at the ids.
    """
    work = ir.from_proto(chosen_layer(seed=3))
    canonicalise(work)
    order = {id(n): i for i, n in enumerate(work.graph)}
    topk = next(n for n in work.graph if n.op_type == "TopK")
    found, parts = analyse_topk(topk, order)
    assert isinstance(parts, LayerParts) and parts.weights_at_ids
    assert parts.weights.producer().op_type == "Softmax"  # type: ignore[union-attr]
    reduce = next(n for n in work.graph if n.op_type == "ReduceMax")
    chosen = found.meaning(reduce.outputs[0])
    assert chosen is not None and "[0 in idx[t, :]]" in chosen.text()


def test_finite_fill_with_large_logits_fuses_exactly() -> None:
    """A ``-1e4`` fill with logits of order -1e4 is not the top-k softmax, yet is the contract.

    Measured here: the unselected columns take part of the mass. The fused node is fed the
    model's own weights ``gating[t, idx[t, j]]``, so it matches anyway.
    """
    model = chosen_layer(router="fill", seed=31)
    x = np.random.default_rng(32).standard_normal((64, H)).astype(np.float32)
    gating, ids = _run_at(model, ("Softmax", 0), ("TopK", 1), x=x)
    selected_mass = np.take_along_axis(gating, ids, axis=-1).sum(-1)
    partial = (selected_mass > 0.01) & (selected_mass < 0.99)
    assert partial.mean() > 0.05, "the fill takes no mass: the test shows nothing"
    assert FILL == -1e4
    assert_fuses(model, seed=33, token_counts=(1, 64))


@pytest.mark.parametrize("trap", CHOSEN_TRAPS)
def test_chosen_traps_refused(trap: str) -> None:
    miss = assert_refused(chosen_layer(trap=trap, seed=41))
    if trap == "other_column":
        assert "another expert" in miss["reason"], miss
    if trap == "same_mask_twice":
        assert "second time" in miss["reason"], miss
    if trap == "scatter_k_minus_1":
        assert "Slice of the expert indices" in miss["reason"], miss
    if trap == "capacity_cut":
        assert "capacity limit" in miss["reason"], miss
    if trap in ("every_token", "not_chosen"):
        assert "that selects" in miss["reason"], miss


def _run_at(model, *at: tuple[str, int], x: np.ndarray, last: bool = False) -> list[np.ndarray]:  # noqa: ANN001
    """The values of output ``i`` of the first (``last``: last) node of each ``(op_type, i)``."""
    import onnx
    import onnxruntime as ort

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    del copy.graph.output[:]
    for op_type, i in at:
        nodes = [n for n in copy.graph.node if n.op_type == op_type]
        node = nodes[-1] if last else nodes[0]
        copy.graph.output.append(onnx.ValueInfoProto(name=node.output[i]))
    sess = ort.InferenceSession(copy.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


def test_scatter_of_k_minus_1_logits_is_another_layer() -> None:
    """Measured: scattering only k-1 of the top logits is not makeMoE's layer (same weights).

    Its last slot weighs exactly 0 and the others are renormalised over k - 1, so the top-k
    softmax the fused op computes itself would be wrong; it is refused at the Slice of the ids.
    """
    x = np.random.default_rng(42).standard_normal((16, H)).astype(np.float32)
    (honest,) = _run_at(chosen_layer(seed=41), ("ScatterND", 0), x=x, last=True)
    (cut,) = _run_at(
        chosen_layer(trap="scatter_k_minus_1", seed=41), ("ScatterND", 0), x=x, last=True
    )
    assert np.abs(cut - honest).max() / np.abs(honest).max() > 1e-2
