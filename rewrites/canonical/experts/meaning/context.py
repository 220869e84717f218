"""The facts every transfer of one layer's walk shares: its sizes and its accumulators."""

from __future__ import annotations

from dataclasses import dataclass, field

from onnx_moe_fuse.rewrites.canonical.experts.meaning.terms import Meaning
from onnx_moe_fuse.rewrites.graph.dims import Dim

__all__ = ["Context"]


@dataclass
class Context:
    """``tokens`` (the token count T), ``k`` slots, ``experts`` E of the layer being walked.

    ``zeros``: the empty accumulator each zeros value of the graph stands for (one object per
    value, so a scatter into it and a gather from it are known to read the same accumulator).
    ``router``: the router's values, which a mask of the chosen experts may overwrite (argmax
    rounds) without the result becoming expert work.
    """

    tokens: Dim
    k: int
    experts: int
    zeros: dict[int, Meaning] = field(default_factory=dict)
    #: the values between the router projection and the TopK (``id``s): the router's own
    router: frozenset[int] = frozenset()
