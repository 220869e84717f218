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
    #: graph positions of the nodes (``id``), and the TopK's: a node before it cannot read it
    order: dict[int, int] = field(default_factory=dict)
    topk_at: int = -1
    #: the router rows' token axes (``t``, or ``t.hi, t.lo`` of ``[B, S, H]`` rows)
    token_axes: tuple = ()
    #: the walk's meanings so far (``id`` of a value -> (value, meaning)), to read a shape's source
    meanings: dict = field(default_factory=dict)
    #: the index names of the TopK's own outputs: ``[t, j]``, or ``[t.hi, t.lo, j]`` where the
    #: router scores ``[B, S, E]`` rows without flattening them (None: ``[t, j]``)
    slots: tuple[tuple[str, ...], ...] | None = None

    def names(self, *axes: tuple[str, ...]) -> list[list[str]]:
        """The index names of a layout of ``t`` and ``j`` axes as the analysis writes it.

        A static token count of 1 (or k = 1) makes ``t`` (or ``j``) a unit factor, which no
        layout keeps: ``[t, j]`` at T = 1 is ``[[], ["j"]]``.
        """
        unit = {"t": self.tokens == Dim.of(1), "j": self.k == 1}
        return [[v for v in axis if not unit.get(v, False)] for axis in axes]

    def per_slot(self, names: list[list[str]]) -> bool:
        """A layout of ``[T, k]`` routing values: ``[t, j]``, or the TopK's own (``[B, S, k]``)."""
        if names == self.names(("t",), ("j",)):
            return True
        return self.slots is not None and names == [list(a) for a in self.slots]
