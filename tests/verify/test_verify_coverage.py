"""Per-layer verification selects every expert (fuser/verify/coverage.py).

A stacked int4 model of 64 experts at top-8 is fused; random router scores of one seed select
only some experts. The covering draw reorders each router row's own values so that the rows
select every expert (a seed added for the rows still missing), and a fused layer whose weights
are wrong only for an expert the plain draw never selects now fails, where it passed before.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnx_moe_fuse.samples.stacked import stacked_moe_model
from onnx_moe_fuse.streaming_io import fuse_file
from onnx_moe_fuse.verify import layers as layers_mod
from onnx_moe_fuse.verify.coverage import covering_feeds, routed_inputs, selected_experts
from onnx_moe_fuse.verify.feeds import DEFAULT_DIM_VALUES, random_feeds
from onnx_moe_fuse.verify.layers import verify_layers
from onnx_moe_fuse.verify.regions import layer_models

EXPERTS, TOP_K = 64, 8


@pytest.fixture(scope="module")
def fused_pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("coverage")
    src = folder / "m.onnx"
    model = stacked_moe_model(1, hidden=64, inter=32, experts=EXPERTS, seed_key="coverage")
    onnx.save(model, src, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    out = folder / "f.onnx"
    result = fuse_file(src, out, jobs=1)
    assert len(result.report.fusions) == 1
    return src, out, result.report.fusions


def _cuts(fused_pair):
    src, out, fusions = fused_pair
    original = onnx.load(str(src), load_external_data=False)
    fused = onnx.load(str(out), load_external_data=False)
    return layer_models(original, fused, fusions[0])


def _router(fused_pair) -> str:
    original_cut, fused_cut = _cuts(fused_pair)
    (router,) = routed_inputs(fused_cut, {v.name for v in original_cut.graph.input})
    return router


def test_the_rows_select_every_expert_with_their_own_values(fused_pair):
    original_cut, fused_cut = _cuts(fused_pair)
    router = _router(fused_pair)
    feeds, records = covering_feeds(original_cut, fused_cut, [0], DEFAULT_DIM_VALUES)
    rows = feeds[0][router].shape[0]
    assert rows * TOP_K < EXPERTS  # one seed is too few: one is added, with the rows missing
    assert sorted(feeds) == [0, 1]
    assert (rows + feeds[1][router].shape[0]) * TOP_K >= EXPERTS
    assert feeds[1][router].shape[0] <= rows
    assert records == [{"router": router, "experts": EXPERTS, "selected": EXPERTS, "seeds": [0, 1]}]
    chosen = selected_experts(feeds[0][router], TOP_K) | selected_experts(feeds[1][router], TOP_K)
    assert chosen == set(range(EXPERTS))
    for seed, got in feeds.items():
        dims = {**DEFAULT_DIM_VALUES, "T": got[router].shape[0]}
        drawn = random_feeds(original_cut, seed, dims)
        assert sorted(got) == sorted(drawn)
        for name, values in got.items():
            if name == router:  # the same values per row, given to other experts
                np.testing.assert_array_equal(np.sort(values, 1), np.sort(drawn[name], 1))
                assert not np.array_equal(values, drawn[name])
            else:
                np.testing.assert_array_equal(values, drawn[name])


def test_a_layer_without_a_routed_input_keeps_the_plain_draw(fused_pair):
    original_cut, fused_cut = _cuts(fused_pair)
    router = _router(fused_pair)
    for node in fused_cut.graph.node:  # as if the fused node were fed its selection
        node.input[:] = [v if v != router else "elsewhere" for v in node.input]
    feeds, records = covering_feeds(original_cut, fused_cut, [0, 1], DEFAULT_DIM_VALUES)
    assert records == [] and sorted(feeds) == [0, 1]
    for seed in feeds:
        drawn = random_feeds(original_cut, seed, DEFAULT_DIM_VALUES)
        for name in drawn:
            np.testing.assert_array_equal(feeds[seed][name], drawn[name])


def _corrupt_expert(out, tmp_path, expert: int):
    """A copy of the fused model with ``expert``'s FC2 codes changed (only that expert's)."""
    bad = tmp_path / "f.onnx"
    bad.write_bytes(out.read_bytes())
    data = bytearray((out.parent / "f.onnx.data").read_bytes())
    proto = onnx.load(str(out), load_external_data=False)
    tensor = next(t for t in proto.graph.initializer if t.name.endswith("fc2_experts_weights"))
    info = {e.key: e.value for e in tensor.external_data}
    per_expert = int(info["length"]) // tensor.dims[0]
    start = int(info["offset"]) + expert * per_expert
    data[start : start + per_expert] = bytes(b ^ 0x77 for b in data[start : start + per_expert])
    (tmp_path / "f.onnx.data").write_bytes(bytes(data))
    return bad


def test_an_expert_random_tokens_never_select_is_still_checked(
    fused_pair, tmp_path, monkeypatch, device
):
    src, out, fusions = fused_pair
    original_cut, _ = _cuts(fused_pair)
    router = _router(fused_pair)
    plain = selected_experts(random_feeds(original_cut, 0, DEFAULT_DIM_VALUES)[router], TOP_K)
    skipped = min(set(range(EXPERTS)) - plain)
    bad = _corrupt_expert(out, tmp_path, skipped)

    got = verify_layers(src, bad, fusions, seeds=[0])
    assert not got["passed"]
    (record,) = got["layers"]
    assert record["experts"][0]["selected"] == EXPERTS and record["seeds"] == [0, 1]
    assert record["paths"]["ort"]["status"] == "failed"
    assert record["paths"]["wgpu"]["status"] == "failed"

    # the plain draw (what ran before) never computes with that expert: the layer passes
    def plain_feeds(original, fused, seeds, dims):
        return {int(s): random_feeds(original, int(s), dims) for s in seeds}, []

    monkeypatch.setattr(layers_mod, "covering_feeds", plain_feeds)
    assert verify_layers(src, bad, fusions, seeds=[0])["passed"]
    assert verify_layers(src, out, fusions, seeds=[0])["passed"]


def test_a_layer_larger_than_the_adapter_binds_runs_its_selected_experts_there(
    fused_pair, tmp_path, monkeypatch, device
):
    src, out, fusions = fused_pair
    proto = onnx.load(str(out), load_external_data=False)
    fc1 = next(t for t in proto.graph.initializer if t.name.endswith("fc1_experts_weights"))
    whole = int(np.prod(fc1.dims))
    limit = whole * 3 // 4  # the layer's FC1 does not fit, a seed's selected experts do
    monkeypatch.setattr(layers_mod, "_binding_limit", lambda: limit)

    got = verify_layers(src, out, fusions, seeds=[0])
    (record,) = got["layers"]
    assert got["passed"], record["messages"]
    wgpu = record["paths"]["wgpu"]
    assert wgpu["status"] == "passed" and "experts each seed selects" in wgpu["notes"][-1]
    (output,) = wgpu["outputs"].values()
    assert [s["seed"] for s in output["per_seed"]] == record["seeds"] == [0, 1]
    assert 0 < output["max_rel"] < 1e-4

    router = _router(fused_pair)
    original_cut, _ = _cuts(fused_pair)
    plain = selected_experts(random_feeds(original_cut, 0, DEFAULT_DIM_VALUES)[router], TOP_K)
    bad = _corrupt_expert(out, tmp_path, min(set(range(EXPERTS)) - plain))
    got = verify_layers(src, bad, fusions, seeds=[0])
    (record,) = got["layers"]
    assert not got["passed"] and record["paths"]["wgpu"]["status"] == "failed"
