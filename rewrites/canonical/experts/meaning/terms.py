"""What a value of a candidate MoE layer holds: index factors per axis, and a term.

A :class:`Meaning` describes one tensor as an indexed expression. Each axis is a tuple of
:class:`Factor` s merged row-major (an axis of ``[T*k, H]`` rows is ``(t, j)``), so a Reshape that
merges or splits axes only regroups factors. A factor's ``var`` names the index it runs over:

* ``t`` the router's token rows (split ``t.0/2``, ``t.1/2`` where tokens are ``[B, S, H]``),
  ``j`` the top-k slot, ``h`` the hidden features the experts read;
* a weight's own feature axes ``<weight>#<axis>``, an activation's slice ``<node>#f``;
* ``*<n>``: a *repeat*, an axis the content does not depend on (``Expand``/``Tile`` copies);
  a repeat matches any index of its size, which is how tokens repeated over the slots meet
  weights selected per slot.

The term says what is held at each index (free indices are the axes' factors):

=================  ===============================================================
``Tokens``         ``X[t, h]``, the rows the router reads
``Ids``            ``idx[t, j]``, the TopK's expert indices
``RowIndex``       an integer tensor holding ``sum c_v * v`` (``Range(T*k) // k`` holds ``t``)
``Weights``        ``w[t, j]``: a value computed from the routing alone, ``[T, k]``
``Routing``        another value of the routing alone (a row sum of the weights, ...)
``Param``          a constant ``[E, ...]`` stack of expert weights; ``selected`` once gathered
                   at ``idx[t, j]`` (the expert axis replaced by the ids' axes)
``Proj``           ``sum_c in[.., c] * W[idx[t, j], c, n] (+ b[idx[t, j], n])`` (FC1: ``in`` is
                   the tokens; FC2: the activation)
``Act``            an elementwise function of FC1's projections (its nodes kept, to copy)
``Weighted``       ``w[t, j] * FC2[t, j, o]``
``SlotSum``        ``sum over j in slots of w[t, j] * FC2[t, j, o]``; the layer when complete
=================  ===============================================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import count

import onnx_ir as ir

from onnx_moe_fuse.rewrites.graph.dims import Dim, product

__all__ = [
    "Act",
    "Axis",
    "Factor",
    "Ids",
    "Meaning",
    "Param",
    "Proj",
    "RowIndex",
    "Routing",
    "SlotSum",
    "Term",
    "Tokens",
    "Weighted",
    "Weights",
    "WeightSource",
    "axis_size",
    "fresh_repeat",
    "is_repeat",
    "is_row_var",
    "filtered_var",
    "filtered_expert",
    "Mask",
    "Coords",
    "ExpertSum",
    "AccRows",
    "BranchUpdate",
    "DenseWeights",
    "Counts",
    "Chosen",
    "SORTED",
]

_REPEATS = count()


@dataclass(frozen=True)
class Factor:
    """One index an axis runs over, with its size."""

    var: str
    size: Dim

    def __str__(self) -> str:
        """The var, e.g. ``t``."""
        return self.var


Axis = tuple[Factor, ...]  # () is a unit axis


def axis_size(axis: Axis) -> Dim:
    """The axis' size: the product of its factors."""
    return product([f.size for f in axis])


def fresh_repeat(size: Dim) -> Factor:
    """A new repeat factor of ``size``."""
    return Factor(f"*{next(_REPEATS)}", size)


def is_repeat(var: str) -> bool:
    """Whether ``var`` is a repeat (content independent of it)."""
    return var.startswith("*")


def is_row_var(var: str) -> bool:
    """Token, slot, filtered-row or repeat indices (the rest are feature indices)."""
    return var in ("j", "t", "e") or var.startswith(("t.", "@")) or is_repeat(var)


def filtered_var(expert: int, sorted_rows: bool = False) -> str:
    """The index over the (token, slot) pairs that chose ``expert``.

    In row-major order (``NonZero``'s, ``@e``), or in the order of an argsort of the ids
    (``@es``: a segment of :data:`SORTED`); two orders never meet in one elementwise op.
    """
    return f"@{expert}s" if sorted_rows else f"@{expert}"


#: The index over every (token, slot) pair in the order of an argsort of the flat ids.
SORTED = "@s"


def filtered_expert(var: str) -> int | None:
    """The expert a filtered-row index is over (None for other indices)."""
    digits = var[1:-1] if var.endswith("s") else var[1:]
    return int(digits) if var.startswith("@") and digits.isdigit() else None


class Term:
    """What a value holds; subclasses are frozen dataclasses compared by identity of values."""

    #: how far along the layer a term is (the departure report names the furthest one)
    progress = 0

    def text(self) -> str:  # pragma: no cover - every term overrides it
        """The term as an indexed expression."""
        raise NotImplementedError


@dataclass(frozen=True)
class Tokens(Term):
    """``X[t, h]``: the token rows the router reads."""

    def text(self) -> str:
        """``X[t, h]``."""
        return "the tokens X[t, h]"


@dataclass(frozen=True)
class Ids(Term):
    """``idx[t, j]``: the TopK's expert indices."""

    progress = 1

    def text(self) -> str:
        """``idx[t, j]``."""
        return "the expert indices idx[t, j]"


@dataclass(frozen=True)
class RowIndex(Term):
    """An integer tensor whose element at the axes' indices is ``sum c_v * v``."""

    coefs: tuple[tuple[str, int], ...]
    div: int = 1  # a float division not yet floored: the value is the sum / div
    sign: bool = False  # the sign of the index (1, or 0 where it is 0)

    def text(self) -> str:
        """E.g. ``the integers t*2 + j``."""
        terms = [v if c == 1 else f"{v}*{c}" for v, c in self.coefs]
        value = " + ".join(terms) or "0"
        if self.sign:
            return f"the sign of {value}"
        return f"the integers {value}" if self.div == 1 else f"({value}) / {self.div}"


@dataclass(frozen=True, eq=False)
class Weights(Term):
    """``w[t, j]``: a ``[T, k]`` value computed from the routing alone (``source``)."""

    source: ir.Value

    def text(self) -> str:
        """``w[t, j]``."""
        return f"the routing weights w[t, j] ('{self.source.name}')"


@dataclass(frozen=True)
class Routing(Term):
    """A value of the routing alone that is not ``[T, k]`` weights (a row sum, the scores)."""

    def text(self) -> str:
        """A routing value."""
        return "a value of the router alone"


@dataclass(frozen=True, eq=False)
class WeightSource:
    """A constant ``[E, ...]`` weight stack: one value, or a DequantizeLinear of constants.

    ``dq``: the DequantizeLinear node whose inputs were gathered at the ids (its codes, scales
    and zero points are ``inputs``, ungathered); None for a plain constant ``value``.
    """

    value: ir.Value | None
    inputs: tuple[ir.Value | None, ...] = ()
    dq: ir.Node | None = None

    @property
    def name(self) -> str:
        """The weight's name for reports."""
        v = self.value if self.value is not None else self.inputs[0]
        return (v.name if v is not None else None) or "weights"


@dataclass(frozen=True, eq=False)
class Param(Term):
    """A constant expert stack; ``feats`` names its feature axes in the source's order."""

    source: WeightSource
    feats: tuple[str, ...]
    selected: bool = False
    single: bool = False  # one expert's own weight (no expert axis): a loop's branch
    experts: tuple[Param, ...] = ()  # selected: the experts' own weights, in expert order

    progress = 1

    def text(self) -> str:
        """``W[idx[t, j], a, b]``, ``W[e, a, b]`` or one expert's ``W[a, b]``."""
        if self.single:
            return f"the weight {self.source.name}[{', '.join(self.feats)}]"
        e = "idx[t, j]" if self.selected else "e"
        return f"the expert weights {self.source.name}[{', '.join((e, *self.feats))}]"


@dataclass(frozen=True, eq=False)
class Proj(Term):
    """``sum_c in[.., c] * W[idx[t, j], c, n] (+ b[idx[t, j], n])``; ``stage`` 1 (FC1) or 2."""

    stage: int
    input: Term
    weight: Param
    contracted: str  # the weight's feature var summed over
    out_var: str  # the weight's feature var of the output
    bias: Param | None = None
    expert: int | None = None  # a loop branch's expert (its rows chose it), else None

    @property
    def progress(self) -> int:  # type: ignore[override]
        """FC1 2, FC2 4."""
        return 2 if self.stage == 1 else 4

    def text(self) -> str:
        """E.g. ``FC1[t, j, n] = X[t] @ W1[idx[t, j]]``."""
        what = "the tokens" if self.stage == 1 else "the activations"
        bias = f" + {self.bias.source.name}[idx[t, j]]" if self.bias is not None else ""
        return f"FC{self.stage}: {what} of row t times {self.weight.source.name}[idx[t, j]]{bias}"


@dataclass(frozen=True, eq=False)
class Act(Term):
    """An elementwise function of FC1's projections: ``leaves``, computed by ``nodes``."""

    leaves: tuple[Proj, ...]
    nodes: tuple[ir.Node, ...] = field(default=())

    progress = 3

    def text(self) -> str:
        """E.g. ``act(FC1[t, j, :])``."""
        ops = ", ".join(sorted({n.op_type for n in self.nodes}))
        return f"an elementwise function ({ops}) of FC1's outputs per slot"


@dataclass(frozen=True, eq=False)
class Weighted(Term):
    """``w[t, j] * FC2[t, j, o]``."""

    weights: Weights
    expert: Proj
    dense: bool = False  # every expert's output, weighted by w scattered to [T, E]

    progress = 5

    def text(self) -> str:
        """``w[t, j] * FC2[t, j, o]``."""
        return "w[t, j] * FC2[t, j, o], per slot"


@dataclass(frozen=True, eq=False)
class SlotSum(Term):
    """``sum over j in slots of w[t, j] * FC2[t, j, o]``."""

    inner: Weighted
    slots: frozenset[int]

    progress = 6

    def text(self) -> str:
        """``sum_j w[t, j] * FC2[t, j, o]``."""
        return f"the sum over slots {sorted(self.slots)} of w[t, j] * FC2[t, j, o]"


@dataclass(frozen=True)
class Mask(Term):
    """``idx[t, j] == expert`` (or the one-hot ``idx[t, j] == e`` over an ``e`` axis: None)."""

    expert: int | None

    progress = 1

    def text(self) -> str:
        """``[idx[t, j] == e]``."""
        e = "e" if self.expert is None else str(self.expert)
        return f"the mask idx[t, j] == {e}"


@dataclass(frozen=True)
class Coords(Term):
    """Index tuples along a coordinate axis ``c``: element i holds index ``vars[i]``."""

    vars: tuple[str, ...]

    progress = 1

    def text(self) -> str:
        """E.g. ``the index pairs (t, j)``."""
        return f"the index tuples ({', '.join(self.vars)})"


@dataclass(frozen=True, eq=False)
class ExpertSum(Term):
    """``sum over the experts in branches of their weighted outputs`` at each row's token.

    Each branch is ``(e, w[t, j] * FC2_e[t, j, o])`` over the rows that chose ``e``; complete
    when every expert has its branch: then it is ``sum_j w[t, j] * FC2_{idx[t, j]}``.
    """

    branches: tuple[tuple[int, Weighted], ...]

    progress = 6

    @property
    def experts(self) -> frozenset[int]:
        """The experts summed so far."""
        return frozenset(e for e, _ in self.branches)

    def text(self) -> str:
        """The experts summed."""
        return f"the weighted outputs of experts {sorted(self.experts)} added at their tokens"


@dataclass(frozen=True, eq=False)
class AccRows(Term):
    """Rows of a partial :class:`ExpertSum` read at the tokens of a loop branch's rows."""

    total: ExpertSum

    progress = 5

    def text(self) -> str:
        """The accumulator read back."""
        return f"{self.total.text()}, read at a branch's tokens"


@dataclass(frozen=True)
class Counts(Term):
    """How many (token, slot) pairs chose each expert of ``experts`` (in that order)."""

    experts: tuple[int, ...] | None  # None: every expert, along an ``e`` axis

    progress = 1

    def text(self) -> str:
        """The counts."""
        which = "every expert" if self.experts is None else f"experts {list(self.experts)}"
        return f"the number of rows that chose {which}"


@dataclass(frozen=True)
class Chosen(Term):
    """``[e in idx[t, :]]``: 1 where token t chose expert e (``expert``: that one's column)."""

    expert: int | None = None  # None: every expert, along an ``e`` axis

    progress = 1

    def text(self) -> str:
        """The choice matrix, or one expert's column of it."""
        if self.expert is not None:
            return f"the 0/1 choices [{self.expert} in idx[t, :]] per token"
        return "the 0/1 choices [e in idx[t, :]]"


@dataclass(frozen=True, eq=False)
class DenseWeights(Term):
    """``sum_j w[t, j] * [idx[t, j] == e]``: the weights scattered to every expert.

    Not ``summed``: still per slot, ``w[t, j] * [idx[t, j] == e]``.
    """

    weights: Weights
    summed: bool

    progress = 1

    def text(self) -> str:
        """The dense weights."""
        what = "sum_j " if self.summed else ""
        return f"the weights {what}w[t, j] * [idx[t, j] == e] of every expert"


@dataclass(frozen=True, eq=False)
class BranchUpdate(Term):
    """An accumulator's rows at a branch's tokens plus that branch's weighted rows."""

    total: ExpertSum
    weighted: Weighted

    progress = 5

    def text(self) -> str:
        """The update a branch writes back."""
        return f"{self.total.text()} read at expert {self.weighted.expert.expert}'s rows, plus its weighted outputs"


@dataclass(frozen=True, eq=False)
class Meaning:
    """A value's axes (factors, row-major per axis) and what it holds."""

    axes: tuple[Axis, ...]
    term: Term

    def factors(self) -> list[Factor]:
        """Every factor, in row-major order."""
        return [f for axis in self.axes for f in axis]

    def vars(self) -> list[str]:
        """Every factor's var, in order."""
        return [f.var for f in self.factors()]

    def layout(self) -> str:
        """E.g. ``[(t, j), h]``."""
        parts = ["(" + ", ".join(map(str, a)) + ")" if len(a) > 1 else str(a[0]) if a else "1"
                 for a in self.axes]  # fmt: skip
        return "[" + ", ".join(parts) + "]"

    def text(self) -> str:
        """The layout and the term."""
        return f"{self.term.text()} laid out {self.layout()}"
