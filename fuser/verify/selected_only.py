"""The WebGPU path of a layer larger than the adapter binds: the fused node on the selected experts.

A software adapter binds at most 128 MiB per storage buffer, and a Qwen3-30B-A3B layer's FC1
weights are 192 MiB, so the WebGPU kernels could not run such a layer whole. But a fused
``MoE`` / ``QMoE`` node with ``normalize_routing_weights=1`` that takes the top k of a router
input of the layer (:func:`.coverage.routed_inputs`) computes, for each token, the softmax of
its k largest scores and those k experts only: keeping only the experts a seed's tokens select
(their stacked weights, the router input's columns) changes nothing it computes, since each
token's k largest scores are among the kept columns. So for each seed :func:`wgpu_on_selected`
builds that node with the selected experts' weights (read from memory maps of the fused data
file: 40 of 128 experts, 60 MiB of FC1, for 5 tokens at top-8), runs it on the kernels and
compares it with the original region's outputs for the seed. Every expert is selected by some
seed (:mod:`.coverage`), so the kernels still compute with every expert's weights. With
``normalize_routing_weights=0`` the weights' softmax runs over every expert, so there the path
stays skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from onnx_moe_fuse.contract import ops
from onnx_moe_fuse.io.external_data import map_external
from onnx_moe_fuse.io.model_check import is_external
from onnx_moe_fuse.verify.coverage import routed_inputs, selected_experts
from onnx_moe_fuse.verify.report import OutputResult, PathResult

__all__ = ["wgpu_on_selected"]


def _node_and_router(fused: onnx.ModelProto) -> tuple[onnx.NodeProto, str, int] | None:
    inputs = {v.name for v in fused.graph.input}
    routed = routed_inputs(fused, inputs)
    nodes = [n for n in fused.graph.node if n.domain == "com.microsoft" and len(n.input) > 1
             and n.input[1] in routed]  # fmt: skip
    if len(nodes) != 1:
        return None
    node = nodes[0]
    op = ops.CONTRIB_OPS[node.op_type]
    norm = next((a.i for a in node.attribute if a.name == "normalize_routing_weights"),
                op.default("normalize_routing_weights"))  # fmt: skip
    if int(norm) != 1:
        return None
    return node, node.input[1], routed[node.input[1]]


def _restricted(
    fused: onnx.ModelProto, node: onnx.NodeProto, router: str, experts: int,
    chosen: np.ndarray, data_dir: Path,
) -> onnx.ModelProto | None:  # fmt: skip
    """``fused`` with ``node``'s expert-stacked weights cut to ``chosen`` (None: cannot)."""
    model = onnx.ModelProto()
    model.CopyFrom(fused)
    stacked = set(node.input[2:])
    inits = []
    for t in model.graph.initializer:
        if t.name not in stacked:
            inits.append(t)
            continue
        if not (t.dims and t.dims[0] == experts and is_external(t)):
            return None
        raw = map_external(t, data_dir, None, "fused region")
        rows = np.asarray(raw).reshape(experts, -1)[chosen]
        cut = onnx.TensorProto(name=t.name, data_type=t.data_type)
        cut.dims.extend([len(chosen), *t.dims[1:]])
        cut.raw_data = rows.tobytes()
        inits.append(cut)
    del model.graph.initializer[:]
    model.graph.initializer.extend(inits)
    for value in model.graph.input:
        if value.name == router:
            value.type.tensor_type.shape.dim[-1].Clear()
            value.type.tensor_type.shape.dim[-1].dim_value = len(chosen)
    return model


def _merge(into: PathResult, part: PathResult) -> None:
    if part.status == "skipped":  # e.g. no kernel package: the whole path is skipped
        into.status, into.reason = "skipped", part.reason
        return
    if part.status == "failed":
        into.status, into.reason = "failed", into.reason or part.reason
    for note in part.notes:
        if note not in into.notes:
            into.notes.append(note)
    for note in part.tolerance_notes:
        if note not in into.tolerance_notes:
            into.tolerance_notes.append(note)
    for name, out in part.outputs.items():
        merged = into.outputs.setdefault(name, OutputResult(name, out.dtype, out.rtol, out.atol))
        merged.per_seed.extend(out.per_seed)
        merged.problem = merged.problem or out.problem


def wgpu_on_selected(
    verify: Any,
    original: onnx.ModelProto,
    fused: onnx.ModelProto,
    data_dir: Path,
    feeds: Mapping[int, Mapping[str, np.ndarray]],
    references: Mapping[int, Mapping[str, np.ndarray]],
    limit: int | None,
    **options: Any,
) -> tuple[PathResult, list[str]] | None:
    """The wgpu path seed by seed on the selected experts; None where it cannot run so.

    ``verify`` is :func:`.checker.verify` (passed in: the checker imports nothing of this);
    ``options`` go to it (``quantization``). Returns the path's result over every seed and
    the failure messages.
    """
    found = _node_and_router(fused)
    if found is None or limit is None:
        return None
    node, router, k = found
    experts = next(iter(feeds.values()))[router].shape[-1]
    sizes = {t.name: int(np.prod(t.dims)) for t in fused.graph.initializer}
    result = PathResult("wgpu")
    messages: list[str] = []
    largest = 0
    for seed, given in feeds.items():
        chosen = np.array(sorted(selected_experts(given[router], k)), dtype=np.int64)
        model = _restricted(fused, node, router, experts, chosen, data_dir)
        if model is None:
            return None
        largest = max(largest, len(chosen))
        too_big = [n for n in node.input[2:] if n in sizes and
                   sum(len(t.raw_data) for t in model.graph.initializer if t.name == n) > limit]  # fmt: skip
        if too_big:
            return None
        cut_feeds = dict(given)
        cut_feeds[router] = np.ascontiguousarray(given[router][..., chosen])
        report = verify(original, model, seeds=[seed], paths=("wgpu",),
                        references={seed: references[seed]}, feeds={seed: cut_feeds},
                        **options)  # fmt: skip
        _merge(result, report.paths["wgpu"])
        messages.extend(report.messages)
        if result.status != "passed":
            break
    result.notes.append(
        f"{node.name or node.op_type}: ran seed by seed on the experts each seed selects (at most "
        f"{largest} of {experts}, their weights cut from the layer's): the whole layer is "
        "larger than the adapter binds"
    )
    return result, messages
