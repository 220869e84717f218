"""Canonicalise the dense all-experts MoE form into the per-slot form the layer rules take.

optimum-onnx's Qwen3-MoE / gpt-oss exports and onnxruntime's Mobius fallback compute EVERY
expert on every token and mask afterwards: ``out = sum_e dense[:, e] * FFN_e(x)`` with
``dense[t, e] = sum_j (idx[t, j] == e) * w[t, j]`` built from one TopK. No layer rule
(:mod:`onnx_moe_fuse.rewrites.moe.layer_rules`) matches that, so :class:`CanonicalDenseExpertsPass`
rewrites it, on the fusion pipeline's working copy, into the per-slot layer::

    fc1_j = GroupedMatMul(tokens, W1_j [E, H, N], topk_idx (, b1_j [E, N]))      [T, k, N]
    act   = the experts' activation, copied (per-row ops; axes written as -1)
    fc2   = Reshape(GroupedMatMul(Reshape(act, [-1, I]), W2 [E, I, H],
                                  Reshape(topk_idx, [-1, 1]) (, b2)), [-1, k, H])
    out   = ReduceSum(Mul(fc2, Unsqueeze(w, [-1])), [1], keepdims=0)

which is equal because ``sum_e dense[t, e] y_e = sum_j w[t, j] y_{idx[t, j]}`` (TopK's indices
of a row are distinct and in ``[0, E)``). Before it rewrites, the check proves (the mask read
by :mod:`.mask`, the combine by :mod:`.combine`, the experts by :mod:`.ffn`):

* the TopK is over the last axis of ``[T, E]`` router scores (:mod:`.routing`), and the
  router reads the same ``[T, H]`` token rows as the experts;
* the mask is exactly the one-hot of those indices (Equal per expert with each e in ``0..E-1``
  once, OneHot of depth E with values ``[0, 1]``, Equal of the ids with the range ``0..E-1``,
  or ScatterElements into zeros ``[T, E]``), weighted by ``[T, k]`` values computed from that
  TopK's values;
* the combine sums the weighted outputs of all E experts exactly once;
* every expert has the same MLP structure (same ops, attributes, constants, weight shapes and
  quantisation), reading the tokens, with weights ``[K, N]`` per expert (stacked here in expert
  order into ``[E, K, N]``, K-major; a ``DequantizeLinear`` becomes one DQ of the stacked codes,
  scales, zero points with its axis shifted by one; Mobius' ``com.microsoft.MatMulNBits``
  experts become one such DQ, blocked along K, with explicit zero points) or already stacked
  ``[E, K, N]`` with the tokens broadcast over E (MatMul broadcasting, Unsqueeze, Expand, Tile);
* no intermediate value of the dense block is used outside it.

A proof reads only shapes, dtypes and small constants; the expert weights are read (and
stacked, :mod:`.stack`) only for a layer that is rewritten, and before any change, so an
unreadable tensor leaves the layer as it was. Constants are read without the naming side effect
of ``onnx_ir.convenience.get_const_tensor`` (:mod:`.consts`).

The values at the layer's boundary keep their names (the tokens, router logits, TopK outputs, the
routing weights, and the layer output, which the new ReduceSum takes over), so the pipeline's splice
finds the layer in the original graph. New values get fresh names. Where a proof fails the block
stays exactly as it was, and the pass records why as it runs (into
``CanonicalDenseExpertsPass.refusals``: a :class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal`
naming the part (``routing``, ``combine``, ``fc1``, ``activation``, ``fc2``, ``region``) and the
node), which the fuser's near miss carries (the layer is recognised from its mask, so a router over
other rows or weights that are graph inputs are named as such, not as an unknown spelling);
:func:`dense_experts_refusals` lists every such reason of a model. The default opset becomes 29
(GroupedMatMul) when a layer is rewritten: the working copy is never executed.
"""

from __future__ import annotations

import onnx_ir as ir

from onnx_moe_fuse.rewrites.canonical.experts.dense.combine import (
    Combine,
    read_combine,
    split_rows_outputs,
)
from onnx_moe_fuse.rewrites.canonical.experts.dense.consts import (
    const_ints,
    node_axes,
)
from onnx_moe_fuse.rewrites.canonical.experts.dense.emit import Emitter
from onnx_moe_fuse.rewrites.canonical.experts.dense.ffn import ExpertMLP, Projection, read_mlp
from onnx_moe_fuse.rewrites.canonical.experts.dense.layer import DenseLayer
from onnx_moe_fuse.rewrites.canonical.experts.dense.mask import (
    CapacityRefusal,
    DenseWeights,
    mask_users,
    read_dense_weights,
)
from onnx_moe_fuse.rewrites.canonical.experts.dense.prescaled import read_prescaled
from onnx_moe_fuse.rewrites.canonical.experts.dense.routing import Routing, read_routing
from onnx_moe_fuse.rewrites.graph.facts import label, value_label
from onnx_moe_fuse.rewrites.graph.refusals import DENSE_EXPERTS, Refusal, part
from onnx_moe_fuse.rewrites.graph.token_rows import prove_token_rows

__all__ = [
    "CanonicalDenseExpertsPass",
    "DenseLayer",
    "analyse_dense_layer",
    "dense_experts_refusals",
]

GROUPED_MATMUL_OPSET = 29


def _projections(mlp: ExpertMLP) -> list[tuple[str, Projection]]:
    """The MLP's projections with the part each belongs to."""
    return [*(("fc1", p) for p in mlp.fc1), ("fc2", mlp.fc2)]


def _check_per_expert_mlps(combine: Combine, experts: int) -> list[ExpertMLP]:
    mlps = []
    for e in range(experts):
        y = combine.per_expert[e]
        try:
            mlp = read_mlp(y, rank=2)
        except Refusal as exc:
            exc.reason = f"expert {e}: {exc.reason}"  # keeps its part and nodes
            raise
        for fc, p in _projections(mlp):
            with part(fc):
                if len(p.weight.shape) != 2:
                    raise Refusal(f"expert {e}: a projection weight is not [K, N]", p.nodes[0])
                if p.bias is not None and tuple(p.bias.const_value.shape) not in (
                    (p.weight.shape[1],),
                    (1, p.weight.shape[1]),
                ):
                    raise Refusal(f"expert {e}: a bias is not one [N] row", p.bias)
        if mlps and mlp.signature != mlps[0].signature:
            # (activation entries, FC2 input, projections): which of them differs is the part
            where = "activation" if mlp.signature[:2] != mlps[0].signature[:2] else "weights"
            with part(where):
                raise Refusal(
                    f"expert {e}'s MLP differs in structure from expert 0's (its {where})", y
                )
        mlps.append(mlp)
    return mlps


def _check_stacked_mlp(combine: Combine, routing: Routing) -> list[ExpertMLP]:
    mlp = read_mlp(combine.stacked, rank=3)
    for fc, p in _projections(mlp):
        shape = p.weight.shape
        with part(fc):
            if len(shape) != 3 or shape[0] != routing.experts:
                raise Refusal(
                    f"stacked weights {shape} are not [E = {routing.experts}, K, N]", p.nodes[0]
                )
            if p.bias is not None and tuple(p.bias.const_value.shape) != (shape[0], 1, shape[2]):
                raise Refusal("a stacked bias is not [E, 1, N]", p.bias)
    return [mlp]


def _broadcast_base(lhs: ir.Value | None, experts: int) -> ir.Value | None:
    """The ``[T, H]`` tokens a stacked FC1 input repeats for every expert, else None.

    The tokens as they are (MatMul broadcasts them over E), ``Unsqueeze(tokens, [0])``, or
    either one under an ``Expand`` / ``Tile`` to ``[E, T, H]`` whose constant shape is
    ``[E | 1, 1, 1 | H]`` (repeats only along the expert axis). A value no such op produces is
    taken as the tokens themselves.
    """
    node = lhs.producer() if lhs is not None else None
    if node is None or node.domain not in ("", "ai.onnx"):
        return lhs
    if node.op_type == "Unsqueeze":
        return node.inputs[0] if node_axes(node) == [0] else None
    if node.op_type in ("Expand", "Tile"):
        reps = const_ints(node.inputs[1]) if len(node.inputs) > 1 else None
        inner = node.inputs[0]
        if reps is None or len(reps) != 3 or reps[0] not in (1, experts) or reps[1] != 1:
            return None
        inner_node = inner.producer() if inner is not None else None
        if node.op_type == "Tile" and (
            reps[2] != 1 or inner_node is None or inner_node.op_type not in _RANK3_BROADCASTS
        ):
            return None  # Tile of [T, H] by 3 repeats is not valid; H repeats change H
        return _broadcast_base(inner, experts)
    return lhs


_RANK3_BROADCASTS = ("Unsqueeze", "Expand", "Tile")


def _check_token_rows(routing: Routing, mlps: list[ExpertMLP], stacked: bool) -> None:
    """Every FC1 reads the router's token rows (one routing row per token row).

    Where the experts all read the same rows and the router others, the router is at fault
    (part ``routing``, as the layer rules name it); where the experts disagree, the FC1.
    """
    reads = [
        (e, p, _broadcast_base(p.lhs, routing.experts) if stacked else p.lhs)
        for e, mlp in enumerate(mlps)
        for p in mlp.fc1
    ]
    rows = reads[0][2]
    tokens = routing.tokens
    with part("routing"):
        if routing.router is None:
            scores = routing.topk.inputs[0]
            if rows is None or scores is None:
                raise Refusal(
                    f"cannot read the router behind TopK '{label(routing.topk)}' back to a "
                    f"MatMul of the token rows '{value_label(rows)}' the experts read",
                    routing.topk,
                )
            # a router that masks or biases its scores (group-limited top-k): row by row
            prove_token_rows(
                scores,
                rows,
                (routing.scores_rank or 2) - 1,
                f"the router: TopK '{label(routing.topk)}' reads '{value_label(scores)}'",
            )
            routing.tokens = tokens = rows  # what the emission reads as the tokens
        elif rows is not None and all(r is rows for _, _, r in reads) and rows is not tokens:
            router = routing.router
            raise Refusal(
                f"the router {router.op_type} '{label(router)}' reads "
                f"'{value_label(routing.tokens)}', not the token rows '{value_label(rows)}' "
                "the experts read: the fused node routes each token by its own router row",
                router,
            )
    with part("fc1"):
        for e, p, r in reads:
            if r is not tokens:
                where = f"expert {e}: " if not stacked else ""
                raise Refusal(
                    f"{where}an FC1 projection does not read the router's tokens", p.nodes[0]
                )


def _check_escapes(layer: DenseLayer) -> None:
    nodes = layer.nodes()
    inside = {id(n) for n in nodes}
    with part("region"):
        for node in nodes:
            if node is layer.combine.root:
                continue
            for out in node.outputs:
                if out.is_graph_output() or any(id(u) not in inside for u in out.consumers()):
                    raise Refusal(f"an intermediate value escapes the dense layer: {out.name}", out)


def _recognise(topk: ir.Node) -> tuple[Routing, DenseWeights] | None:
    """The routing and mask of the dense layer ``topk``'s ids mask; None if they mask nothing.

    A mask read is the layer's signature: the one-hot (or scatter) of this TopK's ids weighted
    by its values is the dense routing weights of an MoE layer, whatever else is wrong.
    """
    if topk.op_type != "TopK" or topk.domain not in ("", "ai.onnx") or len(topk.outputs) < 2:
        return None
    if not mask_users(topk.outputs[1]):
        return None
    routing = read_routing(topk)
    mask = read_dense_weights(routing)
    return None if mask is None else (routing, mask)


def _diagnose_split_rows(mask: DenseWeights, routing: Routing) -> None:
    """Raise the routing refusal behind a combine whose split rows were not proved equal.

    The split of the dense weights is proved equal to the experts' only when both are the same
    rows; a router over other rows (a second input, a slice) is the usual reason it is not, and
    the near miss should say so. Reads the experts from the split combine's outputs; nothing is
    raised when they cannot be read or do read the router's rows.
    """
    outputs = split_rows_outputs(mask)
    if outputs is None:
        return
    try:
        mlps = _check_stacked_mlp(Combine(mask.dense.producer(), None, outputs), routing)
    except Refusal:
        return  # the experts themselves do not read: the combine's refusal stands
    _check_token_rows(routing, mlps, True)


def _prove(routing: Routing, mask: DenseWeights) -> DenseLayer:
    """The rest of the proof of a recognised layer: combine, selection, experts, rows, region."""
    routing.require_selection()  # a TopK over another axis is named before any later part
    try:
        combine = read_combine(mask, routing)
    except Refusal as refusal:
        _diagnose_split_rows(mask, routing)  # a router over other rows explains it better
        raise refusal
    if combine.stacked is None:
        mlps = _check_per_expert_mlps(combine, routing.experts)
    else:
        mlps = _check_stacked_mlp(combine, routing)
    _check_token_rows(routing, mlps, combine.stacked is not None)
    routing.require_scores()
    layer = DenseLayer(routing, mask, combine, mlps)
    _check_escapes(layer)
    return layer


def analyse_dense_layer(topk: ir.Node) -> DenseLayer | None:
    """Prove the dense layer routed by ``topk``; None when its ids feed no mask.

    Raises :class:`Refusal`, tagged with the part at fault, when the ids feed a mask but the
    proof fails. The layer is recognised first (routing facts, mask), then proved: the
    combine, the TopK's selection, the experts, the rows the router reads against the experts',
    and that nothing escapes.
    """
    parts = _recognise(topk)
    return None if parts is None else _prove(*parts)


def _candidates(graph: ir.Graph) -> list[ir.Node]:
    return [n for n in graph if n.op_type == "TopK" and n.domain in ("", "ai.onnx")]


def _refusal(exc: Exception) -> Refusal:
    if isinstance(exc, Refusal):
        return exc
    # never raise on a valid model: an unreadable part is refused, naming the TopK
    return Refusal(f"could not analyse the dense layer: {type(exc).__name__}: {exc}")


def _analyse(topk: ir.Node) -> tuple[DenseLayer | None, Refusal | None, bool]:
    """``(the proved layer, or the refusal, whether the mask was read)``.

    ``recognised`` (the third): the mask was read (a one-hot or scatter of the TopK's ids
    weighted by its values), so the block is a dense MoE layer for sure; a refusal before
    that may be about a block that is no MoE layer at all.
    """
    try:
        prescaled = read_prescaled(topk)
    except Exception as exc:  # noqa: BLE001 - recognised as input-scaled, then refused
        return None, _refusal(exc), True
    if prescaled is not None:
        routing, mask, combine, mlp, prescale = prescaled
        layer = DenseLayer(routing, mask, combine, [mlp], prescale)
        try:
            _check_escapes(layer)
        except Refusal as exc:
            return None, exc, True
        return layer, None, True
    try:
        parts = _recognise(topk)
    except CapacityRefusal as exc:  # a dense layer for sure, with a capacity limit
        return None, exc, True
    except Exception as exc:  # noqa: BLE001 - a Refusal, or an unreadable part: both refuse
        return None, _refusal(exc), False
    if parts is None:
        return None, None, False
    try:
        return _prove(*parts), None, True
    except Exception as exc:  # noqa: BLE001 - as above
        return None, _refusal(exc), True


def dense_experts_refusals(model: ir.Model) -> list[tuple[str, str]]:
    """``(TopK node name, reason)`` for every dense-looking layer the pass would leave alone."""
    out = []
    for topk in _candidates(model.graph):
        _, refusal, _ = _analyse(topk)
        if refusal is not None:
            out.append((label(topk), refusal.reason))
    return out


class CanonicalDenseExpertsPass(ir.passes.InPlacePass):
    """Rewrite every proved dense all-experts layer into the per-slot GroupedMatMul layer.

    ``refusals`` receives, while the pass runs, the refusal of each layer it recognised (its
    mask read) and left as it is, recorded as :data:`DENSE_EXPERTS`'s for the layer's TopK
    (the list the pipeline hands it, or one of its own).
    """

    def __init__(self, refusals: list[Refusal] | None = None) -> None:
        """Record refusals into ``refusals`` (a new list by default)."""
        super().__init__()
        self.refusals: list[Refusal] = [] if refusals is None else refusals

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Rewrite the main graph's dense layers; the others stay byte-for-byte."""
        modified = False
        for topk in _candidates(model.graph):
            layer, refusal, recognised = _analyse(topk)
            if refusal is not None and recognised:
                self.refusals.append(refusal.recorded_by(DENSE_EXPERTS, topk))
            if layer is None:
                continue
            emitter = Emitter(model.graph, layer)
            try:
                emitter.load()  # reads the weights it stacks; nothing is changed yet
            except Exception:  # an unreadable tensor (external data): leave the layer
                continue
            emitter.rewrite()
            modified = True
        if modified:
            current = model.graph.opset_imports.get("", 1)
            model.graph.opset_imports[""] = max(int(current), GROUPED_MATMUL_OPSET)
        return ir.passes.PassResult(model, modified)
