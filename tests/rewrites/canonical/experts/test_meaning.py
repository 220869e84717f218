"""The analysis of meaning: layers in spellings no exporter-form pass was written for.

Each equivalent layer must fuse (one MoE node) and match the original in ORT CPU within 1e-5
scale-aware on fresh random tokens at two token counts; each trap must be left byte-identical
with a near miss that names a part and a node (never "not recognised"). The analysis must also
agree with every fast path: each layer the generated samples fuse is described by it too.
"""

from __future__ import annotations

import onnx
import onnx_ir as ir
import pytest

import onnx_moe_fuse
from onnx_moe_fuse.pipeline.canonicalise import canonicalise
from onnx_moe_fuse.rewrites.canonical.experts.meaning.contract import LayerParts
from onnx_moe_fuse.rewrites.canonical.experts.meaning.interpret import interpret_layer
from onnx_moe_fuse.rewrites.canonical.experts.meaning.meaning_pass import analyse_topk
from onnx_moe_fuse.samples.registry import all_samples
from tests.rewrites.canonical.experts.meaning_checks import assert_fuses, assert_refused
from tests.rewrites.canonical.experts.meaning_models import (
    COMBINES,
    DENSE_TRAPS,
    FLAT_TRAPS,
    LOOP_TRAPS,
    ROWS,
    dense_layer,
    flat_layer,
    loop_layer,
)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("combine", COMBINES)
def test_flat_layouts_and_combines_fuse(rows: str, combine: str) -> None:
    assert_fuses(flat_layer(rows, combine, seed=len(rows) + len(combine)), seed=1)


@pytest.mark.parametrize("k", [1, 3])
def test_flat_other_k(k: int) -> None:
    assert_fuses(flat_layer("gather_range", "scatter_nd", k=k, seed=k), seed=2)


def test_flat_with_biases_of_other_ranks() -> None:
    assert_fuses(flat_layer("expand_reshape", "reshape_sum", bias=True, seed=3), seed=3)


def test_scatter_without_reduction_fuses_at_top1() -> None:
    """Each token writes its one slot once: overwriting is adding into zeros."""
    model = flat_layer("gather_range", "scatter_nd", k=1, trap="scatter_overwrite", seed=4)
    assert_fuses(model, seed=4)


@pytest.mark.parametrize("trap", FLAT_TRAPS)
def test_flat_traps_refused(trap: str) -> None:
    rows = "gather_range" if trap == "rows_by_slot" else "expand_reshape"
    combine = "scatter_nd" if trap == "scatter_overwrite" else "reshape_sum"
    miss = assert_refused(flat_layer(rows, combine, trap=trap, seed=5))
    if trap == "scatter_overwrite":
        assert "overwrite" in miss["reason"]
    if trap == "rows_by_slot":
        assert miss["part"] == "fc1" and "not that axis' own index" in miss["reason"]


def test_expert_loop_fuses() -> None:
    assert_fuses(loop_layer(seed=6), seed=6)


@pytest.mark.parametrize("trap", LOOP_TRAPS)
def test_expert_loop_traps_refused(trap: str) -> None:
    miss = assert_refused(loop_layer(trap=trap, seed=7))
    if trap == "missing_expert":
        assert miss["part"] == "combine"


def test_departure_names_the_node_and_what_it_computes() -> None:
    """The furthest departure: the sum over the tokens, after FC2 and the weights."""
    work = ir.from_proto(flat_layer(trap="sum_over_tokens", seed=8))
    canonicalise(work)
    order = {id(n): i for i, n in enumerate(work.graph)}
    topk = next(n for n in work.graph if n.op_type == "TopK")
    found = interpret_layer(topk, order, 4)
    assert found.output is None
    departure = found.furthest()
    assert departure is not None and departure.node.op_type == "ReduceSum"
    assert "not the slots" in departure.reason
    assert departure.expected.startswith("the weighted outputs summed over the slots")


def test_fast_paths_agree_with_the_analysis() -> None:
    """Every layer a generated sample fuses is also described as the contract."""
    checked = 0
    for sample in all_samples():
        if not onnx_moe_fuse.fuse(sample.model).report.fusions:
            continue
        work = ir.from_proto(sample.model)
        canonicalise(work)
        order = {id(n): i for i, n in enumerate(work.graph)}
        for topk in (n for n in work.graph if n.op_type == "TopK"):
            _, parts = analyse_topk(topk, order)
            assert isinstance(parts, LayerParts), (sample.name, parts)
            assert parts.topk is topk
            checked += 1
    assert checked >= 30


def _parts(model: onnx.ModelProto):
    work = ir.from_proto(model)
    canonicalise(work)
    order = {id(n): i for i, n in enumerate(work.graph)}
    topk = next(n for n in work.graph if n.op_type == "TopK")
    return analyse_topk(topk, order)[1]


def test_dense_layer_is_the_contract_and_fuses() -> None:
    assert isinstance(_parts(dense_layer(seed=9)), LayerParts)
    assert_fuses(dense_layer(seed=9), seed=9)


@pytest.mark.parametrize("trap", DENSE_TRAPS)
def test_dense_traps_refused(trap: str) -> None:
    assert not isinstance(_parts(dense_layer(trap=trap, seed=10)), LayerParts)
    assert_refused(dense_layer(trap=trap, seed=10))
