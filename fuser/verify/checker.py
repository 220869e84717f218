"""The equivalence checker: run the original and the fused model on random inputs and compare.

:func:`verify` draws fresh random inputs for every seed (:func:`onnx_moe_fuse.verify.reference.
random_feeds`: standard-normal floats, integers in ``[0, 4)``, symbolic dims given small
values), runs the **original** model on the reference path (:func:`onnx_moe_fuse.verify.reference.
run_reference`: ``onnx.reference`` plus the numpy oracles) and the **fused** model on each
evaluation path, and compares every graph output of the original:

* ``"wgpu"``: :func:`onnx_moe_fuse.verify.evaluator.run_wgpu`, fused nodes on the project's WebGPU
  kernels, the other com.microsoft ops a model may hold (``MatMulNBits``, the simplified layer
  norms) in the reference path's numpy code, standard ops in ``onnx.reference``. Skipped, with
  the reason, while a kernel package the model needs is not installed.
* ``"ort"``: onnxruntime's CPU provider with graph optimisations disabled (ORT's optimiser
  rewrites DequantizeLinear + MatMul into MatMulNBits with int8 activations). Skipped, with the
  reason, where ORT has no CPU kernel for some node (``com.microsoft.MatMulNBitsQkv``,
  ``GroupedMatMul``/opset 29). Any other ORT error fails the path: the fused model is meant to
  run there.

Error measure, per output and seed: ``max_abs = max|fused - reference|`` and ``max_rel =
max_abs / max|reference|`` (over the whole output, so one tiny reference element does not
dominate). An output passes when ``max_abs <= max(rtol * max|reference|, atol)``: ``atol`` is an
absolute floor for outputs that are (nearly) all zeros. Defaults by the reference output's dtype
(:data:`DEFAULT_TOLERANCES`): float32/float64 ``rtol 1e-4, atol 1e-6``; float16 ``1e-2, 1e-3``;
bfloat16 ``5e-2, 1e-2``; integer and bool outputs must match exactly. On the ORT path, a model
with block-wise 8-bit QMoE (or QMoE/MatMulNBits with ``accuracy_level=4``) gets ``rtol``
:data:`ORT_INT8_ACTIVATION_RTOL`: ORT quantises activations to int8 there (measured 1-2%
relative error); the report says so. A caller's ``rtol``/``atol`` replace these defaults on every
path. Matching NaN/inf positions count as equal; any other non-finite difference fails.

Before anything runs, the random inputs are sized (:func:`onnx_moe_fuse.verify.reference.feed_shapes`):
inputs over :data:`onnx_moe_fuse.verify.reference.MAX_FEED_BYTES` in all raise
:class:`onnx_moe_fuse.verify.reference.FeedTooLargeError` (a ``ValueError`` naming the input, its shape
and size), a bad-input error rather than a failed verification.

A path fails when any output of any seed is out of tolerance, has another shape or dtype, is
missing, or when the model cannot run there. The report is ``passed`` only when no path failed
and at least one path ran; each failure adds a human message naming the path, output, seed and
error (:attr:`VerificationReport.messages`).
"""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np
import onnx
import onnx_ir

from onnx_moe_fuse.contract import targets as ort_contract
from onnx_moe_fuse.io.model_io import exceeds_protobuf_limit, load_model
from onnx_moe_fuse.verify.evaluator import (
    describe_node,
    iter_nodes,
    missing_kernel_packages,
    wgpu_evaluator,
)
from onnx_moe_fuse.verify.reference import (
    DEFAULT_DIM_VALUES,
    FeedTooLargeError,
    feed_shapes,
    random_feeds,
    run_reference,
)

__all__ = [
    "DEFAULT_TOLERANCES",
    "FeedTooLargeError",
    "ORT_INT8_ACTIVATION_RTOL",
    "PATHS",
    "OutputResult",
    "PathResult",
    "SeedError",
    "VerificationError",
    "VerificationReport",
    "ort_inexact_reasons",
    "ort_unsupported_reason",
    "verify",
]

ModelLike = onnx.ModelProto | onnx_ir.Model | str | os.PathLike[str]

#: Evaluation paths of the fused model, in the order they run.
PATHS: tuple[str, ...] = ("wgpu", "ort")

#: ``(rtol, atol)`` by the reference output's dtype name; see the module docstring.
DEFAULT_TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-4, 1e-6),
    "float32": (1e-4, 1e-6),
    "float16": (1e-2, 1e-3),
    "bfloat16": (5e-2, 1e-2),
}
#: rtol on the ORT path where ORT quantises activations to int8 (measured error 1-2%).
ORT_INT8_ACTIVATION_RTOL = 5e-2
_DEFAULT_DIM = 3  # random_feeds' value for symbolic dims without a given value
_FLOAT_DTYPES = {np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)}
_FLOAT_DTYPES.add(np.dtype(ml_dtypes.bfloat16))
_MS = "com.microsoft"

#: Ops for which ONNX Runtime's CPU provider has no kernel (measured with ORT 1.32): the fused
#: ops the ort-cpu target lacks (:mod:`onnx_moe_fuse.contract.targets`), and GroupedMatMul.
ORT_NO_CPU_KERNEL: dict[tuple[str, str], str] = {
    **{
        (_MS, op): f"ORT has no CPU kernel for com.microsoft.{op}"
        for op in sorted(set(ort_contract.SEMANTIC_ATTRIBUTES) - ort_contract.ops_for("ort-cpu"))
    },
    ("", "GroupedMatMul"): (
        "ORT has no CPU kernel for GroupedMatMul (ONNX opset 29; ORT 1.32 refuses opset 29)"
    ),
}


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

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "status": self.status,
            "reason": self.reason,
            "tolerance_notes": list(self.tolerance_notes),
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
            lines.extend(f"    note: {note}" for note in p.tolerance_notes)
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


# -- tolerances and the ORT path ----------------------------------------------------------------


def _attr(node: onnx.NodeProto, name: str, default: Any) -> Any:
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def ort_inexact_reasons(model: onnx.ModelProto) -> list[str]:
    """Why ORT CPU computes some node of ``model`` inexactly (int8 activations), if it does."""
    reasons: list[str] = []
    for node in iter_nodes(model):
        if node.domain != _MS:
            continue
        if node.op_type == "QMoE":
            bits = int(_attr(node, "expert_weight_bits", 4))
            block = int(_attr(node, "block_size", 0) or 0)
            if bits == 8 and block > 0:
                reasons.append(
                    f"{describe_node(node)} is block-wise 8-bit (block_size {block}): ORT CPU "
                    "quantises its activations to int8 per block (measured 1-2% relative error)"
                )
                continue
        if node.op_type in ("QMoE", "MatMulNBits") and int(_attr(node, "accuracy_level", 0)) == 4:
            reasons.append(
                f"{describe_node(node)} has accuracy_level=4: ORT CPU computes it with int8 "
                "activations (about 1% relative error)"
            )
    return reasons


def ort_unsupported_reason(model: onnx.ModelProto) -> str | None:
    """Why the fused model cannot run in ORT's CPU provider at all (no kernel), else None."""
    missing = sorted(
        {
            ORT_NO_CPU_KERNEL[(n.domain, n.op_type)]
            for n in iter_nodes(model)
            if (n.domain, n.op_type) in ORT_NO_CPU_KERNEL
        }
    )
    return "; ".join(missing) if missing else None


_OPSET_REFUSAL = re.compile(r"Opset (\d+) is under development.*?till opset (\d+)", re.S)
_NO_KERNEL = re.compile(
    r"Could not find an implementation for (\S+)|is not a registered function/op", re.S
)


def _ort_skip_reason(exc: Exception) -> str | None:
    """A session-creation error that means "ORT cannot run this op at all", in words."""
    import onnxruntime as ort

    text = str(exc)
    m = _OPSET_REFUSAL.search(text)
    if m:
        return (
            f"ONNX Runtime {ort.__version__} refuses default-domain opset {m.group(1)} "
            f"(it supports up to opset {m.group(2)})"
        )
    m = _NO_KERNEL.search(text)
    if m:
        first = text.strip().splitlines()[0]
        return f"ONNX Runtime {ort.__version__} has no CPU kernel for a node: {first}"
    return None


def _serialized_or_file(model: onnx.ModelProto, folder: str) -> bytes | str:
    """The model as bytes, or (over protobuf's 2 GB) a path with its weights as external data."""
    if not exceeds_protobuf_limit(model):
        return model.SerializeToString()
    path = os.path.join(folder, "model.onnx")
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    onnx.save_model(copy, path, save_as_external_data=True, location="model.onnx.data")
    return path


def _ort_session(model: onnx.ModelProto) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    with tempfile.TemporaryDirectory(prefix="onnx-moe-fuse-verify-") as folder:
        source = _serialized_or_file(model, folder)
        return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])


# -- comparison ---------------------------------------------------------------------------------


def _errors(actual: np.ndarray, expected: np.ndarray) -> tuple[float, float]:
    """``(max_abs, max_rel)`` with max_rel relative to ``max|expected|``; non-finite aware."""
    if actual.size == 0:
        return 0.0, 0.0
    if actual.dtype == np.bool_ or expected.dtype == np.bool_:
        diff = float(np.count_nonzero(actual != expected))
        return diff, diff
    a = actual.astype(np.float64)
    b = expected.astype(np.float64)
    same = (a == b) | (np.isnan(a) & np.isnan(b))
    diff = np.where(same, 0.0, np.abs(a - b))
    diff = np.where(np.isnan(diff), np.inf, diff)
    max_abs = float(diff.max())
    finite = np.abs(b[np.isfinite(b)])
    scale = float(finite.max()) if finite.size else 0.0
    if max_abs == 0.0:
        return 0.0, 0.0
    return max_abs, (max_abs / scale if scale > 0 else math.inf)


def _tolerance(
    dtype: np.dtype,
    path: str,
    rtol: float | None,
    atol: float | None,
    inexact: Sequence[str],
) -> tuple[float, float, str | None]:
    """``(rtol, atol, note)`` for one output on one path."""
    if dtype not in _FLOAT_DTYPES:
        return 0.0, 0.0, None  # integers and booleans: exact
    d_rtol, d_atol = DEFAULT_TOLERANCES.get(dtype.name, DEFAULT_TOLERANCES["float32"])
    note = None
    if dtype.name in ("float16", "bfloat16"):
        note = (
            f"{dtype.name} output: rtol {d_rtol:g}, atol {d_atol:g} (the reference rounds once "
            "from float64; runtimes round intermediates to the narrow type)"
        )
    if path == "ort" and inexact and d_rtol < ORT_INT8_ACTIVATION_RTOL:
        d_rtol = ORT_INT8_ACTIVATION_RTOL
        note = f"rtol loosened to {d_rtol:g} on the ORT path: " + "; ".join(inexact)
    if rtol is not None or atol is not None:
        r = d_rtol if rtol is None else float(rtol)
        a = d_atol if atol is None else float(atol)
        given = f"rtol {r:g}, atol {a:g} given by the caller"
        return r, a, given if note is None else f"{given} (default here: {note})"
    return d_rtol, d_atol, note


def _compare(
    result: PathResult,
    seed: int,
    reference: Mapping[str, np.ndarray],
    got: Mapping[str, np.ndarray],
    rtol: float | None,
    atol: float | None,
    inexact: Sequence[str],
    messages: list[str],
) -> None:
    for name, expected in reference.items():
        expected = np.asarray(expected)
        out = result.outputs.get(name)
        if out is None:
            r, a, note = _tolerance(expected.dtype, result.path, rtol, atol, inexact)
            out = result.outputs[name] = OutputResult(name, expected.dtype.name, r, a)
            if note and note not in result.tolerance_notes:
                result.tolerance_notes.append(note)
        where = f"{result.path}: output {name!r}, seed {seed}"
        if name not in got or got[name] is None:
            out.problem = "the fused model does not produce this output"
            messages.append(f"FAILED {where}: the fused model does not produce it")
            continue
        actual = np.asarray(got[name])
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            out.problem = (
                f"fused gives {actual.dtype}{list(actual.shape)}, "
                f"reference {expected.dtype}{list(expected.shape)}"
            )
            out.per_seed.append(SeedError(seed, math.inf, math.inf, False))
            messages.append(f"FAILED {where}: {out.problem}")
            continue
        max_abs, max_rel = _errors(actual, expected)
        finite = np.abs(expected[np.isfinite(expected)]) if expected.size else expected
        scale = float(finite.max()) if finite.size else 0.0
        ok = max_abs <= max(out.rtol * scale, out.atol)
        out.per_seed.append(SeedError(seed, max_abs, max_rel, ok))
        if not ok:
            messages.append(
                f"FAILED {where}: max abs error {max_abs:.3e}, max rel error {max_rel:.3e} "
                f"(relative to max|reference| = {scale:.3e}) exceeds rtol {out.rtol:g} / "
                f"atol {out.atol:g}"
            )


# -- verify -------------------------------------------------------------------------------------


def _symbolic_dims(model: onnx.ModelProto, dim_values: Mapping[str, int]) -> dict[str, int]:
    used: dict[str, int] = {}
    initialized = {t.name for t in model.graph.initializer}
    for value in model.graph.input:
        if value.name in initialized or not value.type.HasField("tensor_type"):
            continue
        for d in value.type.tensor_type.shape.dim:
            if d.HasField("dim_param"):
                used[d.dim_param] = int(dim_values.get(d.dim_param, _DEFAULT_DIM))
            elif not d.HasField("dim_value"):
                used["?"] = _DEFAULT_DIM
    return used


def _fused_feeds(
    fused: onnx.ModelProto, feeds: Mapping[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], list[str]]:
    initialized = {t.name for t in fused.graph.initializer}
    wanted = [v.name for v in fused.graph.input if v.name not in initialized]
    return {n: feeds[n] for n in wanted if n in feeds}, [n for n in wanted if n not in feeds]


def _fail(result: PathResult, message: str, messages: list[str]) -> None:
    result.status = "failed"
    result.reason = message
    messages.append(f"FAILED {result.path}: {message}")


def verify(
    original: ModelLike,
    fused: ModelLike,
    *,
    seeds: Sequence[int] = (0, 1, 2),
    dim_values: Mapping[str, int] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    paths: Sequence[str] = PATHS,
) -> VerificationReport:
    """Check that ``fused`` computes what ``original`` computes, on random inputs.

    Args:
        original: the model before fusion (ModelProto, onnx_ir.Model or path); runs on the
            reference path.
        fused: the fused model; runs on each of ``paths``.
        seeds: one fresh set of random inputs per seed.
        dim_values: values for symbolic dims (over :data:`onnx_moe_fuse.verify.reference.
            DEFAULT_DIM_VALUES`; any other symbolic dim gets 3).
        rtol: relative tolerance against ``max|reference|`` per output; None picks it by dtype
            and path (see the module docstring).
        atol: absolute floor; None picks it by dtype.
        paths: evaluation paths of the fused model, from :data:`PATHS`.

    Returns:
        A :class:`VerificationReport`; ``passed`` is False, with messages naming the path,
        output, seed and error, when anything disagrees or cannot run.

    Raises:
        FeedTooLargeError: the original's random inputs would take more than
            :data:`onnx_moe_fuse.verify.reference.MAX_FEED_BYTES` (checked before any work).
    """
    unknown = [p for p in paths if p not in PATHS]
    if unknown or not paths:
        raise ValueError(f"unknown evaluation paths {unknown} (known: {', '.join(PATHS)})")
    if not seeds:
        raise ValueError("verify needs at least one seed")
    original_p = load_model(original)
    fused_p = load_model(fused)
    dims = {**DEFAULT_DIM_VALUES, **(dim_values or {})}
    feed_shapes(original_p, dims)  # FeedTooLargeError now, before kernels or sessions load
    results = {p: PathResult(p) for p in dict.fromkeys(paths)}
    messages: list[str] = []
    report = VerificationReport(
        passed=False,
        seeds=tuple(int(s) for s in seeds),
        dim_values=_symbolic_dims(original_p, dims),
        paths=results,
        messages=messages,
    )

    # What can run at all.
    runners: dict[str, Any] = {}
    if "wgpu" in results:
        missing = missing_kernel_packages(fused_p)
        if missing:
            results["wgpu"].status = "skipped"
            results["wgpu"].reason = "; ".join(missing.values())
        else:
            runners["wgpu"] = _wgpu_runner(fused_p)
    inexact = ort_inexact_reasons(fused_p) if "ort" in results else []
    if "ort" in results:
        _prepare_ort(results["ort"], fused_p, runners, messages)

    original_outputs = [o.name for o in original_p.graph.output]
    fused_outputs = {o.name for o in fused_p.graph.output}
    lost = [n for n in original_outputs if n not in fused_outputs]
    if lost:
        for path in list(runners):
            _fail(results[path], f"the fused model lacks graph outputs {lost}", messages)
            del runners[path]

    for seed in report.seeds:
        if not runners:
            break
        feeds = random_feeds(original_p, seed, dims)
        try:
            reference = run_reference(original_p, feeds)
        except Exception as exc:  # reported below, not hidden
            messages.append(
                f"FAILED reference: the original model does not run on the reference path "
                f"(seed {seed}): {type(exc).__name__}: {exc}"
            )
            for path in runners:
                results[path].status = "failed"
                results[path].reason = "the original model does not run on the reference path"
            runners.clear()
            break
        fused_feeds, absent = _fused_feeds(fused_p, feeds)
        if absent:
            for path in list(runners):
                _fail(
                    results[path],
                    f"the fused model needs inputs {absent} that the original does not have",
                    messages,
                )
                del runners[path]
            break
        for path, run in list(runners.items()):
            try:
                got = run(fused_feeds)
            except Exception as exc:  # a fused model that cannot run fails
                _fail(results[path], f"seed {seed}: {type(exc).__name__}: {exc}", messages)
                del runners[path]
                continue
            _compare(
                results[path],
                seed,
                reference,
                got,
                rtol,
                atol,
                inexact if path == "ort" else [],
                messages,
            )

    for result in results.values():
        if result.status == "passed" and not all(o.passed for o in result.outputs.values()):
            result.status = "failed"
    ran = [r for r in results.values() if r.status != "skipped"]
    if not ran:
        skipped = "; ".join(f"{r.path} skipped: {r.reason}" for r in results.values())
        messages.append(f"FAILED: no evaluation path could run the fused model ({skipped})")
    report.passed = bool(ran) and all(r.status == "passed" for r in ran) and not messages
    return report


def _wgpu_runner(fused: onnx.ModelProto) -> Any:
    """A function running ``fused`` on the wgpu evaluator; the evaluator is built once."""
    built: list[Any] = []

    def run(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if not built:
            built.append(wgpu_evaluator(fused))
        ev = built[0]
        names = list(ev.output_names)
        return dict(zip(names, ev.run(names, dict(feeds)), strict=True))

    return run


def _prepare_ort(
    result: PathResult, fused: onnx.ModelProto, runners: dict[str, Any], messages: list[str]
) -> None:
    """Create the ORT session, or mark the path skipped (no kernel) or failed (load error)."""
    try:
        import onnxruntime  # noqa: F401 - optional: the "test" extra installs it
    except ImportError:
        result.status = "skipped"
        result.reason = (
            "onnxruntime is not installed (pip install 'onnx-moe-fuse[test]' or onnxruntime)"
        )
        return
    reason = ort_unsupported_reason(fused)
    if reason is not None:
        result.status, result.reason = "skipped", reason
        return
    try:
        session = _ort_session(fused)
    except Exception as exc:  # classified below
        skip = _ort_skip_reason(exc)
        if skip is not None:
            result.status, result.reason = "skipped", skip
        else:
            _fail(result, f"ONNX Runtime cannot load the fused model: {exc}", messages)
        return
    names = [o.name for o in session.get_outputs()]

    def run(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(names, dict(feeds)), strict=True))

    runners["ort"] = run
