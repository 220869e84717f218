"""Refusals: the one failure type, its part tag, the tracer, and the near-miss record.

Why a layer did not fuse travels as one type from where it is decided to the report:

* :class:`Refusal` is what every recogniser, proof, canonical pass and splice raises when it
  cannot prove what it reads (a subclass of onnxscript's ``MatchFailureError``, so a rule's
  ``check`` may raise it): the layer part at fault (one of :data:`PARTS`; None until tagged),
  the nodes and values it names (``failure_sources``; :attr:`~Refusal.node`,
  :attr:`~Refusal.value`), the reason in plain words and, where the refusing code knows them,
  the spelling it expected and the layer's routing TopK. :func:`part` tags the refusals raised
  inside it with their part (the innermost tag wins).
* A rule's ``check`` hands it to onnxscript as its failed ``MatchResult``
  (:meth:`Refusal.fail`). onnxscript keeps a failure as its reason text only, so the text
  carries the refusal (a ``str`` reading ``"part: reason"``, what onnxscript prints), and a
  tracer takes the typed refusal back with :func:`refusal_of`: nothing parses the text.
* :class:`RefusalTracer` keeps every match a rule set logs (onnxscript's ``MatchingTracer``
  keeps only the best-scoring ones): the near misses of a pass come from its rules' own
  failures in a dry run.
* A canonicalisation pass that leaves a layer as it is records its refusal while it runs, into
  a list the pipeline hands it (:meth:`Refusal.recorded_by`: the pass and the layer's routing
  TopK); :func:`recorded` finds it again. So no near miss re-runs a pass's analysis, and a
  rule that meets a layer a pass left names that pass in :attr:`Refusal.defer`: the pass's
  recorded refusal, where there is one, explains the layer better.
* :class:`NearMiss` is the report's record of one layer that did not fuse;
  :meth:`NearMiss.to_dict` is its JSON form.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import onnx_ir as ir
from onnxscript.rewriter import _basics

from onnx_moe_fuse.rewrites.graph.facts import label, value_label

__all__ = [
    "DENSE_EXPERTS",
    "EXPERT_LOOP",
    "MEANING",
    "CAPACITY_DISPATCH",
    "PARTS",
    "REPORT_KEYS",
    "SORTED_EXPERTS",
    "NearMiss",
    "Refusal",
    "RefusalTracer",
    "part",
    "recorded",
    "refusal_of",
    "source_label",
]

#: The parts a refusal can name: a MoE layer's, in the order its proof checks them, and the
#: attention prelude (RMSNorm + Q/K/V projections) as one part.
PARTS = (
    "tokens",
    "routing",
    "fc1",
    "activation",
    "fc2",
    "combine",
    "weights",
    "target",
    "region",
    "attention prelude",
)

#: The canonicalisation passes that record refusals (``Refusal.stage``), named as near misses
#: name them ("the dense-experts pass: ...").
DENSE_EXPERTS = "dense-experts"
EXPERT_LOOP = "expert-loop"
SORTED_EXPERTS = "sorted-experts"
MEANING = "meaning"
CAPACITY_DISPATCH = "capacity-dispatch"


def source_label(item: ir.Node | ir.Value) -> str:
    """How a report names a node or value a refusal is about."""
    return label(item) if isinstance(item, ir.Node) else value_label(item)


class Refusal(_basics.MatchFailureError):
    """A part of a layer that is not what the fused ops compute: part, nodes/values, reason.

    The one failure type of recognisers, proofs, canonicalisation passes and the splice.
    ``part`` is None until the proof step it was raised in tags it (:func:`part`; the first
    tag wins). ``expected`` is the spelling the recogniser looked for, where it has one.
    ``topk`` is the routing TopK of the layer the refusal is about, where the refusing code
    knows it; ``stage`` the canonicalisation pass that recorded it (:meth:`recorded_by`);
    ``defer`` a pass whose recorded refusal of ``topk``, where there is one, says more (a rule
    that meets a layer the pass left). Absent (None) sources are skipped.
    """

    def __init__(
        self,
        reason: str,
        *sources: ir.Node | ir.Value | None,
        part: str | None = None,
        expected: str | None = None,
        topk: ir.Node | None = None,
        defer: str | None = None,
    ) -> None:
        """A refusal for ``reason``, about the nodes/values ``sources``."""
        super().__init__(reason, *[s for s in sources if s is not None])
        self.part = part
        self.expected = expected
        self.topk = topk
        self.defer = defer
        self.stage: str | None = None

    @classmethod
    def of(cls, error: _basics.MatchFailureError, part: str | None = None) -> Refusal:
        """``error`` as a refusal (itself when it is one; onnxscript's own become one)."""
        if isinstance(error, Refusal):
            return error
        return cls(error.reason, *error.failure_sources, part=part)

    @property
    def node(self) -> ir.Node | None:
        """The first node the refusal names (a named value's producer otherwise)."""
        for s in self.failure_sources:
            if isinstance(s, ir.Node):
                return s
        for s in self.failure_sources:
            if isinstance(s, ir.Value) and s.producer() is not None:
                return s.producer()
        return None

    @property
    def value(self) -> ir.Value | None:
        """The first value the refusal names, None when it names nodes only."""
        return next((s for s in self.failure_sources if isinstance(s, ir.Value)), None)

    def message(self) -> str:
        """``"part: reason"`` (the reason alone when untagged): what onnxscript shows."""
        return f"{self.part}: {self.reason}" if self.part else self.reason

    def where(self) -> str:
        """The node or value at fault, in words: ``"node 'MatMul_12'"``."""
        if self.node is not None:
            return f"node '{label(self.node)}'"
        if self.value is not None:
            return f"value '{value_label(self.value)}'"
        return "the layer"

    def fail(self, match: _basics.MatchResult | None = None) -> _basics.MatchResult:
        """Fail ``match`` (a fresh ``MatchResult`` by default) with this refusal; return it.

        The failure's reason reads :meth:`message` and carries the refusal, for
        :func:`refusal_of`.
        """
        match = _basics.MatchResult() if match is None else match
        return match.fail(_Reason(self.message(), self._kept()), list(self.failure_sources))

    def recorded_by(self, stage: str, topk: ir.Node | None) -> Refusal:
        """Mark this refusal as ``stage``'s, about the layer routed by ``topk``; return it."""
        self.stage, self.topk = stage, topk
        return self._kept()

    def _kept(self) -> Refusal:
        """This refusal without its traceback and chained exceptions, to be kept.

        A kept exception keeps the frames it was raised through alive, and their locals hold
        what the proof read (a layer's weight arrays): a tracer that keeps every refusal would
        keep every layer's weights.
        """
        self.__traceback__ = self.__context__ = self.__cause__ = None
        return self


class _Reason(str):
    """A failure's reason text that carries its :class:`Refusal` (onnxscript keeps the text)."""

    refusal: Refusal

    def __new__(cls, text: str, refusal: Refusal) -> _Reason:
        made = super().__new__(cls, text)
        made.refusal = refusal
        return made


def refusal_of(match: _basics.MatchResult) -> Refusal | None:
    """The refusal a failed ``match`` carries (:meth:`Refusal.fail`); None for a plain one."""
    reason = match.reason
    return reason.refusal if isinstance(reason, _Reason) else None


@contextmanager
def part(name: str) -> Iterator[None]:
    """Tag a :class:`Refusal` raised inside with the part ``name`` it is about.

    The innermost tag wins, so a shared step (``routing_form``) tags its own refusals and a
    caller's broader tag does not overwrite them. onnxscript's own ``MatchFailureError``
    becomes a :class:`Refusal` of ``name``: there is one failure type.
    """
    assert name in PARTS, name
    try:
        yield
    except Refusal as refusal:
        if refusal.part is None:
            refusal.part = name
        raise
    except _basics.MatchFailureError as error:
        raise Refusal.of(error, name) from None


def recorded(refusals: Iterable[Refusal], stage: str, topk: ir.Node) -> Refusal | None:
    """The first refusal ``stage`` recorded for the layer routed by ``topk``, else None."""
    return next((r for r in refusals if r.stage == stage and r.topk is topk), None)


class RefusalTracer(_basics.MatchingTracer):
    """Keeps every match a rule set logs: ``(rule name, node, match result, status)``.

    onnxscript's ``MatchingTracer`` keeps only the best-scoring matches of each rule; a near
    miss needs every refused one. With a tracer, a ``RewriteRuleSet`` applies no rewrite: a
    traced run is a dry run.
    """

    def __init__(self) -> None:
        """Start with nothing logged."""
        super().__init__()
        self.logged: list[tuple[str, ir.Node, _basics.MatchResult, _basics.MatchStatus]] = []

    def log(self, rule, container, node, match_result, status) -> None:  # type: ignore[override]
        """Keep the match."""
        del container
        self.logged.append((str(rule), node, match_result, status))

    def matched(self) -> set[int]:
        """``id`` of every node some rule matched and checked successfully."""
        return {id(n) for _, n, _, s in self.logged if s == _basics.MatchStatus.SUCCESS}


#: The keys of a near miss in a report, in report order.
REPORT_KEYS = ("rule", "part", "node", "reason", "root", "topk", "router", "values")


@dataclass(frozen=True)
class NearMiss:
    """One layer (or attention prelude) that did not fuse, and why.

    ``rule``: the rule that refused (None when no rule matched); ``part``: the part at fault
    (one of :data:`PARTS`, None when unknown); ``node``: the node or value the reason is about;
    ``reason`` in plain words; ``root``: the node whose output the fused node would have
    replaced; ``topk``, ``router``: the routing TopK and the Softmax/Sigmoid before it;
    ``values``: every node or value the refusal names; ``value``: the first value it names;
    ``expected``: the spelling the recogniser looked for. Nodes and values are named as
    :func:`source_label` does. A report holds the :data:`REPORT_KEYS` (:meth:`to_dict`).
    """

    rule: str | None
    part: str | None
    node: str | None
    reason: str
    root: str | None = None
    topk: str | None = None
    router: str | None = None
    values: tuple[str, ...] = ()
    value: str | None = None
    expected: str | None = None

    @classmethod
    def of(
        cls,
        refusal: Refusal,
        *,
        rule: str | None,
        values: Iterable[str] | None = None,
        node: str | None = None,
        root: str | None = None,
        topk: str | None = None,
        router: str | None = None,
        part: str | None = None,
    ) -> NearMiss:
        """The record of ``refusal``: its part (``part`` when it has none), reason, sources.

        ``values`` names the sources (default :func:`source_label` of each); ``node`` is the
        first of them, else the ``node`` given.
        """
        if values is None:
            values = (source_label(s) for s in refusal.failure_sources)
        names = tuple(values)
        return cls(
            rule=rule,
            part=refusal.part if refusal.part is not None else part,
            node=names[0] if names else node,
            reason=refusal.reason,
            root=root,
            topk=topk,
            router=router,
            values=names,
            value=value_label(refusal.value) if refusal.value is not None else None,
            expected=refusal.expected,
        )

    @property
    def message(self) -> str:
        """``"part: reason"`` (the reason alone without a part)."""
        return f"{self.part}: {self.reason}" if self.part else self.reason

    def to_dict(self) -> dict[str, Any]:
        """The report's JSON form: the :data:`REPORT_KEYS`, in that order."""
        out = {k: getattr(self, k) for k in REPORT_KEYS}
        out["values"] = list(self.values)
        return out
