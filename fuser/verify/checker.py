"""The equivalence checker: run the original and the fused model on random inputs and compare.

:func:`verify` draws fresh random inputs for every seed (:func:`onnx_moe_fuse.verify.reference.
random_feeds`: standard-normal floats, integers in ``[0, 4)``, symbolic dims given small
values), runs the **original** model on the reference path (:func:`onnx_moe_fuse.verify.reference.
run_reference`: ``onnx.reference`` plus the numpy oracles) and the **fused** model on each
evaluation path, and compares every graph output of the original:

* ``"wgpu"``: :func:`onnx_moe_fuse.verify.evaluator.run_wgpu`, fused nodes on the project's WebGPU
  kernels, the other com.microsoft ops a model may hold (``MatMulNBits``, the simplified layer
  norms) in the reference path's numpy code, standard ops in ``onnx.reference``. Skipped, with
  the reason, while a kernel package the model needs is not installed. A QMoE node with
  asymmetric zero points (which the QMoE kernel does not implement) runs on the reference
  path's oracle there instead; the path's ``notes`` name each such node.
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
bfloat16 ``5e-2, 1e-2``; integer and bool outputs must match exactly. A model whose layers
were quantised on request (``--quantize``) is not exact: ``quantization`` (from
:func:`onnx_moe_fuse.verify.quant_error.verify_tolerance`) raises ``rtol`` to what the layers'
measured errors allow, and the paths' notes say so. On the ORT path, a model
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

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnx_ir

from onnx_moe_fuse.io.model_io import load_model
from onnx_moe_fuse.verify.compare import (
    DEFAULT_TOLERANCES,
    ORT_INT8_ACTIVATION_RTOL,
    compare_outputs,
)
from onnx_moe_fuse.verify.evaluator import (
    missing_kernel_packages,
    reference_only_nodes,
    wgpu_evaluator,
)
from onnx_moe_fuse.verify.ort_path import (
    ORT_NO_CPU_KERNEL,
    ort_inexact_reasons,
    ort_unsupported_reason,
    prepare_ort,
)
from onnx_moe_fuse.verify.quant_error import QuantizedTolerance
from onnx_moe_fuse.verify.reference import (
    DEFAULT_DIM_VALUES,
    FeedTooLargeError,
    feed_shapes,
    random_feeds,
    run_reference,
)
from onnx_moe_fuse.verify.report import (
    OutputResult,
    PathResult,
    SeedError,
    VerificationError,
    VerificationReport,
    fail_path,
)

__all__ = [
    "DEFAULT_TOLERANCES",
    "FeedTooLargeError",
    "ORT_INT8_ACTIVATION_RTOL",
    "ORT_NO_CPU_KERNEL",
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
_DEFAULT_DIM = 3  # random_feeds' value for symbolic dims without a given value


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


def verify(
    original: ModelLike,
    fused: ModelLike,
    *,
    seeds: Sequence[int] = (0, 1, 2),
    dim_values: Mapping[str, int] | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    paths: Sequence[str] = PATHS,
    quantization: QuantizedTolerance | None = None,
    reference_ops: Sequence[Any] = (),
    references: Mapping[int, Mapping[str, np.ndarray]] | None = None,
    fused_data_folder: str | os.PathLike[str] | None = None,
    feeds: Mapping[int, Mapping[str, np.ndarray]] | None = None,
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
        quantization: for a fused model with layers quantised on request (``--quantize``):
            the tolerance their measured errors allow
            (:func:`onnx_moe_fuse.verify.quant_error.verify_tolerance` of the fusion report),
            used instead of the exact default on every path and named in each path's
            ``tolerance_notes``.
        reference_ops: OpRun classes the reference path uses over its own (per-layer
            verification's blocked DequantizeLinear, :mod:`.reference_dq`).
        references: the original's outputs by seed, computed by the caller on the same
            :func:`~onnx_moe_fuse.verify.reference.random_feeds` (per-layer verification runs
            the original region first and lets its weights go before the fused one loads);
            ``original`` then needs no weights (its graph inputs and outputs are read).
        fused_data_folder: ``fused`` is a ModelProto whose weights are still in their
            external data files, in this folder: ORT maps them from there itself, and only
            the wgpu path reads them into memory (per-layer verification: one copy, not
            three, of a layer's weights in the process).
        feeds: the inputs by seed, instead of drawing them (per-layer verification draws them
            so that every expert is selected, :func:`.coverage.covering_feeds`; the same
            arrays went into ``references``). Every seed must have its feeds.

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
    if fused_data_folder is not None and not isinstance(fused, onnx.ModelProto):
        raise TypeError("fused_data_folder needs the fused model as an onnx.ModelProto")
    fused_p = load_model(fused) if fused_data_folder is None else fused
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
            fused_w = (
                fused_p
                if fused_data_folder is None
                else load_model(fused_p, base_dir=Path(fused_data_folder))
            )
            runners["wgpu"] = _wgpu_runner(fused_w)
            results["wgpu"].notes.extend(
                f"{node}: {why}" for node, why in reference_only_nodes(fused_w).items()
            )
    inexact = ort_inexact_reasons(fused_p) if "ort" in results else []
    if "ort" in results:
        prepare_ort(results["ort"], fused_p, runners, messages, fused_data_folder)

    original_outputs = [o.name for o in original_p.graph.output]
    fused_outputs = {o.name for o in fused_p.graph.output}
    lost = [n for n in original_outputs if n not in fused_outputs]
    if lost:
        for path in list(runners):
            fail_path(results[path], f"the fused model lacks graph outputs {lost}", messages)
            del runners[path]

    given = feeds
    for seed in report.seeds:
        if not runners:
            break
        feeds = dict(given[seed]) if given is not None else random_feeds(original_p, seed, dims)
        try:
            if references is not None:
                reference = dict(references[seed])
            else:
                reference = run_reference(original_p, feeds, extra_ops=reference_ops)
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
                fail_path(
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
                fail_path(results[path], f"seed {seed}: {type(exc).__name__}: {exc}", messages)
                del runners[path]
                continue
            compare_outputs(
                results[path],
                seed,
                reference,
                got,
                rtol,
                atol,
                inexact if path == "ort" else [],
                messages,
                quantization,
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
