"""Properties of the planner's choice, shared by the kernel test modules.

The planner's priorities follow measurements (docs/kernels-moe.md), and measurements change
with the kernels; so the tests do not pin which variant a call gets. They check properties:

* :func:`assert_valid_choice`: the chosen variant can run the call. Every ``when`` condition
  of the manifest and of the variant holds in the plan's scope, its required features and
  limits are the device's, it is not among the rejected variants, and it has the highest
  priority of the variants that can run (the planner's rule). On every adapter.
* :func:`assert_near_fastest`: on a real GPU, the chosen variant's median time is within
  :data:`SPEED_TOLERANCE` (10%) of the fastest variant that can run the call, every one timed
  on the same inputs with GPU timestamps (:meth:`Kernel.time`). CPU adapters (lavapipe) are
  for correctness, not speed: there only validity is checked.

Imported as ``planning`` (pytest puts this folder on ``sys.path``).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping
from typing import Any

import numpy as np

from onnx_moe_fuse.kernels.cases import KernelCase
from onnx_moe_fuse.kernels.expressions import ExpressionError
from onnx_moe_fuse.kernels.planner import MANIFEST_DTYPES, KernelCallError, Plan

#: The chosen variant may be this much slower than the fastest that can run the call.
SPEED_TOLERANCE = 0.10


def condition_failures(plan: Plan, variant_id: str | None = None) -> list[str]:
    """The ``when`` conditions and requirements of a variant that do not hold for ``plan``.

    Evaluated afresh in the plan's scope (not read from ``plan.rejected``); the plan's own
    variant unless ``variant_id`` names another.
    """
    manifest = plan.manifest
    vid = variant_id or plan.variant_id
    variant = next(v for v in manifest.variants if v.id == vid)
    scope = plan.scope

    def holds(expression: str) -> bool:
        try:
            return bool(scope.evaluate(expression))
        except ExpressionError:  # e.g. a rule about an absent optional tensor
            return False

    failed = []
    for feature in variant.requires.features:
        if not holds(f"device.features.has({feature!r})"):
            failed.append(f"requires feature {feature}")
    for name, minimum in variant.requires.limits.items():
        if not holds(f"device.limits.{name} >= {minimum}"):
            failed.append(f"requires {name} >= {minimum}")
    if variant.requires.subgroup_matrix_configs:
        failed.append("requires subgroup matrix configurations")
    failed += [c for c in (*manifest.when, *variant.when) if not holds(c)]
    return failed


def assert_valid_choice(plan: Plan) -> str:
    """Assert the plan's variant can run its call and wins by priority; return its id."""
    vid = plan.variant_id
    assert vid is not None, plan.explain()
    assert vid not in plan.rejected, plan.explain()
    failed = condition_failures(plan)
    assert not failed, f"{vid} chosen although {failed} do not hold\n{plan.explain()}"
    top = max(plan.priorities.values())
    assert plan.priorities[vid] == top, (vid, plan.priorities)
    # The ones the planner rejected really fail a condition; the accepted ones hold.
    for other in plan.manifest.variants:
        if other.id in plan.rejected:
            assert condition_failures(plan, other.id), (other.id, plan.rejected[other.id])
        else:
            assert not condition_failures(plan, other.id), other.id
    return vid


def runnable(kernel: Any, plan: Plan) -> list[str]:
    """The variants that can run the plan's call (accepted by the planner), manifest order."""
    return [v for v in kernel.variants if v not in plan.rejected]


# -- timing on a GPU ------------------------------------------------------------------------


def median_seconds(kernel: Any, plan: Plan, runs: int, warmup_seconds: float) -> float:
    """Median GPU seconds of one plan (inputs uploaded once, timestamps where available)."""
    times, _ = kernel.time(plan, runs=runs, warmup=1, warmup_seconds=warmup_seconds)
    return statistics.median(times)


def time_variants(
    kernel: Any,
    call: Mapping[str, np.ndarray],
    attrs: Mapping[str, Any],
    tunables: Mapping[str, Any] | None = None,
    runs: int = 9,
    warmup_seconds: float = 0.3,
) -> tuple[str, dict[str, float]]:
    """(the planner's choice, median seconds of every variant that can run the call)."""
    plan = kernel.plan(attrs=attrs, tunables=tunables, **call)
    chosen = assert_valid_choice(plan)
    times = {}
    for vid in runnable(kernel, plan):
        forced = kernel.plan(attrs=attrs, tunables=tunables, variant=vid, **call)
        times[vid] = median_seconds(kernel, forced, runs, warmup_seconds)
    return chosen, times


def measure_choice(
    kernel: Any,
    call: Mapping[str, np.ndarray],
    attrs: Mapping[str, Any],
    what: str,
    tunables: Mapping[str, Any] | None = None,
    tolerance: float = SPEED_TOLERANCE,
) -> tuple[str, dict[str, float], str | None]:
    """(choice, median seconds per runnable variant, why it is too slow or None).

    Every runnable variant is timed once; where the choice looks slower than allowed, the
    choice and the fastest are timed again, alternately, three times each with more runs,
    and the medians of those decide (one slow measurement, e.g. a clock change, is not a
    planner error; the returned times are then those medians).
    """
    chosen, times = time_variants(kernel, call, attrs, tunables)
    best = min(times, key=times.get)
    report = ", ".join(f"{v} {t * 1e3:.3f}" for v, t in sorted(times.items(), key=lambda x: x[1]))
    print(f"{what}: chose {chosen}; ms: {report}")
    if times[chosen] <= (1 + tolerance) * times[best]:
        return chosen, times, None
    plans = {
        v: kernel.plan(attrs=attrs, tunables=tunables, variant=v, **call) for v in {chosen, best}
    }
    again: dict[str, list[float]] = {chosen: [], best: []}
    for _ in range(3):
        for vid, plan in plans.items():
            again[vid].append(median_seconds(kernel, plan, runs=21, warmup_seconds=0.3))
    settled = {v: statistics.median(ts) for v, ts in again.items()}
    print(f"{what}: re-timed ms: " + ", ".join(f"{v} {t * 1e3:.3f}" for v, t in settled.items()))
    times = {**times, **settled}
    if settled[chosen] <= (1 + tolerance) * settled[best]:
        return chosen, times, None
    return (
        chosen,
        times,
        (
            f"{what}: the planner chose {chosen} ({settled[chosen] * 1e3:.3f} ms), more than "
            f"{tolerance:.0%} slower than {best} ({settled[best] * 1e3:.3f} ms); first round: {report}"
        ),
    )


def assert_near_fastest(
    kernel: Any,
    call: Mapping[str, np.ndarray],
    attrs: Mapping[str, Any],
    what: str,
    tunables: Mapping[str, Any] | None = None,
    tolerance: float = SPEED_TOLERANCE,
) -> tuple[str, dict[str, float]]:
    """Assert the planner's choice is within ``tolerance`` of the fastest runnable variant.

    See :func:`measure_choice`; returns the choice and the medians (seconds).
    """
    chosen, times, slow = measure_choice(kernel, call, attrs, what, tunables, tolerance)
    assert slow is None, slow
    return chosen, times


# -- bench.json inputs -------------------------------------------------------------------------


def zeros_call(case: KernelCase) -> dict[str, np.ndarray]:
    """A case's inputs as zeros: enough to plan (untouched zero pages cost no memory)."""
    return {
        key: np.zeros(tuple(spec["shape"]), MANIFEST_DTYPES[spec["dtype"]])
        for key, spec in case.inputs.items()
        if spec is not None
    }


def binding_overflow(case: KernelCase, limits: Mapping[str, int]) -> dict[str, int]:
    """The case's inputs larger than one storage binding on this device (bytes by key)."""
    limit = min(limits["maxStorageBufferBindingSize"], limits["maxBufferSize"])
    sizes = {
        key: math.prod(spec["shape"]) * MANIFEST_DTYPES[spec["dtype"]].itemsize
        for key, spec in case.inputs.items()
        if spec is not None
    }
    return {k: n for k, n in sizes.items() if n > limit}


class CaseInputs:
    """Random inputs of bench.json cases; a weight with the same spec as before is reused.

    Weights dominate (up to 3.2 GB for float32 gpt-oss): the cases of one layer share them.
    """

    def __init__(self, rng: np.random.Generator, shared: tuple[str, ...]):
        self.rng = rng
        self.shared = shared
        self._kept: dict[str, tuple[str, np.ndarray]] = {}

    def _draw(self, spec: dict) -> np.ndarray:
        dtype, shape = MANIFEST_DTYPES[spec["dtype"]], tuple(spec["shape"])
        if spec["random"] == "integers":
            return self.rng.integers(spec["low"], spec["high"], size=shape, dtype=dtype)
        if spec["random"] == "uniform":
            low, high = spec.get("low", -1.0), spec.get("high", 1.0)
            return self.rng.uniform(low, high, size=shape).astype(dtype)
        out = self.rng.standard_normal(shape, dtype=np.float32)
        out *= spec.get("scale", 1.0)
        return out.astype(dtype, copy=False)

    def call(self, case: KernelCase) -> dict[str, np.ndarray]:
        """The case's arrays (literal inputs as given)."""
        out = {}
        for key, spec in case.inputs.items():
            if spec is None:
                continue
            if "random" not in spec:
                out[key] = case.materialize(self.rng)[key]
            elif key not in self.shared:
                out[key] = self._draw(spec)
            else:
                tag = json.dumps(spec, sort_keys=True)
                kept = self._kept.get(key)
                if kept is None or kept[0] != tag:
                    self._kept.pop(key, None)  # free the old weights before drawing new ones
                    kept = self._kept[key] = (tag, self._draw(spec))
                out[key] = kept[1]
        return out


def plan_or_none(kernel: Any, call: Mapping[str, np.ndarray], attrs: Mapping[str, Any]):
    """The plan of a call, or None where no variant (or the contract) accepts it here."""
    try:
        return kernel.plan(attrs=attrs, **call)
    except KernelCallError:
        return None
