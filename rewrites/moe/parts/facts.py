"""The typed facts the part recognisers return, and the one failure type they raise.

A mixture-of-experts layer is recognised part by part (see :mod:`onnx_moe_fuse.rewrites.moe.parts`):
each recogniser returns a frozen fact about its part, or raises :class:`PartFailure` naming the
part, the node or value at fault and the reason in plain words. :class:`LayerParts` composes the
facts of one layer; the layer proofs (``_moe_analysis``, ``_moe_rows_analysis``) read its
:attr:`LayerParts.bindings`, the names the recognisers bound, and prove the meaning.

Every fact keeps ``nodes``, the graph nodes its part matched, so a layer's region (what a fused
node replaces, and what must not escape it) is the union over its parts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.facts import Refusal, label, value_label

__all__ = [
    "ActivationFact",
    "CombineFact",
    "LayerParts",
    "PartFailure",
    "ProjectionFact",
    "RoutingFact",
    "failure",
    "half_precision",
]


class PartFailure(Refusal):
    """A part of a layer that is not what the fused ops compute: part, node, value, reason.

    The one failure type of the layer recognisers and proofs (a subclass of onnxscript's
    ``MatchFailureError``, so a rule's ``check`` may raise it). ``part`` is None until the
    proof step it was raised in tags it (``_moe_analysis.part``); the first tag wins.
    """

    def __init__(self, part: str | None, reason: str, *sources: ir.Node | ir.Value | None) -> None:
        """A failure of ``part`` for ``reason``, about the nodes/values ``sources``."""
        super().__init__(reason, *[s for s in sources if s is not None])
        self.part = part

    @property
    def node(self) -> ir.Node | None:
        """The first node the failure names (a named value's producer otherwise)."""
        for s in self.failure_sources:
            if isinstance(s, ir.Node):
                return s
        for s in self.failure_sources:
            if isinstance(s, ir.Value) and s.producer() is not None:
                return s.producer()
        return None

    @property
    def value(self) -> ir.Value | None:
        """The first value the failure names, None when it names nodes only."""
        return next((s for s in self.failure_sources if isinstance(s, ir.Value)), None)

    def message(self) -> str:
        """``"part: reason"``, the text a rule's ``check`` fails with (near misses split it)."""
        return f"{self.part}: {self.reason}" if self.part else self.reason

    def where(self) -> str:
        """The node or value at fault, for reports: ``"node 'MatMul_12'"``."""
        if self.node is not None:
            return f"node '{label(self.node)}'"
        if self.value is not None:
            return f"value '{value_label(self.value)}'"
        return "the layer"


def failure(part: str, reason: str, *sources: ir.Node | ir.Value | None) -> PartFailure:
    """A :class:`PartFailure` of ``part`` (to ``raise``)."""
    return PartFailure(part, reason, *sources)


_HALF = {ir.DataType.FLOAT16: "float16", ir.DataType.BFLOAT16: "bfloat16"}


def half_precision(part: str, value: ir.Value) -> PartFailure | None:
    """A failure naming the dtype when ``value`` is a Cast of a half-precision value.

    A float16 export casts around routing and combine; the part that does not match is then a
    Cast, and the reason must say the dtype, which this version does not fuse.
    """
    node = value.producer()
    if node is None or node.op_type != "Cast" or node.inputs[0] is None:
        return None
    dtype = _HALF.get(node.inputs[0].dtype)
    if dtype is None:
        return None
    return PartFailure(
        "target",
        f"'{value_label(value)}' is a Cast of the {dtype} '{value_label(node.inputs[0])}' "
        f"({part} computes in {dtype}): this version fuses float32 layers only "
        "(float16/bfloat16 layers are left as they are)",
        node,
    )


def _frozen(bindings: Mapping[str, Any]) -> Mapping[str, Any]:
    return MappingProxyType(dict(bindings))


@dataclass(frozen=True, eq=False)
class RoutingFact:
    """``TopK(scores, k)`` and the weights made from its values.

    ``form``: ``renorm_div`` / ``renorm_reciprocal`` (divided by their sum), ``softmax_k`` (a
    Softmax over the k values) or ``as_is``; whether ``scores`` are softmax probabilities is
    the routing proof's business.
    """

    topk: ir.Node
    scores: ir.Value
    weights: ir.Value
    indices: ir.Value
    form: str
    nodes: tuple[ir.Node, ...]
    bindings: Mapping[str, Any]

    def __post_init__(self) -> None:
        object.__setattr__(self, "bindings", _frozen(self.bindings))


@dataclass(frozen=True, eq=False)
class ProjectionFact:
    """One expert projection (FC1 gate/up/whole, or FC2): how it selects and multiplies.

    ``spelling``: ``grouped_matmul`` (opset 29), ``gather_matmul`` (Gather + MatMul, per slot)
    or ``gathernd_matmul`` (flattened rows); ``layout``: ``slots`` (``[*, k, N]``) or ``rows``
    (``[T*k, N]``); ``input`` is what it multiplies (the tokens, the activation or the token
    rows), ``indices`` the expert ids it selects with, ``weight`` and ``bias`` the stacked
    parameters as bound (proved constant later).
    """

    tag: str
    spelling: str
    layout: str
    input: ir.Value
    output: ir.Value
    weight: ir.Value | None
    indices: ir.Value | None
    bias: ir.Value | None
    nodes: tuple[ir.Node, ...]
    bindings: Mapping[str, Any]

    def __post_init__(self) -> None:
        object.__setattr__(self, "bindings", _frozen(self.bindings))


@dataclass(frozen=True, eq=False)
class ActivationFact:
    """The activation between FC1 and FC2.

    ``family``: ``gated`` (SwiGLU of two projections), ``fused_gated`` (SwiGLU of one FC1 cut
    by Slice/Split) or ``elementwise``; ``kind`` the spelling (``swiglu``, ``relu``, ``gelu``,
    ``silu_mul``, ``swish``, ``erf_gelu``, ``identity``, ...); ``fc1_outputs`` the FC1 values
    it reads (gate then up for ``gated``), ``output`` what FC2 reads.
    """

    family: str
    kind: str
    output: ir.Value
    fc1_outputs: tuple[ir.Value, ...]
    nodes: tuple[ir.Node, ...]
    bindings: Mapping[str, Any]

    def __post_init__(self) -> None:
        object.__setattr__(self, "bindings", _frozen(self.bindings))


@dataclass(frozen=True, eq=False)
class CombineFact:
    """The weighted sum over the k slots that ends the layer.

    ``form``: ``reduce_sum`` (ReduceSum of Mul by the unsqueezed weights), ``matmul_squeeze`` /
    ``matmul_reshape`` (the weights as a row vector times the slots), or ``reshape_reduce_sum``
    (flattened rows weighted, un-flattened, summed). ``expert_out`` is FC2's output as the
    combine reads it: ``[*, k, H]`` slots, or ``[T*k, H]`` rows for ``reshape_reduce_sum``.
    """

    form: str
    root: ir.Node
    expert_out: ir.Value
    weights: ir.Value
    nodes: tuple[ir.Node, ...]
    bindings: Mapping[str, Any]

    def __post_init__(self) -> None:
        object.__setattr__(self, "bindings", _frozen(self.bindings))

    @property
    def reads_rows(self) -> bool:
        """True when the combine weights flattened rows (``reshape_reduce_sum``)."""
        return self.form == "reshape_reduce_sum"


@dataclass(frozen=True, eq=False)
class LayerParts:
    """The recognised parts of one layer, from its combine back to its routing TopK.

    ``layout`` is ``slots`` or ``rows`` (FC2's layout), ``tokens`` what FC1 projects (the
    token rows' source for ``rows``), ``extra`` the bindings of the glue between parts (the
    token rows, the un-flattening of rows into slots). :attr:`bindings` merges every part's
    bindings under the names the layer proofs read.
    """

    combine: CombineFact
    routing: RoutingFact
    fc2: ProjectionFact
    activation: ActivationFact
    fc1: tuple[ProjectionFact, ...]
    layout: str
    tokens: ir.Value
    extra: Mapping[str, Any]
    extra_nodes: tuple[ir.Node, ...] = ()

    @property
    def family(self) -> str:
        """The activation family (it picks the FC1 projections the proofs read)."""
        return self.activation.family

    @property
    def bindings(self) -> dict[str, Any]:
        """Every part's bindings, and ``tokens``, in one dict (a fresh copy)."""
        merged: dict[str, Any] = {}
        for fact in (self.routing, *self.fc1, self.activation, self.fc2, self.combine):
            merged.update(fact.bindings)
        merged.update(self.extra)
        merged["tokens"] = self.tokens
        return merged

    @property
    def nodes(self) -> frozenset[ir.Node]:
        """Every node the parts matched: the layer's region in the graph."""
        out: set[ir.Node] = set(self.extra_nodes)
        for fact in (self.routing, *self.fc1, self.activation, self.fc2, self.combine):
            out.update(fact.nodes)
        return frozenset(out)
