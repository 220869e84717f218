"""The typed facts the part recognisers return.

A mixture-of-experts layer is recognised part by part (see :mod:`onnx_moe_fuse.rewrites.moe.parts`):
each recogniser returns a frozen fact about its part, or raises a
:class:`~onnx_moe_fuse.rewrites.graph.refusals.Refusal` naming the part, the node or value at
fault and the reason in plain words (:func:`half_precision` builds the one for a float16 part).
:class:`LayerParts` composes the facts of one layer; the layer proofs (:mod:`..analysis`,
:mod:`..rows_analysis`) read its :attr:`LayerParts.bindings`, the names the recognisers bound,
and prove the meaning.

Every fact keeps ``nodes``, the graph nodes its part matched, so a layer's region (what a fused
node replaces, and what must not escape it) is the union over its parts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.facts import value_label
from onnx_moe_fuse.rewrites.graph.refusals import Refusal

__all__ = [
    "ActivationFact",
    "CombineFact",
    "LayerParts",
    "ProjectionFact",
    "RoutingFact",
    "FLOAT_CASTS",
    "HALF_TYPES",
    "half_precision",
    "precision_cast",
]


_HALF = {ir.DataType.FLOAT16: "float16", ir.DataType.BFLOAT16: "bfloat16"}
#: The half-precision float types.
HALF_TYPES = frozenset(_HALF)
#: The float types a layer may compute in, or cast its routing weights and combine between.
FLOAT_CASTS = frozenset(
    {ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.FLOAT, ir.DataType.DOUBLE}
)
#: ``{type: the types that hold each of its values exactly}`` among :data:`FLOAT_CASTS`.
_WIDER = {
    ir.DataType.FLOAT16: frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE}),
    ir.DataType.BFLOAT16: frozenset({ir.DataType.FLOAT, ir.DataType.DOUBLE}),
    ir.DataType.FLOAT: frozenset({ir.DataType.DOUBLE}),
}


def precision_cast(value: ir.Value | None, *, widening: bool = False) -> ir.Node | None:
    """The plain ``Cast`` between float types that computes ``value``, else None.

    A float16/bfloat16 export casts around its routing and combine (torch.onnx writes the
    router's ``.float()`` and the combine's upcast as Casts): the layer is the same sum over
    the reals, rounded differently, so the recognisers look through such a Cast where the
    fused node's own rounding in its dtype stands for it (the routing weights, the combine).
    ``widening``: only a Cast that holds every input value exactly (float16 -> float32).
    """
    node = value.producer() if value is not None else None
    if node is None or node.op_type != "Cast" or node.domain not in ("", "ai.onnx"):
        return None
    src = node.inputs[0] if node.inputs else None
    to = node.attributes.get("to")
    if src is None or to is None or to.is_ref() or len(node.attributes) != 1:
        return None
    target = ir.DataType(to.as_int())  # a Cast's output type is its ``to``, declared or not
    if src.dtype not in FLOAT_CASTS or target not in FLOAT_CASTS:
        return None  # the source's type must be known (declared, as exporters write it)
    if widening and target not in _WIDER.get(src.dtype, frozenset()):
        return None
    return node


def half_precision(part: str, value: ir.Value) -> Refusal | None:
    """A refusal naming the dtype when ``value`` is a Cast of a half-precision value.

    A float16 export casts around routing and combine, where the recognisers look through the
    casts (:func:`precision_cast`); a Cast anywhere else in a part (inside an expert, between
    FC1 and the activation) is not taken, and the reason must say the dtype.
    """
    node = value.producer()
    if node is None or node.op_type != "Cast" or node.inputs[0] is None:
        return None
    dtype = _HALF.get(node.inputs[0].dtype)
    if dtype is None:
        return None
    return Refusal(
        f"'{value_label(value)}' is a Cast of the {dtype} '{value_label(node.inputs[0])}' "
        f"({part} computes in {dtype}): a layer fuses in one float type, with casts only on "
        "its routing weights and around its combine",
        node,
        part="target",
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
    ``silu_mul``, ``swish``, ``erf_gelu``, ``identity``, ..., or ``behaviour``: no spelling matched,
    the bindings hold the element-wise region, ``act_region``, for the probe proof); ``fc1_outputs`` the FC1 values
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
