"""Why a layer did not fuse: the dry-run tracer, and the reasons for TopKs no rule matched.

:class:`NearMissTracer` records every match whose ``check`` failed (with the part, node and
reason) and every whole-pattern match the rewriter refused because a value escapes.
:func:`_unrecognised_reason` names the known unfused form around a TopK no rule matched: a sort
of the ids (grouped_mm), a one-hot mask (an expert loop or the dense form), scattered dense
weights, float16 routing; the canonical passes' own refusals are appended where they have one.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import onnx_ir as ir
from onnxscript.rewriter import pattern

from onnx_moe_fuse.pipeline.common import (
    label,
    source_label,
)
from onnx_moe_fuse.rewrites.canonical.experts.dense.dense_experts import (
    DenseRefusal,
    dense_refusal_for,
)
from onnx_moe_fuse.rewrites.canonical.experts.loops.expert_loop import loop_refusal_for
from onnx_moe_fuse.rewrites.canonical.experts.sorted.sorted_experts import sorted_refusal_for
from onnx_moe_fuse.rewrites.moe.routers import router_near_miss

# onnxscript's matcher refuses a whole-pattern match whose nodes feed values outside the pattern
# with this reason (onnxscript/rewriter/_matcher.py); the tracer turns it into a named escape.
_ESCAPE_REASON = "Matched nodes have other uses preventing replacement."


@dataclass
class _Attempt:
    rule: str
    root: ir.Node
    reason: str
    topk: ir.Node | None
    router: ir.Node | None
    values: list[str]


def _escape_reason(nodes: Iterable[ir.Node], root: ir.Node) -> tuple[str, list[str]]:
    inside = set(nodes)
    for node in inside:
        for out in node.outputs:
            if node is root:
                continue
            if out.is_graph_output():
                where = "a graph output"
            else:
                users = [u for u, _ in out.uses() if u not in inside]
                if not users:
                    continue
                where = f"used by {users[0].op_type} '{label(users[0])}' outside the layer"
            name = out.name or f"output {out.index()} of {label(node)}"
            return (
                f"an intermediate value escapes the layer: '{name}' ({node.op_type} "
                f"'{label(node)}') is also {where}",
                [name],
            )
    return "an intermediate value of the layer is used outside it", []


class NearMissTracer(pattern.MatchingTracer):
    """A tracer that keeps every refused whole-layer match (the base keeps only the best)."""

    def __init__(self) -> None:
        """Start with no attempts."""
        super().__init__()
        self.attempts: list[_Attempt] = []
        self.successes: set[int] = set()

    def log(self, rule, container, node, match_result, status) -> None:  # noqa: D102
        if status == pattern.MatchStatus.SUCCESS:
            self.successes.add(id(node))
            return
        reason = match_result.reason
        escape = status == pattern.MatchStatus.NO_MATCH and reason == _ESCAPE_REASON
        if status == pattern.MatchStatus.NO_MATCH and not escape:
            return
        topk = router = None
        try:
            values = match_result.bindings.get("topk_values")
            scores = match_result.bindings.get("router_scores")
        except ValueError:  # bindings of an unfinished alternative
            values = scores = None
        if isinstance(values, ir.Value):
            topk = values.producer()
        if isinstance(scores, ir.Value) and scores.producer() is not None:
            if scores.producer().op_type in ("Softmax", "Sigmoid"):
                router = scores.producer()
        if escape:
            reason, names = _escape_reason(match_result.nodes, node)
        else:
            names = [source_label(s) for s in match_result.failure_nodes_and_values]
        self.attempts.append(_Attempt(str(rule), node, reason, topk, router, names))


_SHAPE_ONLY = ("Reshape", "Unsqueeze", "Squeeze", "Flatten", "Cast")


GENERIC_UNRECOGNISED = (
    "not recognised: the indices of this TopK select experts, but no MoE layer rule matched the "
    "layer around it (its routing, expert, activation or combine spelling is not one the rules "
    "know)"
)


_SORTED_UNRECOGNISED = (
    "not recognised: the expert ids of this TopK are sorted (a TopK over the flattened ids, i.e. "
    "an argsort) so that each expert's rows are computed as a group of their own, the sorted "
    "per-expert form of grouped_mm exports; no rule takes that spelling, so the layer is left "
    "as it is"
)


_ONE_HOT_UNRECOGNISED = (
    "not recognised: the experts are chosen by a one-hot mask of this TopK's indices (a dense "
    "all-experts form, or a loop over the experts such as a traced eager loop with NonZero per "
    "expert), and the dense-experts canonicalisation could not prove it equal to the selected "
    "experts (a trace of a data-dependent loop may hold only the experts its example input hit), "
    "so the layer is left as it is"
)


_DENSE_UNRECOGNISED = (
    "not recognised: the experts are weighted by this TopK's values scattered into dense [T, E] "
    "routing weights (a dense all-experts form), and the dense-experts canonicalisation could "
    "not prove it equal to the selected experts, so the layer is left as it is"
)


def _sorts_expert_ids(topk: ir.Node) -> bool:
    """True for a TopK that sorts expert ids ascending (an argsort, not a router).

    The ids are another TopK's indices or an ArgMax's (PhiMoE's two top-1 rounds, concatenated)
    through shape-only ops.
    """
    attr = topk.attributes.get("largest")
    if attr is None or attr.value != 0:
        return False
    return _are_expert_ids(topk.inputs[0] if topk.inputs else None, 8)


def _are_expert_ids(v: ir.Value | None, depth: int) -> bool:
    """Whether ``v`` holds a router's choices: TopK indices, ArgMax ids, a Concat of them."""
    node = v.producer() if v is not None else None
    if node is None or depth == 0:
        return False
    if node.op_type == "TopK":
        return v.index() == 1  # type: ignore[union-attr]
    if node.op_type == "ArgMax":
        return True
    if node.op_type == "Concat":
        return bool(node.inputs) and all(_are_expert_ids(i, depth - 1) for i in node.inputs)
    if node.op_type not in _SHAPE_ONLY:
        return False
    return _are_expert_ids(node.inputs[0], depth - 1)


_HALF = {ir.DataType.FLOAT16: "float16", ir.DataType.BFLOAT16: "bfloat16"}


def _half_precision(node: ir.Node) -> set[str]:
    """The half-precision float types among ``node``'s inputs."""
    return {_HALF[v.dtype] for v in node.inputs if v is not None and v.dtype in _HALF}


def _expert_ids(node: ir.Node) -> ir.Value | None:
    """The ids a TopK (output 1) or an ArgMax (output 0, a top-1 in torch exports) writes."""
    index = 0 if node.op_type == "ArgMax" else 1
    return node.outputs[index] if len(node.outputs) > index else None


def _half_precision_near(topk: ir.Node, depth: int = 6) -> set[str]:
    """Half-precision types among the values a few nodes downstream of a TopK.

    A float16 export routes in float32 (the router softmax is upcast) and computes the experts
    and the combine in float16: the weights meet the float16 expert outputs a few nodes on.
    """
    found: set[str] = set()
    frontier, seen = [topk], {id(topk)}
    for _ in range(depth):
        nxt = []
        for node in frontier:
            for v in node.outputs:
                if v.dtype in _HALF:
                    found.add(_HALF[v.dtype])
                for user, _ in v.uses():
                    if id(user) not in seen:
                        seen.add(id(user))
                        found.update(_half_precision(user))
                        nxt.append(user)
        frontier = nxt
    return found


def unrecognised_reason(topk: ir.Node) -> str | None:
    """Why a TopK / ArgMax whose ids select experts matched no rule (None: they select nothing).

    A router that MoE/QMoE cannot express is named first (:mod:`onnx_moe_fuse.rewrites.moe.routers`):
    it is the refusal even where the experts' spelling is one no rule takes.
    """
    ids = _expert_ids(topk)
    if ids is None or _sorts_expert_ids(topk):
        return None
    todo, seen, uses = [ids], 0, set()
    half: set[str] = set()
    while todo and seen < 8:
        v = todo.pop()
        seen += 1
        for user, _ in v.uses():
            if user.op_type in _SHAPE_ONLY:
                todo.extend(user.outputs)
            elif user.op_type == "TopK" and _sorts_expert_ids(user):
                uses.add("argsort")
            else:
                uses.add(user.op_type)
                half.update(_half_precision(user))
    selects = uses & {
        "Gather",
        "GroupedMatMul",
        "GatherND",
        "GatherElements",
        "OneHot",
        "Equal",
        "argsort",
    }
    half.update(_half_precision(topk))
    half.update(_half_precision_near(topk))
    if selects and half:
        return (
            f"not fused: the layer computes in {'/'.join(sorted(half))}; this version fuses "
            "float32 layers only (float16/bfloat16 layers are left as they are)"
        )
    # a router no MoE/QMoE computes is the refusal, whatever else; ids scattered into a dense
    # [T, E] weights tensor (Llama4's code) select experts too
    router = router_near_miss(topk) if selects or "ScatterElements" in uses else None
    if router is not None:
        return router
    if "argsort" in uses:
        # the sorted-experts pass left this block: its proof says which link it could not show
        detail = sorted_refusal_for(topk)
        if detail is None:
            return _SORTED_UNRECOGNISED
        return f"{_SORTED_UNRECOGNISED}; the sorted-experts pass: {detail}"
    if "ScatterElements" in uses and not selects:
        # ids scattered into dense [T, E] weights (gpt-oss's router): the dense-experts pass
        # left the layer, its refusal says which part it could not read
        # (only a recognised layer: DeepSeek's group selection scatters ids into a group mask)
        dense = dense_refusal_for(topk)
        if dense is not None and dense.recognised:
            return f"{_DENSE_UNRECOGNISED}; the dense-experts pass: {dense.part}: {dense.reason}"
    if uses & {"OneHot", "Equal"}:
        # the expert-loop pass left this layer: its proof says which link it could not show
        detail = loop_refusal_for(topk)
        if detail is not None:
            return f"{_ONE_HOT_UNRECOGNISED}; the expert-loop pass: {detail}"
        return _ONE_HOT_UNRECOGNISED
    if uses & {"Gather", "GroupedMatMul", "GatherND", "GatherElements"}:
        return GENERIC_UNRECOGNISED
    return None


def recognised_dense(topk: ir.Node, reason: str | None) -> DenseRefusal | None:
    """The dense-experts pass's refusal of a dense layer it recognised, where it explains more.

    For the dense messages (one-hot or scattered ids) only: the pass read this TopK's mask, so
    the layer is a dense MoE, and its refusal names the part, node and reason (a TopK over
    another axis, a router over other rows, weights that are graph inputs).
    """
    if reason is not None and not reason.startswith((_ONE_HOT_UNRECOGNISED, _DENSE_UNRECOGNISED)):
        return None
    dense = dense_refusal_for(topk)
    return dense if dense is not None and dense.recognised else None
