"""The RMS norm + Q/K/V patterns: norm spellings, projections, and the matcher that counts them.

One pattern per norm spelling (:data:`~.graph.NORM_FORMS`) and projection mix; the
matcher (:class:`_PreludeMatcher`) insists on exactly three projections of the normed value.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import onnx_ir as ir
from onnxscript.rewriter import _basics, _matcher, pattern

from onnx_moe_fuse.rewrites.graph.refusals import Refusal
from onnx_moe_fuse.rewrites.qkv.graph import (
    COUNT_PREFIX,
    MS_DOMAIN,
    item_label,
    pattern_var,
)

# -- pattern pieces ----------------------------------------------------------------------------


def _norm_input(op, with_add: bool):
    """The value the norm reads: ``A``, or ``Add(A, skip)`` bound as ``residual``."""
    if with_add:
        return op.Add(pattern_var("a"), pattern_var("skip"), _outputs=["residual"])
    return pattern_var("x")


def _decomposed(op, x, final: str):
    """The decomposed RMS norm of ``x``; ``final`` picks the spelling of its last node."""
    x_c = pattern.OrValue([op.Cast(x, _outputs=["x_up"]), x], name="x_c")
    sq = pattern.OrValue(
        [op.Pow(x_c, pattern_var("pow_exponent"), _outputs=["sq_pow"]), op.Mul(x_c, x_c)], name="sq"
    )
    mean_sq = op.ReduceMean(sq, pattern_var("rm_axes", True), _outputs=["mean_sq"])
    eps = pattern_var("epsilon")
    mean_eps = pattern.OrValue([op.Add(mean_sq, eps), op.Add(eps, mean_sq)], name="mean_sq_eps")
    rms = op.Sqrt(mean_eps, _outputs=["rms"])
    inv = pattern.OrValue(
        [op.Reciprocal(rms), op.Div(pattern_var("one"), rms, _outputs=["inv_div"])], name="inv_rms"
    )
    normalized = pattern.OrValue(
        [op.Div(x_c, rms), op.Mul(x_c, inv), op.Mul(inv, x_c)], name="normalized"
    )
    normalized_t = pattern.OrValue(
        [op.Cast(normalized, _outputs=["normalized_cast"]), normalized], name="normalized_t"
    )
    scale = pattern_var("norm_scale")
    scale_c = pattern.OrValue([op.Cast(scale, _outputs=["scale_cast"]), scale], name="scale_c")
    if final == "mul_ns":
        return op.Mul(normalized_t, scale_c, _outputs=["normed"])
    if final == "mul_sn":
        return op.Mul(scale_c, normalized_t, _outputs=["normed"])
    scaled = pattern.OrValue(
        [op.Mul(normalized_t, scale_c), op.Mul(scale_c, normalized_t)], name="scaled"
    )
    return op.Cast(scaled, _outputs=["normed"])


def norm_pattern(op, form: str):
    """``(normed, residual or None)`` for one of :data:`NORM_FORMS`."""
    if form.startswith("skip_sln"):
        if form == "skip_sln_residual":
            outs = ["normed", "ssln_mean", "ssln_inv_std_var", "residual"]
        else:
            outs = ["normed"]
        values = op.SkipSimplifiedLayerNormalization(
            pattern_var("a"), pattern_var("skip"), pattern_var("norm_scale"), pattern_var("ssln_bias", True), _domain=MS_DOMAIN,
            _outputs=outs,
        )  # fmt: skip
        if form == "skip_sln_residual":
            return values[0], values[3]
        return values, None
    with_add = form.startswith("add_")
    body = form.removeprefix("add_")
    x = _norm_input(op, with_add)
    residual = x if with_add else None
    if body == "sln":
        normed = op.SimplifiedLayerNormalization(x, pattern_var("norm_scale"), _outputs=["normed"])
    elif body == "rms":
        normed = op.RMSNormalization(x, pattern_var("norm_scale"), _outputs=["normed"])
    else:
        normed = _decomposed(op, x, body.removeprefix("decomposed_"))
    return normed, residual


def projection(op, normed, slot: int, kind: str):
    if kind == "n":
        return op.MatMulNBits(
            normed,
            pattern_var(f"p{slot}_B"),
            pattern_var(f"p{slot}_scales"),
            pattern_var(f"p{slot}_zero_points", True),
            pattern_var(f"p{slot}_g_idx", True),
            pattern_var(f"p{slot}_bias", True),
            _domain=MS_DOMAIN,
            _outputs=[f"p{slot}"],
        )
    return op.MatMul(normed, pattern_var(f"p{slot}_weight"), _outputs=[f"p{slot}"])


def _is_projection_of(node: ir.Node, value: ir.Value) -> bool:
    if not node.inputs or node.inputs[0] is not value:
        return False
    return (node.domain, node.op_type) in (("", "MatMul"), (MS_DOMAIN, "MatMulNBits"))


def _projection_consumers(normed: ir.Value) -> list[ir.Node]:
    """Nodes that project ``normed``: MatMulNBits / MatMul reading it as input 0, in use order."""
    found: dict[int, ir.Node] = {}
    for node, index in normed.uses():
        if index == 0 and _is_projection_of(node, normed):
            found.setdefault(id(node), node)
    return list(found.values())


def _count_reason(normed: ir.Value, found: Sequence[ir.Node]) -> str:
    labels = ", ".join(item_label(n) for n in found)
    n = len(found)
    if n == 0:
        return (
            f"no projection (MatMulNBits or MatMul) reads the normalised value {item_label(normed)}"
        )
    if n < 3:
        words = {1: "only one projection", 2: "only two projections"}[n]
        return (
            f"{COUNT_PREFIX} {item_label(normed)} feeds {words} ({labels}); MatMulNBitsQkv needs "
            "exactly three (Q, K and V)"
        )
    return (
        f"{COUNT_PREFIX} {item_label(normed)} feeds {n} projections ({labels}); MatMulNBitsQkv "
        "takes exactly three, and which three are Q, K and V cannot be told"
    )


class PreludeMatcher(_matcher.SimplePatternMatcher):
    """Matches the norm at the visited node, then its three projections among its readers.

    onnxscript's generic multi-output search tries every combination of graph nodes for the
    other output nodes; here they can only be readers of the normalised value, so only those are
    tried (every assignment to the pattern's projection slots). With other than three such
    readers the match fails with the count as its reason.
    """

    def match(  # type: ignore[override]
        self,
        model: ir.Model,
        graph_or_function: ir.Graph | ir.Function,
        node: ir.Node,
        *,
        verbose: int = 0,
        remove_nodes: bool = True,
        tracer: _basics.MatchingTracer | None = None,
    ) -> _basics.MatchResult:
        del model
        self._tracer = tracer
        if isinstance(graph_or_function, ir.Graph):
            self._graph = graph_or_function
        else:
            self._graph = graph_or_function.graph
        self._init_match(verbose)
        match = self._match
        head, *slots = self.pattern.output_nodes
        if not self._match_node(head, node):
            return match
        normed = node.outputs[0]
        found = _projection_consumers(normed)
        if not found:  # a norm no projection reads is no candidate: a plain failure
            return match.fail(_count_reason(normed, found), [node])
        if len(found) != 3:
            # a typed refusal: the one matcher failure that is a near miss (rule.near_misses)
            return Refusal(_count_reason(normed, found), node, *found).fail(match)
        wanted = [pn.op_identifier() for pn in slots]
        for order in itertools.permutations(found):
            if [n.op_identifier() for n in order] != wanted:
                continue
            match.enter_new_match()
            if all(self._match_node(pn, n) for pn, n in zip(slots, order, strict=True)):
                match.merge_current_match()
                break
            match.abandon_current_match()
        else:
            return match.fail("the projection kinds differ from this rule variant's", node)
        outputs = self._get_output_values()
        if outputs is None:
            return match
        if remove_nodes and not _matcher._valid_to_replace(match.nodes, outputs):
            return match.fail("Matched nodes have other uses preventing replacement.")
        match.outputs.extend(outputs)
        return match
