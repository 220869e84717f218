"""Why a layer did not fuse: the dry run's tracer, and the reasons for TopKs no rule matched.

:class:`NearMissTracer` keeps every match whose ``check`` failed, with the rules' own typed
refusal (:class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal`, read back from the failed
match), and every whole-pattern match the rewriter refused because a value escapes; a refusal
that defers to a canonicalisation pass (a dense layer the dense-experts pass left) is replaced
by the refusal that pass recorded while it ran. :func:`unrecognised` names the known unfused
form around a TopK no rule matched: a sort of the ids (grouped_mm), a one-hot mask (an expert
loop or the dense form), scattered dense weights; the canonical passes'
recorded refusals are appended where they have one. Nothing here re-runs a pass's analysis.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import onnx_ir as ir
from onnxscript.rewriter import pattern

from onnx_moe_fuse.pipeline.common import label
from onnx_moe_fuse.rewrites.graph.facts import escape_from, escape_where, value_label
from onnx_moe_fuse.rewrites.graph.refusals import (
    CAPACITY_DISPATCH,
    DENSE_EXPERTS,
    EXPERT_LOOP,
    MEANING,
    SORTED_EXPERTS,
    NearMiss,
    Refusal,
    RefusalTracer,
    recorded,
    refusal_of,
    source_label,
)
from onnx_moe_fuse.rewrites.moe.routers import router_near_miss

# onnxscript's matcher refuses a whole-pattern match whose nodes feed values outside the pattern
# with this reason (onnxscript/rewriter/_matcher.py); the tracer turns it into a named escape.
_ESCAPE_REASON = "Matched nodes have other uses preventing replacement."


@dataclass(frozen=True)
class Attempt:
    """One refused match of a layer rule: the rule, the combine it anchored at, the refusal.

    ``topk``, ``router``: the routing TopK and the Softmax/Sigmoid before it, from the match;
    ``values``: the nodes and values the refusal names, labelled when the match was logged.
    """

    rule: str
    root: ir.Node
    refusal: Refusal
    topk: ir.Node | None
    router: ir.Node | None
    values: tuple[str, ...]

    def near_miss(self) -> NearMiss:
        """The report's record of this attempt."""
        return NearMiss.of(
            self.refusal,
            rule=self.rule,
            values=self.values,
            node=label(self.root),
            root=label(self.root),
            topk=label(self.topk),
            router=label(self.router),
        )


def _escape_reason(nodes: Iterable[ir.Node], root: ir.Node) -> tuple[str, list[str]]:
    inside = set(nodes)
    escape = escape_from(inside, inside, skip=root)
    if escape is not None:
        node, out, user = escape
        name = out.name or f"output {out.index()} of {label(node)}"
        return (
            f"an intermediate value escapes the layer: '{name}' ({node.op_type} "
            f"'{label(node)}') is also {escape_where(user)}",
            [name],
        )
    return "an intermediate value of the layer is used outside it", []


class NearMissTracer(RefusalTracer):
    """A tracer that keeps every refused whole-layer match as an :class:`Attempt`.

    ``refusals``: what the canonicalisation passes recorded while they ran; a rule's refusal
    that defers to one of them (``Refusal.defer``) is replaced by the one recorded for its
    TopK, where that names a part.
    """

    def __init__(self, refusals: Sequence[Refusal] = ()) -> None:
        """Start with no attempts."""
        super().__init__()
        self.refusals = refusals
        self.attempts: list[Attempt] = []
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
        except ValueError:  # bindings of an unfinished alternative
            values = None
        if isinstance(values, ir.Value):
            topk = values.producer()
        sources = match_result.failure_nodes_and_values
        if escape:
            reason, names = _escape_reason(match_result.nodes, node)
            refusal = Refusal(reason)
        else:
            refusal = refusal_of(match_result) or Refusal(reason, *sources)
            # the rules' pattern is the combine alone: the refusal names the layer's TopK once
            # recognition found it; a weighted sum with no TopK behind it is no MoE layer
            topk = topk or refusal.topk
            if topk is None:
                return
            deferred = self._deferred(refusal)
            if deferred is not None:
                refusal, sources = deferred, deferred.failure_sources
            names = [source_label(s) for s in sources]
        scores = topk.inputs[0] if topk is not None and topk.inputs else None
        if scores is not None and scores.producer() is not None:
            if scores.producer().op_type in ("Softmax", "Sigmoid"):
                router = scores.producer()
        self.attempts.append(Attempt(str(rule), node, refusal, topk, router, tuple(names)))

    def _deferred(self, refusal: Refusal) -> Refusal | None:
        """The recorded refusal ``refusal`` defers to, where there is one naming a part."""
        if refusal.defer is None or refusal.topk is None:
            return None
        found = recorded(self.refusals, refusal.defer, refusal.topk)
        return found if found is not None and found.part is not None else None


#: How the reasons for a TopK no rule matched begin.
UNRECOGNISED = "not recognised: "


def meaning_near_miss(topk: ir.Node, departs: Refusal, reason: str) -> NearMiss:
    """The near miss of a TopK no rule matched, pointed by the analysis of meaning.

    ``departs``: the meaning pass's record (part, the first node whose meaning departs from
    the fused op's contract, what it computes there, what the layer needed); ``reason``: what
    the known-forms reasoning said (its "not recognised" head dropped), kept as context.
    """
    form = reason[len(UNRECOGNISED) :] if reason.startswith(UNRECOGNISED) else reason
    where = departs.node if departs.node is not None else topk
    return NearMiss(
        rule=None,
        part=departs.part,
        node=label(where),
        reason=f"{departs.reason} ({form})",
        root=None,
        topk=label(topk),
        router=None,
        values=tuple(value_label(v) for v in departs.failure_sources if isinstance(v, ir.Value)),
        value=None,
        expected=departs.expected,
    )


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


_CAPACITY_UNRECOGNISED = (
    "not recognised: a top-2 gate in argmax rounds that dispatches the tokens into per-expert "
    "capacity slots (DeepSpeed's top2gating), which the capacity-dispatch canonicalisation could "
    "not prove equal to the selected experts, so the layer is left as it is"
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


def _expert_ids(node: ir.Node) -> ir.Value | None:
    """The ids a TopK (output 1) or an ArgMax (output 0, a top-1 in torch exports) writes."""
    index = 0 if node.op_type == "ArgMax" else 1
    return node.outputs[index] if len(node.outputs) > index else None


def unrecognised(topk: ir.Node, refusals: Sequence[Refusal]) -> tuple[str | None, Refusal | None]:
    """Why a TopK / ArgMax whose ids select experts matched no rule, and a better refusal.

    The reason is None when the ids select nothing. The refusal is the dense-experts pass's,
    recorded in ``refusals`` while it ran, of a dense layer it recognised from this TopK's mask
    (for the dense reasons, one-hot or scattered ids, or none): it names the part, node and
    reason (a TopK over another axis, a router over other rows, weights that are graph
    inputs) and replaces the reason.
    """
    reason, dense_form = _unrecognised_reason(topk, refusals)
    dense = recorded(refusals, DENSE_EXPERTS, topk) if dense_form else None
    return reason, dense


def dense_near_miss(topk: ir.Node, dense: Refusal, router: ir.Node | None) -> NearMiss:
    """The near miss of a TopK whose dense layer the dense-experts pass recognised and left.

    It names the first node or value the pass's refusal names (else the TopK), and the values.
    """
    sources = dense.failure_sources
    where = sources[0] if sources else topk
    node = label(where) if isinstance(where, ir.Node) else value_label(where)
    return NearMiss(
        rule=None,
        part=dense.part,
        node=node,
        reason=dense.reason,
        root=None,
        topk=label(topk),
        router=label(router),
        values=tuple(value_label(v) for v in sources if isinstance(v, ir.Value)),
        value=value_label(dense.value) if dense.value is not None else None,
        expected=dense.expected,
    )


def _unrecognised_reason(topk: ir.Node, refusals: Sequence[Refusal]) -> tuple[str | None, bool]:
    """The reason, and whether the dense-experts pass's refusal may replace it.

    A router that MoE/QMoE cannot express is named first (:mod:`onnx_moe_fuse.rewrites.moe.routers`):
    it is the refusal even where the experts' spelling is one no rule takes.
    """
    ids = _expert_ids(topk)
    if ids is None or _sorts_expert_ids(topk):
        return None, True
    todo, seen, uses = [ids], 0, set()
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
    selects = uses & {
        "Gather",
        "GroupedMatMul",
        "GatherND",
        "GatherElements",
        "OneHot",
        "Equal",
        "argsort",
    }
    # a router no MoE/QMoE computes is the refusal, whatever else; ids scattered into a dense
    # [T, E] weights tensor (Llama4's code) select experts too
    router = router_near_miss(topk) if selects or "ScatterElements" in uses else None
    # a router fed as its selection and weights fuses where its experts do: a canonical pass's
    # record of why it left this layer (weights not constant, ...) says more
    passes_said = any(r.topk is topk and r.stage != MEANING for r in refusals)
    if router is not None and not passes_said:
        return router, False
    if "argsort" in uses:
        # the sorted-experts pass left this block: its refusal says which link it could not show
        detail = recorded(refusals, SORTED_EXPERTS, topk)
        if detail is None:
            return _SORTED_UNRECOGNISED, False
        return f"{_SORTED_UNRECOGNISED}; the sorted-experts pass: {detail.reason}", False
    if "ScatterElements" in uses and not selects:
        # ids scattered into dense [T, E] weights (gpt-oss's router): the dense-experts pass
        # left the layer, its refusal says which part it could not read (it records only layers
        # it recognised: DeepSeek's group selection scatters ids into a group mask)
        dense = recorded(refusals, DENSE_EXPERTS, topk)
        if dense is not None:
            return (
                f"{_DENSE_UNRECOGNISED}; the dense-experts pass: {dense.part}: {dense.reason}",
                True,
            )
    if uses & {"OneHot", "Equal"} and recorded(refusals, CAPACITY_DISPATCH, topk) is not None:
        return _CAPACITY_UNRECOGNISED, True  # its record names the part and node
    if uses & {"OneHot", "Equal"}:
        # the expert-loop pass left this layer: its refusal says which link it could not show
        detail = recorded(refusals, EXPERT_LOOP, topk)
        if detail is not None:
            return f"{_ONE_HOT_UNRECOGNISED}; the expert-loop pass: {detail.reason}", True
        return _ONE_HOT_UNRECOGNISED, True
    if uses & {"Gather", "GroupedMatMul", "GatherND", "GatherElements"}:
        return GENERIC_UNRECOGNISED, False
    return None, True


#: The parts in the order the layer computes them (the routing selects before any of them).
_LAYER_ORDER = ("routing", "tokens", "fc1", "activation", "fc2", "combine")


#: The parts whose rule refusals are about the form alone where the analysis of meaning read
#: them: the rows a projection reads and the projection itself are index semantics, which the
#: analysis reads whatever the spelling (activations, FC2 and the combine it reads as terms
#: whose behaviour the rules prove, so their refusals stay the reason).
_FORM_PARTS = ("tokens", "fc1")


def departs_before(departs: Refusal, refusal: Refusal) -> bool:
    """Whether the analysis of meaning's departure, not the rule's refusal, names the layer's node.

    Where the meaning departs at a part before the one the rule failed at (its failure follows),
    or after a tokens/FC1 refusal of the rule: the analysis read those rows and projections as
    the contract's, so the rule's failure there was its form, and the meaning's node is the
    first that departs. Expert weights the analysis found not constant (part ``weights``) are
    named whatever else the rule failed at (its own "expert weights not constant" stays): no
    fused node holds them.
    """
    if refusal.part is None:
        return True
    if departs.part == "weights":  # expert weights not constant: no part of the layer is the op's
        return "expert weights not constant" not in refusal.reason  # unless the rule said so
    if departs.part not in _LAYER_ORDER or refusal.part not in _LAYER_ORDER:
        return False
    at, failed = _LAYER_ORDER.index(departs.part), _LAYER_ORDER.index(refusal.part)
    return at < failed or (at > failed and refusal.part in _FORM_PARTS)


def pointing_record(refusals: list[Refusal], topk: ir.Node) -> Refusal | None:
    """The record that points at the node for ``topk``: a layer-form pass's, else the meaning pass's.

    A loop, dense or sorted pass that recognised the layer and left it knows the precise fact
    (weights that are graph inputs, a sort not undone): its record stays the reason (None when
    it names no part, the meaning pass's points instead).
    """
    named = [r for r in refusals if r.topk is topk and r.stage != MEANING and r.part is not None]
    return named[0] if named else recorded(refusals, MEANING, topk)
