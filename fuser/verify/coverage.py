"""Random inputs under which every expert of a fused layer computes (per-layer verification).

Random router scores pick experts at random: 3 seeds of 5 tokens at top-8 select about 78 of a
Qwen3-30B-A3B layer's 128 experts, so the repacked weights of about 50 experts were never
compared. :func:`covering_feeds` draws the verifier's usual inputs (:func:`.feeds.random_feeds`,
one set per seed) and then, for a fused ``MoE`` / ``QMoE`` node that selects the top-k of a
router input of the layer itself (no ``router_weights``, no sparse mixer), reorders that
input's values row by row: the rows of the seeds take the experts of a random permutation, k
at a time, as their top k. Each row keeps the values it was drawn with (only which expert gets
which value changes), so the scores are still fresh random draws, distinct, and the weights
the router gives are as random as before. When the seeds' rows are too few for every expert,
seeds are added (the next integers), with only the rows still needed when the router input is
``[rows, E]`` with ``rows`` a symbolic dim (the other inputs sharing that dim follow).

What ran is counted, not assumed: :func:`selected_experts` takes each row's top k of the
feeds as they are (the fused op's selection by its definition) and the record says how many of
the layer's experts were selected. Every selected expert's output enters the compared layer
output of its token with its routing weight, so a fused expert whose weights move that output
beyond the tolerance fails the layer (``docs/verification.md``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from onnx_moe_fuse.contract import ops
from onnx_moe_fuse.verify.feeds import random_feeds

__all__ = ["covering_feeds", "routed_inputs", "selected_experts"]


def _attr(node: onnx.NodeProto, name: str, op: ops.ContribOp) -> Any:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return op.default(name)


def routed_inputs(fused: onnx.ModelProto, inputs: set[str]) -> dict[str, int]:
    """``{router input: k}`` for each fused MoE/QMoE node selecting the top k of a graph input.

    Only nodes whose selection is the top k of their ``router_probs`` (softmax keeps the order)
    qualify: no ``router_weights`` input (a router kept as the model wrote it) and no sparse
    mixer; and ``router_probs`` must be one of ``inputs`` (the layer's random inputs).
    """
    found: dict[str, int] = {}
    for node in fused.graph.node:
        if node.domain != "com.microsoft" or node.op_type not in ("MoE", "QMoE"):
            continue
        op = ops.CONTRIB_OPS[node.op_type]
        named = op.named_inputs(list(node.input))
        if named.get("router_weights") or _attr(node, "use_sparse_mixer", op):
            continue
        router = named.get("router_probs")
        if router in inputs:
            found[router] = int(_attr(node, "k", op))
    return found


def selected_experts(scores: np.ndarray, k: int) -> set[int]:
    """The experts the rows of ``scores`` (``[..., E]``) select as their top ``k``."""
    rows = np.asarray(scores, dtype=np.float64).reshape(-1, scores.shape[-1])
    top = np.argsort(-rows, axis=1, kind="stable")[:, :k]
    return {int(e) for e in top.reshape(-1)}


def _cover(rows: list[np.ndarray], k: int, rng: np.random.Generator) -> None:
    """Give rows ``i = 0, 1, ...`` a permutation's experts ``[i k, (i + 1) k)`` as top k, in place."""
    experts = rows[0].shape[-1]
    perm = rng.permutation(experts)
    for i, row in enumerate(rows):
        group = perm[i * k : (i + 1) * k]
        if not len(group):
            return
        if len(group) < k:  # the last group: made up with other experts
            others = np.setdiff1d(np.arange(experts), group)
            group = np.concatenate([group, rng.choice(others, k - len(group), replace=False)])
        ordered = np.sort(row)[::-1]
        if ordered[k - 1] == ordered[k]:  # a tie at the boundary (half precision): left as drawn
            continue
        rest = np.setdiff1d(np.arange(experts), group)
        row[group] = rng.permutation(ordered[:k])
        row[rest] = rng.permutation(ordered[k:])


def _row_dim(model: onnx.ModelProto, name: str) -> str | None:
    """The symbolic dim of ``name``'s rows when it is ``[rows, E]`` with ``rows`` symbolic."""
    for value in model.graph.input:
        if value.name == name:
            dims = value.type.tensor_type.shape.dim
            if len(dims) == 2 and dims[0].HasField("dim_param"):
                return dims[0].dim_param
    return None


def covering_feeds(
    original: onnx.ModelProto,
    fused: onnx.ModelProto,
    seeds: Sequence[int],
    dim_values: Mapping[str, int],
) -> tuple[dict[int, dict[str, np.ndarray]], list[dict[str, Any]]]:
    """Each seed's random inputs of ``original``, reordered to select every expert; the records.

    Returns ``{seed: feeds}`` (the given seeds, then any added) and one record per routed
    input: ``{"router", "experts", "selected", "seeds"}``, ``selected`` counted from the feeds.
    """
    seeds = [int(s) for s in seeds]
    feeds = {s: random_feeds(original, s, dim_values) for s in seeds}
    routed = routed_inputs(fused, set(feeds[seeds[0]]))
    records = []
    for router, k in routed.items():
        shape = feeds[seeds[0]][router].shape
        experts, rows = shape[-1], math.prod(shape[:-1])
        if not (0 < k < experts) or rows == 0:
            continue
        needed = math.ceil(experts / k)
        row_dim = _row_dim(original, router)
        have = sum(math.prod(f[router].shape[:-1]) for f in feeds.values())
        while have < needed:  # more seeds, with only the rows still needed where they can
            extra = max(feeds) + 1
            dims = dict(dim_values)
            if row_dim is not None:
                dims[row_dim] = min(int(dims.get(row_dim, rows)), needed - have)
            feeds[extra] = random_feeds(original, extra, dims)
            have += math.prod(feeds[extra][router].shape[:-1])
        views = [feeds[s][router].reshape(-1, experts) for s in feeds]
        all_rows = [row for view in views for row in view][:needed]
        _cover(all_rows, k, np.random.default_rng([*feeds, experts, k]))
        chosen: set[int] = set()
        for s in feeds:
            chosen |= selected_experts(feeds[s][router], k)
        records.append(
            {"router": router, "experts": experts, "selected": len(chosen), "seeds": list(feeds)}
        )
    return feeds, records
