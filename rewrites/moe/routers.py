"""Recognise the router around a TopK and say, in plain words, which form it is.

``com.microsoft.MoE`` / ``QMoE`` route one way only: a softmax over all experts, top-k, and
optionally the k weights renormalised to sum 1 (TopK of the logits then a softmax over the k
values is the same thing). Many MoE models route otherwise: sigmoid scores (Llama4), a bias added
for the choice only with the weights taken from the unbiased scores and a group-limited top-k
(DeepSeek-V3), a constant scaling factor on the weights, PhiMoE's sparse mixer. The layer rules
refuse those layers, and without this module the report could only say that "no rule matched".
:func:`classify_router` reads the graph around one TopK (or ArgMax, a top-1 that torch exports
for ``max(dim)``) and returns a :class:`RouterForm`; :func:`router_near_miss` turns a form the
fused ops cannot express into the refusal sentence of a near miss.

The module only reads the graph. It walks back from what the selection reads (through reshapes,
casts, masks and constant biases, to the Softmax/Sigmoid or the router projection) and forward
from the values and indices (the softmax/sigmoid of the k values, a GatherElements that takes the
weights from another tensor, renormalisation, a constant factor). Every walk is bounded, and any
graph it cannot read is classified ``"unknown"``; it never raises.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.facts import label
from onnx_moe_fuse.rewrites.moe.router_walks import (
    SELECTORS,
    Groups,
    Selection,
    Weights,
    backward_cone,
    const_like,
    feeds_selection,
    gathers_experts,
    group_limit,
    is_argsort,
    on_last_axis,
    scalar,
    skip_back,
    topk_k,
    trace_selection,
    trace_weights,
)

__all__ = [
    "FUSABLE_KINDS",
    "SELECTED",
    "KINDS",
    "RouterForm",
    "classify_router",
    "router_near_miss",
]

#: The router forms MoE / QMoE compute (softmax over all experts, top-k, optional renormalising).
FUSABLE_KINDS = frozenset({"softmax_topk", "softmax_topk_renorm", "topk_softmax"})
KINDS = FUSABLE_KINDS | {
    "sigmoid_topk",
    "topk_sigmoid",
    "biased_selection",
    "group_limited_topk",
    "scaled",
    "sparse_mixer",
    "argsort",
    "unknown",
}


@dataclass(frozen=True)
class RouterForm:
    """What the router around one TopK computes.

    ``kind`` is one of :data:`KINDS`; ``fusable`` says whether MoE/QMoE can express it;
    ``scores`` is the node computing the router scores (the Softmax/Sigmoid before or after the
    TopK, else the producer of what the TopK reads); ``description`` says it in plain words.
    """

    kind: str
    fusable: bool
    topk: ir.Node
    scores: ir.Node | None
    description: str


def classify_router(topk: ir.Node) -> RouterForm:
    """Classify the router around ``topk`` (a TopK or ArgMax node); ``"unknown"`` if unreadable."""
    try:
        return _classify(topk)
    except Exception as err:  # a graph this module does not expect: say so, never raise
        return RouterForm("unknown", False, topk, None, f"not readable as a router ({err!r})")


def router_near_miss(topk: ir.Node) -> str | None:
    """The refusal sentence for a router MoE/QMoE cannot express, else None.

    None when the router is fusable, when ``topk`` is no router (an argsort of expert ids, a
    group-selection step whose result only masks another TopK, a form this module cannot name).
    """
    form = classify_router(topk)
    why = _WHY.get(form.kind)
    if form.fusable or why is None or form.description.startswith(_GROUP_STEP):
        return None
    return (
        f"router not fused ({_HEADS[form.kind]}): {topk.op_type} '{label(topk)}' routes by "
        f"{form.description}; {why}"
    )


_GROUP_STEP = "a group-selection step"
_HEADS = {
    "sigmoid_topk": "sigmoid routing",
    "topk_sigmoid": "sigmoid routing",
    "biased_selection": "biased selection",
    "group_limited_topk": "group-limited top-k",
    "scaled": "scaling factor",
    "sparse_mixer": "sparse mixer",
}
#: A router of these kinds fuses (fed as its selection and weights) when its weights multiply
#: the expert outputs; a near miss for a TopK no layer rule matched says what is missing.
_SELECTED = (
    "the fused node takes any top-k selection whose per-selected non-negative weights multiply "
    "the expert outputs (the router kept as written), but no layer rule matched around this "
    "TopK: its weights do not multiply the outputs of experts chosen by its indices (they scale "
    "the expert input, or the experts are in a form the analysis of meaning does not read)"
)
#: (public: the pipeline names the analysis of meaning's node where a router of these kinds is
#: read past, into the experts)
SELECTED = _SELECTED
_WHY = {
    "sigmoid_topk": _SELECTED,
    "topk_sigmoid": _SELECTED,
    "biased_selection": _SELECTED,
    "group_limited_topk": _SELECTED,
    "scaled": _SELECTED,
    # the rounds are the columns of one TopK (graph.selection_rounds): a selection to feed
    "sparse_mixer": _SELECTED,
}


# -- the classification --------------------------------------------------------------------------


def _classify(node: ir.Node) -> RouterForm:
    if node.op_type not in SELECTORS or not node.inputs or node.inputs[0] is None:
        return RouterForm("unknown", False, node, None, f"a {node.op_type}, not a top-k")
    if is_argsort(node):
        return RouterForm("argsort", False, node, None, "an ascending sort of expert ids")
    selected = skip_back(node.inputs[0])
    sel = trace_selection(node.inputs[0])
    read = node.inputs[0].producer()
    # a TopK whose result only shapes what a later TopK reads is a step of that router (the
    # group choice of a group-limited top-k), not a router of its own
    later = None if gathers_experts(node) else feeds_selection(node)
    if later is not None:
        groups = group_limit([node.outputs[0]]) if node.op_type == "TopK" else None
        what = "scores the groups" if groups is None else "chooses the top groups"
        text = f"{_GROUP_STEP} (it {what}); the experts are chosen by '{label(later)}'"
        fns = [n for n in backward_cone([node.inputs[0]]) if n.op_type in ("Softmax", "Sigmoid")]
        return RouterForm("group_limited_topk", False, node, (fns or [read])[0], text)
    w = trace_weights(node, selected)
    groups = group_limit(sel.masks) if sel.masks else None
    kind = _kind(node, sel, w, groups)
    scores = sel.score or w.post or w.source or read
    if kind == "sparse_mixer":
        scores = sel.stop or read  # the logits both rounds read; each round has its own softmax
    return RouterForm(kind, kind in FUSABLE_KINDS, node, scores, _describe(node, sel, w, groups))


def _kind(node: ir.Node, sel: Selection, w: Weights, groups: Groups | None) -> str:
    score = sel.score
    if score is not None and not on_last_axis(score):
        return "unknown"  # a softmax over some other axis than the experts
    if not on_last_axis(node):
        return "unknown"
    if w.threshold is not None:
        return "sparse_mixer"
    if groups is not None:
        return "group_limited_topk"
    if sel.biases and (w.gathered is not None or score is not None):
        return "biased_selection"
    if score is not None and w.post is not None:
        return "unknown"  # a score function before and after the selection
    if sel.masks or (w.gathered is not None and w.source is None):
        return "unknown"  # masked or gathered in a way this module does not name
    sigmoid = "Sigmoid" in {getattr(score, "op_type", None), getattr(w.source, "op_type", None)}
    if sigmoid:
        return "sigmoid_topk"
    if w.post is not None and w.post.op_type == "Sigmoid":
        return "topk_sigmoid" if score is None else "unknown"
    if w.scale is not None and (score is not None or w.post is not None):
        return "scaled"
    if score is not None and w.post is None:
        return "softmax_topk_renorm" if w.renorm is not None else "softmax_topk"
    if score is None and w.post is not None and w.renorm is None:
        return "topk_softmax"
    return "unknown"


def _describe(node: ir.Node, sel: Selection, w: Weights, groups: Groups | None) -> str:
    k = topk_k(node)
    top = f"top-{k}" if k is not None else "top-k"
    score = sel.score.op_type if sel.score is not None else None
    logits = f"the router logits ('{label(sel.stop)}')" if sel.stop else "the router logits"
    fn = {"Softmax": "a softmax over the experts", "Sigmoid": "sigmoid scores"}.get(score)
    parts = [f"{fn} ('{label(sel.score)}')" if fn else logits]
    if sel.biases:
        names = ", ".join(f"'{_bias_name(b)}'" for b in sel.biases)
        parts.append(f"with a selection bias ({names}) added for the choice only")
    if groups is not None:
        of = f" of {groups.groups}" if groups.groups is not None else ""
        kept = topk_k(groups.topk) or "k"
        style = " (DeepSeek-V3 style)" if score == "Sigmoid" and sel.biases else ""
        parts.append(
            f"and group-limited {top} (the top {kept}{of} groups, each scored by "
            f"{groups.per_group}){style}"
        )
    else:
        pick = "argmax (top-1)" if node.op_type == "ArgMax" else top
        parts.append(f"then {pick} ('{label(node)}')")
        earlier = [n for n in backward_cone(sel.masks) if n.op_type in SELECTORS]
        if earlier:
            parts.append(f"with the choice of '{label(earlier[0])}' masked out")
    if w.scattered is not None:
        parts.append(f"scattered into a dense experts tensor ('{label(w.scattered)}')")
    if w.post is not None:
        op = "a softmax" if w.post.op_type == "Softmax" else "the sigmoid"
        of = "the selected value" if k == 1 else f"the {k or 'k'} selected values"
        parts.append(f"then {op} of {of} ('{label(w.post)}')")
    if w.threshold is not None:
        t = next((scalar(v) for v in w.threshold.inputs if scalar(v) is not None), None)
        at = f" {t:g}" if t is not None else ""
        parts.append(
            f"weighted by a softmax masked where the gap to the maximum exceeds a jitter "
            f"threshold{at} ('{label(w.threshold)}'), PhiMoE's sparse mixer"
        )
    elif w.gathered is not None:
        src = f" ('{label(w.source)}')" if w.source is not None else ""
        parts.append(f"the weights gathered from the unbiased scores{src}")
    if w.renorm is not None:
        parts.append(f"renormalised ('{label(w.renorm)}')")
    if w.scale is not None:
        parts.append(f"scaled by {w.scale[1]:g} ('{label(w.scale[0])}')")
    if w.prescale is not None:
        parts.append(f"the weights scaling the token before the experts ('{label(w.prescale)}')")
    return parts[0] + " " + ", ".join(parts[1:])


def _bias_name(node: ir.Node) -> str:
    """The name of the constant a bias node adds (an initializer name says what it is)."""
    for v in node.inputs:
        if v is not None and const_like(v):
            v = skip_back(v)  # past a Cast: the initializer's own name
            return v.name or label(v.producer())
    return label(node)
