"""Which source columns feed each output column of a region (derived symbolically, not probed).

Along the feature (last) axis an element-wise op keeps columns apart: column ``j`` of its
output reads column ``j`` of each operand (or the one column of a broadcast operand). Only
``Slice``, ``Split`` and ``Gather`` of constant indices on the last axis route columns. So the
source columns behind every output column follow from the graph alone: :func:`column_sources`
propagates, per value, an ``int`` array ``[width, 2]`` of the global source columns (the sources'
columns numbered one after the other, -1 where there is none) and fails when a column mixes more
than two source columns (no fused activation reads three), when a column op cuts another axis,
or when a constant of the arithmetic varies along the features (then columns would compute
different functions, which no fused activation does; a probe of some columns would not speak
for the others). With those facts, every output column computes the same function of its
source columns, which is what lets :mod:`.probes` spread its grid over the columns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.facts import attr_int, label, value_label
from onnx_moe_fuse.rewrites.graph.refusals import Refusal
from onnx_moe_fuse.rewrites.moe.behaviour.interpret import COLUMN_OPS
from onnx_moe_fuse.rewrites.moe.behaviour.region import Region

__all__ = ["column_sources"]

_NONE = -1


def _union(parts: list[np.ndarray], node: ir.Node, what: str) -> np.ndarray:
    """Per row, the distinct source columns of ``parts`` (each ``[W or 1, 2]``), at most two."""
    width = max(p.shape[0] for p in parts)
    if any(p.shape[0] not in (1, width) for p in parts):
        raise Refusal(
            f"{what}: '{label(node)}' combines operands of {[p.shape[0] for p in parts]} columns",
            node,
        )
    distinct = [p for i, p in enumerate(parts) if not any(p is q for q in parts[:i])]
    if len(distinct) == 1 or all(np.array_equal(p, distinct[0]) for p in distinct[1:]):
        return np.broadcast_to(distinct[0], (width, 2))  # the same columns (x * sigmoid(x))
    singles = [p for p in distinct if p.shape[0] == width and (p[:, 1] == _NONE).all()]
    if len(distinct) == 2 and len(singles) == 2:  # one column each: the common case, no sort
        a, b = singles[0][:, 0], singles[1][:, 0]
        lo, hi = np.minimum(a, b), np.maximum(a, b)
        return np.stack([lo, np.where(lo == hi, _NONE, hi)], axis=1)
    cat = np.concatenate([np.broadcast_to(p, (width, 2)) for p in parts], axis=1)
    cat = np.sort(cat, axis=1)
    dup = np.zeros_like(cat, dtype=bool)
    dup[:, 1:] = cat[:, 1:] == cat[:, :-1]
    cat = np.where(dup, _NONE, cat)
    cat = -np.sort(-cat, axis=1)  # valid columns first (descending), -1 last
    if (cat[:, 2:] != _NONE).any():
        row = int(np.nonzero((cat[:, 2:] != _NONE).any(axis=1))[0][0])
        raise Refusal(
            f"{what}: column {row} of '{value_label(node.outputs[0])}' ({node.op_type} "
            f"'{label(node)}') reads more than two FC1 columns ({sorted(set(cat[row]) - {-1})})",
            node,
        )
    pair = cat[:, :2]
    lo = np.where(pair[:, 1] == _NONE, pair[:, 0], pair[:, 1])
    hi = np.where(pair[:, 1] == _NONE, _NONE, pair[:, 0])
    return np.stack([lo, hi], axis=1)


def _last_axis(node: ir.Node, axes: Sequence[int] | None, rank: int, what: str) -> None:
    if axes is None or [a % rank for a in axes] != [rank - 1]:
        raise Refusal(
            f"{what}: {node.op_type} '{label(node)}' does not cut the feature (last) axis alone "
            f"(axes {axes})",
            node,
        )


def _ints(value: ir.Value | None, constants: Mapping) -> list[int] | None:
    arr = constants.get(value) if value is not None else None
    return None if arr is None else [int(v) for v in np.asarray(arr).reshape(-1)]


def _route(
    node: ir.Node, deps: np.ndarray, rank: int, what: str, constants: Mapping
) -> list[np.ndarray]:
    """The source columns of a column op's outputs, from those of its data input."""
    width = deps.shape[0]
    if node.op_type == "Slice":
        starts, ends = _ints(node.inputs[1], constants), _ints(node.inputs[2], constants)
        axes = _ints(node.inputs[3], constants) if len(node.inputs) > 3 and node.inputs[3] else None
        steps = (
            _ints(node.inputs[4], constants) if len(node.inputs) > 4 and node.inputs[4] else None
        )
        if starts is None or ends is None:
            raise Refusal(f"{what}: Slice '{label(node)}' has bounds that are not constant", node)
        _last_axis(node, axes if axes is not None else list(range(len(starts))), rank, what)
        step = 1 if steps is None else steps[0]
        if step == 0:
            raise Refusal(f"{what}: Slice '{label(node)}' has step 0", node)
        return [deps[np.arange(width)[slice(starts[0], ends[0], step)]]]
    if node.op_type == "Split":
        _last_axis(node, [attr_int(node, "axis", 0) or 0], rank, what)
        sizes = (
            _ints(node.inputs[1], constants) if len(node.inputs) > 1 and node.inputs[1] else None
        )
        if sizes is None and "split" in node.attributes:
            sizes = [int(v) for v in node.attributes["split"].value]
        parts = len(node.outputs)
        if sizes is None:
            each = -(-width // parts)
            sizes = [min(each, width - i * each) for i in range(parts)]
        if sum(sizes) != width or len(sizes) != parts:
            raise Refusal(f"{what}: Split '{label(node)}' sizes {sizes} != {width} columns", node)
        bounds = np.cumsum([0, *sizes])
        return [deps[bounds[i] : bounds[i + 1]] for i in range(parts)]
    # Gather
    _last_axis(node, [attr_int(node, "axis", 0) or 0], rank, what)
    idx = constants.get(node.inputs[1])
    if idx is None or np.asarray(idx).ndim != 1:
        raise Refusal(
            f"{what}: Gather '{label(node)}' does not take constant 1-D column indices", node
        )
    return [deps[np.asarray(idx).astype(np.int64) % width]]


def _uniform(node: ir.Node, value: ir.Value, what: str, constants: Mapping) -> None:
    arr = constants.get(value)
    if arr is None or np.asarray(arr).size <= 1:
        return
    flat = np.asarray(arr).reshape(-1)
    if not (np.all(flat == flat[0]) or np.all(np.isnan(flat))):
        raise Refusal(
            f"{what}: the constant '{value_label(value)}' of {node.op_type} '{label(node)}' "
            "varies along the features; a fused activation computes one function of each column",
            value,
        )


def column_sources(region: Region, widths: Sequence[int], rank: int, what: str) -> np.ndarray:
    """``[W_out, 2]``: the global source columns of each output column (ascending; -1: none).

    ``widths`` are the sources' feature widths (the global columns number them one after the
    other), ``rank`` their rank (the feature axis is ``rank - 1``).
    """
    deps: dict[ir.Value, np.ndarray] = {}
    offset = 0
    for src, w in zip(region.sources, widths, strict=True):
        cols = offset + np.arange(w)
        deps[src] = np.stack([cols, np.full(w, _NONE)], axis=1)
        offset += w
    for node in region.nodes:
        data = [v for v in node.inputs if v is not None and v in deps]
        if node.op_type in COLUMN_OPS:
            src = node.inputs[0]
            if src is None or src not in deps:
                continue  # a cut of constants only
            for out, d in zip(
                node.outputs, _route(node, deps[src], rank, what, region.constants), strict=False
            ):
                deps[out] = d
            continue
        for v in node.inputs:
            if v is not None and v not in deps:
                _uniform(node, v, what, region.constants)
        if data:
            deps[node.outputs[0]] = _union([deps[v] for v in data], node, what)
    out = deps.get(region.output)
    if out is None:
        raise Refusal(f"{what} '{value_label(region.output)}' reads no FC1 column", region.output)
    return out
