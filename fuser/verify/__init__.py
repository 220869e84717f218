"""Verification: prove a fused model equal to its original, on the WebGPU kernels and in ORT.

* :mod:`.checker`: :func:`verify` runs both models on the same random inputs and compares;
* :mod:`.reference`: the original's path (``onnx.reference`` plus the numpy oracles);
* :mod:`.evaluator`: the fused model on the project's WebGPU kernels (``onnx_moe_fuse.kernels``);
* :mod:`.ort_nodes`: single ONNX Runtime nodes as references;
* :mod:`.selfcheck`: every kernel package's ``test.json`` cases on this machine's adapter;
* :mod:`.oracles`: plain numpy implementations of the ops, written apart from the kernels.

The public names of :mod:`.checker` load on first use (``from onnx_moe_fuse.verify import
verify``), so that importing an oracle does not import the kernels it checks.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

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
_CHECKER_NAMES = frozenset(__all__)

if TYPE_CHECKING:
    from onnx_moe_fuse.verify.checker import (
        DEFAULT_TOLERANCES,
        ORT_INT8_ACTIVATION_RTOL,
        PATHS,
        FeedTooLargeError,
        OutputResult,
        PathResult,
        SeedError,
        VerificationError,
        VerificationReport,
        ort_inexact_reasons,
        ort_unsupported_reason,
        verify,
    )


def __getattr__(name: str) -> Any:
    """Load a public name of :mod:`.checker` on first use."""
    if name not in _CHECKER_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("onnx_moe_fuse.verify.checker"), name)
    globals()[name] = value
    return value
