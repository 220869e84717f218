"""What :func:`onnx_moe_fuse.verify.checker.verify` reports: per path, per output, per seed.

:class:`VerificationReport` holds a :class:`PathResult` per evaluation path, each an
:class:`OutputResult` per graph output with a :class:`SeedError` per seed; every one has a
JSON-ready ``to_dict()``. :func:`fail_path` marks a path failed with its message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "OutputResult",
    "PathResult",
    "SeedError",
    "VerificationError",
    "VerificationReport",
    "fail_path",
]


class VerificationError(AssertionError):
    """Raised by :meth:`VerificationReport.raise_for_failure` when a verification failed."""


@dataclass
class SeedError:
    """The error of one output for one seed."""

    seed: int
    max_abs: float
    max_rel: float
    passed: bool


@dataclass
class OutputResult:
    """One graph output on one evaluation path, over all seeds."""

    name: str
    dtype: str
    rtol: float
    atol: float
    per_seed: list[SeedError] = field(default_factory=list)
    problem: str | None = None  # shape/dtype mismatch, missing output

    @property
    def passed(self) -> bool:
        """Every seed within tolerance and no structural problem."""
        return self.problem is None and all(s.passed for s in self.per_seed)

    @property
    def max_abs(self) -> float:
        """The largest max-abs error over the seeds (nan before any seed ran)."""
        return max((s.max_abs for s in self.per_seed), default=math.nan)

    @property
    def max_rel(self) -> float:
        """The largest max-rel error over the seeds (nan before any seed ran)."""
        return max((s.max_rel for s in self.per_seed), default=math.nan)

    @property
    def worst_seed(self) -> int | None:
        """The seed with the largest relative error."""
        if not self.per_seed:
            return None
        return max(self.per_seed, key=lambda s: (s.max_rel, s.max_abs)).seed

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form (non-finite numbers as the strings "inf"/"nan")."""
        return {
            "passed": self.passed,
            "dtype": self.dtype,
            "max_abs": _num(self.max_abs),
            "max_rel": _num(self.max_rel),
            "worst_seed": self.worst_seed,
            "rtol": self.rtol,
            "atol": self.atol,
            "problem": self.problem,
            "per_seed": [
                {
                    "seed": s.seed,
                    "max_abs": _num(s.max_abs),
                    "max_rel": _num(s.max_rel),
                    "passed": s.passed,
                }
                for s in self.per_seed
            ],
        }


@dataclass
class PathResult:
    """One evaluation path of the fused model."""

    path: str
    status: str = "passed"  # "passed", "failed" or "skipped"
    reason: str | None = None  # why it was skipped, or the error that stopped it
    outputs: dict[str, OutputResult] = field(default_factory=dict)
    tolerance_notes: list[str] = field(default_factory=list)
    #: nodes this path did not run as it claims (the wgpu path's oracle fallbacks), in words
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "status": self.status,
            "reason": self.reason,
            "tolerance_notes": list(self.tolerance_notes),
            "notes": list(self.notes),
            "outputs": {name: out.to_dict() for name, out in self.outputs.items()},
        }


@dataclass
class VerificationReport:
    """The outcome of :func:`verify`."""

    passed: bool
    seeds: tuple[int, ...]
    dim_values: dict[str, int]
    paths: dict[str, PathResult]
    messages: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form: ``passed``, ``seeds``, ``dim_values``, ``paths``, ``messages``."""
        return {
            "passed": self.passed,
            "seeds": list(self.seeds),
            "dim_values": dict(self.dim_values),
            "paths": {name: p.to_dict() for name, p in self.paths.items()},
            "messages": list(self.messages),
        }

    def summary(self) -> str:
        """Several lines for people: the verdict, each path, and every failure message."""
        lines = [f"verification {'PASSED' if self.passed else 'FAILED'} (seeds {list(self.seeds)})"]
        for name, p in self.paths.items():
            if p.status == "skipped":
                lines.append(f"  {name}: skipped: {p.reason}")
                continue
            worst = ", ".join(
                f"{o.name} max abs {o.max_abs:.3g} max rel {o.max_rel:.3g}"
                for o in p.outputs.values()
            )
            lines.append(f"  {name}: {p.status}" + (f" ({worst})" if worst else ""))
            lines.extend(f"    note: {note}" for note in (*p.tolerance_notes, *p.notes))
        lines.extend(f"  {m}" for m in self.messages)
        return "\n".join(lines)

    def raise_for_failure(self) -> None:
        """Raise :class:`VerificationError` with :meth:`summary` when not passed."""
        if not self.passed:
            raise VerificationError(self.summary())

    def __str__(self) -> str:
        """The :meth:`summary`."""
        return self.summary()


def _num(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def fail_path(result: PathResult, message: str, messages: list[str]) -> None:
    """Mark the path ``result`` failed with ``message``, and add it to the report's ``messages``."""
    result.status = "failed"
    result.reason = message
    messages.append(f"FAILED {result.path}: {message}")
