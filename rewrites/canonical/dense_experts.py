"""Canonicalise the dense all-experts MoE form into the per-slot form the layer rules take.

optimum-onnx's Qwen3-MoE / gpt-oss exports and onnxruntime's Mobius fallback compute EVERY
expert on every token and mask afterwards: ``out = sum_e dense[:, e] * FFN_e(x)`` with
``dense[t, e] = sum_j (idx[t, j] == e) * w[t, j]`` built from one TopK. No layer rule
(:mod:`onnx_moe_fuse.rewrites.moe_layer`) matches that, so :class:`CanonicalDenseExpertsPass`
rewrites it, on the fusion pipeline's working copy, into the per-slot layer::

    fc1_j = GroupedMatMul(tokens, W1_j [E, H, N], topk_idx (, b1_j [E, N]))      [T, k, N]
    act   = the experts' activation, copied (per-row ops; axes written as -1)
    fc2   = Reshape(GroupedMatMul(Reshape(act, [-1, I]), W2 [E, I, H],
                                  Reshape(topk_idx, [-1, 1]) (, b2)), [-1, k, H])
    out   = ReduceSum(Mul(fc2, Unsqueeze(w, [-1])), [1], keepdims=0)

which is equal because ``sum_e dense[t, e] y_e = sum_j w[t, j] y_{idx[t, j]}`` (TopK's indices
of a row are distinct and in ``[0, E)``). Before it rewrites, the check proves (the mask read
by :mod:`.dense_mask`, the combine by :mod:`.dense_combine`, the experts by :mod:`.dense_ffn`):

* the TopK is over the last axis of ``[T, E]`` router scores of the same ``[T, H]`` tokens;
* the mask is exactly the one-hot of those indices (Equal per expert with each e in ``0..E-1``
  once, OneHot of depth E with values ``[0, 1]``, or ScatterElements into zeros ``[T, E]``),
  weighted by values computed from that TopK's values;
* the combine sums the weighted outputs of all E experts exactly once;
* every expert has the same MLP structure (same ops, attributes, constants, weight shapes and
  quantisation), reading the tokens, with weights ``[K, N]`` per expert (stacked here in expert
  order into ``[E, K, N]``, K-major; a ``DequantizeLinear`` becomes one DQ of the stacked codes,
  scales, zero points with its axis shifted by one; Mobius' ``com.microsoft.MatMulNBits``
  experts become one such DQ, blocked along K, with explicit zero points) or already stacked
  ``[E, K, N]`` with the tokens broadcast over E (MatMul broadcasting, Unsqueeze, Expand, Tile);
* no intermediate value of the dense block is used outside it.

A proof reads only shapes, dtypes and small constants; the expert weights are read (and
stacked, :mod:`.dense_stack`) only for a layer that is rewritten, and before any change, so an
unreadable tensor leaves the layer as it was. Constants are read without the naming side effect
of ``onnx_ir.convenience.get_const_tensor`` (:mod:`.dense_consts`).

The values at the layer's boundary keep their names (the tokens, router logits, TopK outputs,
the routing weights, and the layer output, which the new ReduceSum takes over), so the
pipeline's splice finds the layer in the original graph. New values get fresh names. Where a
proof fails the block stays exactly as it was; :func:`dense_experts_refusals` lists why. The
default opset becomes 29 (GroupedMatMul) when a layer is rewritten: the working copy is never
executed.
"""

from __future__ import annotations

import onnx_ir as ir

from .._graph_facts import Refusal, label
from .dense_combine import Combine, read_combine
from .dense_consts import const_ints, node_axes
from .dense_emit import Emitter
from .dense_ffn import ExpertMLP, read_mlp
from .dense_mask import DenseWeights, Routing, read_dense_weights, read_routing

__all__ = [
    "CanonicalDenseExpertsPass",
    "DenseLayer",
    "analyse_dense_layer",
    "dense_experts_refusals",
]

GROUPED_MATMUL_OPSET = 29


class DenseLayer:
    """A proved dense layer: its routing, mask, combine and expert MLPs."""

    def __init__(
        self, routing: Routing, mask: DenseWeights, combine: Combine, mlps: list[ExpertMLP]
    ) -> None:
        """Hold the proved parts; ``mlps`` is one per expert, or one stacked MLP."""
        self.routing, self.mask, self.combine, self.mlps = routing, mask, combine, mlps

    @property
    def stacked(self) -> bool:
        """True when the experts are one MLP over stacked ``[E, K, N]`` weights."""
        return self.combine.stacked is not None

    def nodes(self) -> list[ir.Node]:
        """Every node the rewrite replaces (mask, combine, expert MLPs)."""
        out = [*self.mask.nodes, *self.combine.nodes]
        for mlp in self.mlps:
            out += mlp.nodes
        return list(dict.fromkeys(out))


def _check_per_expert_mlps(combine: Combine, routing: Routing) -> list[ExpertMLP]:
    mlps = []
    for e in range(routing.experts):
        y = combine.per_expert[e]
        try:
            mlp = read_mlp(y, rank=2)
        except Refusal as exc:
            raise Refusal(f"expert {e}: {exc.reason}") from None
        for p in mlp.fc1:
            if p.lhs is not routing.tokens:
                raise Refusal(f"expert {e}: an FC1 projection does not read the router's tokens")
        for p in (*mlp.fc1, mlp.fc2):
            if len(p.weight.shape) != 2:
                raise Refusal(f"expert {e}: a projection weight is not [K, N]")
            if p.bias is not None and tuple(p.bias.const_value.shape) not in (
                (p.weight.shape[1],),
                (1, p.weight.shape[1]),
            ):
                raise Refusal(f"expert {e}: a bias is not one [N] row")
        if mlps and mlp.signature != mlps[0].signature:
            raise Refusal(f"expert {e}'s MLP differs in structure from expert 0's")
        mlps.append(mlp)
    return mlps


def _is_token_broadcast(lhs: ir.Value, tokens: ir.Value, experts: int) -> bool:
    """``lhs`` repeats the ``[T, H]`` tokens for every expert (MatMul broadcasts the rest).

    The tokens as they are, ``Unsqueeze(tokens, [0])``, or either one under an ``Expand`` /
    ``Tile`` to ``[E, T, H]`` whose constant shape is ``[E | 1, 1, 1 | H]`` (repeats only along
    the expert axis).
    """
    if lhs is tokens:
        return True
    node = lhs.producer()
    if node is None or node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type == "Unsqueeze":
        return node.inputs[0] is tokens and node_axes(node) == [0]
    if node.op_type in ("Expand", "Tile"):
        reps = const_ints(node.inputs[1]) if len(node.inputs) > 1 else None
        inner = node.inputs[0]
        if reps is None or len(reps) != 3 or reps[0] not in (1, experts) or reps[1] != 1:
            return False
        if node.op_type == "Tile" and (inner is tokens or reps[2] != 1):
            return False  # Tile of [T, H] by 3 repeats is not valid; H repeats change H
        return inner is not None and _is_token_broadcast(inner, tokens, experts)
    return False


def _check_stacked_mlp(combine: Combine, routing: Routing) -> list[ExpertMLP]:
    mlp = read_mlp(combine.stacked, rank=3)
    for p in mlp.fc1:
        if not _is_token_broadcast(p.lhs, routing.tokens, routing.experts):
            raise Refusal("an FC1 projection does not read the router's tokens")
    for p in (*mlp.fc1, mlp.fc2):
        shape = p.weight.shape
        if len(shape) != 3 or shape[0] != routing.experts:
            raise Refusal(f"stacked weights {shape} are not [E = {routing.experts}, K, N]")
        if p.bias is not None and tuple(p.bias.const_value.shape) != (shape[0], 1, shape[2]):
            raise Refusal("a stacked bias is not [E, 1, N]")
    return [mlp]


def _check_escapes(layer: DenseLayer) -> None:
    nodes = layer.nodes()
    inside = {id(n) for n in nodes}
    for node in nodes:
        if node is layer.combine.root:
            continue
        for out in node.outputs:
            if out.is_graph_output() or any(id(u) not in inside for u in out.consumers()):
                raise Refusal(f"an intermediate value escapes the dense layer: {out.name}")


def analyse_dense_layer(topk: ir.Node) -> DenseLayer | None:
    """Prove the dense layer routed by ``topk``; None when its ids feed no mask.

    Raises :class:`Refusal` with the reason when the ids feed a mask but the proof fails.
    """
    if topk.op_type != "TopK" or topk.domain not in ("", "ai.onnx") or len(topk.outputs) < 2:
        return None
    idx = topk.outputs[1]
    if not any(u.op_type in ("Equal", "OneHot", "ScatterElements") for u in idx.consumers()):
        return None
    routing = read_routing(topk)
    mask = read_dense_weights(routing)
    if mask is None:
        return None
    combine = read_combine(mask, routing)
    if combine.stacked is None:
        mlps = _check_per_expert_mlps(combine, routing)
    else:
        mlps = _check_stacked_mlp(combine, routing)
    layer = DenseLayer(routing, mask, combine, mlps)
    _check_escapes(layer)
    return layer


def _candidates(graph: ir.Graph) -> list[ir.Node]:
    return [n for n in graph if n.op_type == "TopK" and n.domain in ("", "ai.onnx")]


def _analyse(topk: ir.Node) -> tuple[DenseLayer | None, str | None]:
    try:
        return analyse_dense_layer(topk), None
    except Refusal as exc:
        return None, exc.reason
    except Exception as exc:  # never raise on a valid model: an unreadable part is a refusal
        return None, f"could not analyse the dense layer: {type(exc).__name__}: {exc}"


def dense_experts_refusals(model: ir.Model) -> list[tuple[str, str]]:
    """``(TopK node name, reason)`` for every dense-looking layer the pass would leave alone."""
    out = []
    for topk in _candidates(model.graph):
        _, reason = _analyse(topk)
        if reason is not None:
            out.append((label(topk), reason))
    return out


class CanonicalDenseExpertsPass(ir.passes.InPlacePass):
    """Rewrite every proved dense all-experts layer into the per-slot GroupedMatMul layer."""

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        """Rewrite the main graph's dense layers; the others stay byte-for-byte."""
        modified = False
        for topk in _candidates(model.graph):
            layer, _ = _analyse(topk)
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
