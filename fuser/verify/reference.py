"""Reference path of the equivalence checker: ``onnx.reference`` plus the project's numpy oracles.

:func:`run_reference` evaluates a model with ``onnx.reference.ReferenceEvaluator`` and supplies
``OpRun`` classes for the ops the installed ``onnx`` cannot run:

* ``GroupedMatMul`` (default domain, opset 29) -> :func:`onnx_moe_fuse.verify.oracles.
  grouped_matmul.grouped_matmul`;
* ``GatherElements`` with its negative ``axis`` read from the end (onnx 1.23's own misreads
  ``axis=-1``, which routers exported by torch.onnx use);
* ``com.microsoft.MoE`` -> :func:`onnx_moe_fuse.verify.oracles.moe.moe`
  (:mod:`.reference_moe`);
* ``com.microsoft.QMoE`` -> :func:`onnx_moe_fuse.verify.oracles.moe.qmoe` (:mod:`.reference_moe`;
  symmetric weights: zero-point inputs are accepted only when they hold the symmetric point;
  ``router_weights`` (input 14) is passed to the oracle; FC3, sparse mixer and the FP4/FP8
  extras are refused with ``NotImplementedError``);
* ``com.microsoft.MatMulNBits`` -> a numpy dequantisation (:mod:`.reference_nbits`: 2/4/8 bits,
  packed or float zero points, ``g_idx``, bias; ``accuracy_level`` ignored: the reference is
  exact);
* ``SimplifiedLayerNormalization`` (default domain, where ONNX Runtime registers it) and
  ``com.microsoft.SkipSimplifiedLayerNormalization`` -> RMS norm in float64 (stash type float);
* ``com.microsoft.MatMulNBitsQkv`` -> :func:`onnx_moe_fuse.verify.oracles.matmul_nbits_qkv.
  matmul_nbits_qkv` (no biases: a bias input is refused with ``NotImplementedError``).

Opset 29 under onnx 1.23 (measured with onnx 1.23.2, whose newest opset is 28): the
ReferenceEvaluator does not refuse a model that declares ``"" : 29``. It never checks the declared
opset against its schemas; for each standard op it takes the newest implementation whose version
is at most the declared opset, and a ``new_ops`` class, keyed by (domain, op type), is used before
any built-in one. So an opset-29 model runs as it is, with ``GroupedMatMul`` from the OpRun below
(by the evaluator's code, the same class also takes precedence over onnx-weekly's own
implementation; that was read, not run). No copy with a lowered opset is needed. The caveat: an op that opset 29
changed would run with its opset-28 meaning under onnx 1.23 (every other op of the samples is at
its newest onnx 1.23 version: DequantizeLinear 28, TopK 24, Reshape/Squeeze/Unsqueeze 25, ...).
``onnx.checker``, by contrast, does refuse opset 29 under onnx 1.23 ("No Op registered for
GroupedMatMul with domain_version of 29").

The com.microsoft ops read their inputs by name at the positions of
:mod:`onnx_moe_fuse.contract.ops` and their attributes over ORT's defaults from there.

:func:`random_feeds` makes fresh random inputs for every graph input (:mod:`.feeds`, re-exported
here with :func:`feed_shapes`, :data:`MAX_FEED_BYTES`, :class:`FeedTooLargeError` and
:data:`DEFAULT_DIM_VALUES`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator
from onnx.reference.op_run import OpRun

from onnx_moe_fuse.verify.feeds import (
    DEFAULT_DIM_VALUES,
    MAX_FEED_BYTES,
    FeedTooLargeError,
    feed_shapes,
    random_feeds,
)
from onnx_moe_fuse.verify.oracles.grouped_matmul import grouped_matmul
from onnx_moe_fuse.verify.reference_moe import MoE, QMoE
from onnx_moe_fuse.verify.reference_nbits import (
    MatMulNBits,
    MatMulNBitsQkv,
    SimplifiedLayerNormalization,
    SkipSimplifiedLayerNormalization,
)

__all__ = [
    "CUSTOM_OPS",
    "DEFAULT_DIM_VALUES",
    "MAX_FEED_BYTES",
    "FeedTooLargeError",
    "GroupedMatMul",
    "MatMulNBits",
    "MatMulNBitsQkv",
    "MoE",
    "QMoE",
    "SimplifiedLayerNormalization",
    "SkipSimplifiedLayerNormalization",
    "feed_shapes",
    "reference_evaluator",
    "run_reference",
    "random_feeds",
]


class GroupedMatMul(OpRun):
    """ONNX ``GroupedMatMul`` (opset 29): ``out[m, i] = input[m] @ weights[idx[m, i]] (+ bias)``."""

    op_domain = ""

    def _run(  # type: ignore[override]
        self,
        input: np.ndarray,  # noqa: A002 - named after the ONNX input
        weights: np.ndarray,
        group_indices: np.ndarray,
        bias: np.ndarray | None = None,
    ) -> tuple[np.ndarray]:
        return (grouped_matmul(input, weights, group_indices, bias),)


class GatherElements(OpRun):
    """ONNX ``GatherElements`` with a negative ``axis`` read as the spec says (from the end).

    onnx 1.23's reference compares the other dims with ``shape[:axis] + shape[axis + 1:]``,
    which for ``axis=-1`` is every dim but none: torch.onnx exports of ``scores.gather(-1,
    idx)`` (ERNIE-4.5, DeepSeek-V3 routers) then fail there. ``out[..., j] = data[..., idx]``
    along ``axis``, negative indices counted from the end, as ONNX Runtime computes it.
    """

    op_domain = ""

    def _run(self, data: np.ndarray, indices: np.ndarray, axis: int = 0) -> tuple[np.ndarray]:  # type: ignore[override]
        axis = int(axis) % data.ndim
        idx = indices.astype(np.int64)
        idx = np.where(idx < 0, idx + data.shape[axis], idx)
        # the other axes of the indices may be shorter than the data's (spec: output = indices)
        lead = tuple(slice(0, n) if a != axis else slice(None) for a, n in enumerate(idx.shape))
        return (np.take_along_axis(data[lead], idx, axis=axis),)


CUSTOM_OPS: tuple[type[OpRun], ...] = (
    GroupedMatMul,
    GatherElements,
    MoE,
    QMoE,
    MatMulNBits,
    SimplifiedLayerNormalization,
    SkipSimplifiedLayerNormalization,
    MatMulNBitsQkv,
)


def reference_evaluator(
    model: onnx.ModelProto | str | os.PathLike[str],
    *,
    check_shapes: bool = False,
    extra_ops: Sequence[type[OpRun]] = (),
) -> ReferenceEvaluator:
    """Return a ReferenceEvaluator for ``model`` with the project's OpRun classes installed.

    ``check_shapes`` turns on the evaluator's check of every computed value against its declared
    type and shape (symbolic dims bound consistently).
    """
    if not isinstance(model, onnx.ModelProto):
        model = os.fspath(model)
    ops = [*CUSTOM_OPS, *extra_ops]  # extra_ops: e.g. reference_dq's, for per-layer runs
    return ReferenceEvaluator(model, new_ops=ops, check_shape_annotations=check_shapes)


def run_reference(
    model: onnx.ModelProto | str | os.PathLike[str],
    feeds: Mapping[str, np.ndarray],
    *,
    outputs: Sequence[str] | None = None,
    check_shapes: bool = False,
    extra_ops: Sequence[type[OpRun]] = (),
) -> dict[str, np.ndarray]:
    """Run ``model`` on ``feeds`` on the reference path; returns ``{output name: array}``.

    Standard ops run in ``onnx.reference``; ``GroupedMatMul``, ``com.microsoft.MoE``,
    ``com.microsoft.QMoE``, ``com.microsoft.MatMulNBits``, ``SimplifiedLayerNormalization``,
    ``com.microsoft.SkipSimplifiedLayerNormalization`` and ``com.microsoft.MatMulNBitsQkv`` run
    in the project's numpy code (see the module docstring). A model declaring opset 29 is run
    as it is (see the module docstring). ``outputs`` selects graph outputs (default: all).
    """
    ev = reference_evaluator(model, check_shapes=check_shapes, extra_ops=extra_ops)
    names = list(outputs) if outputs is not None else list(ev.output_names)
    results = ev.run(names, dict(feeds))
    return dict(zip(names, results, strict=True))
