"""The Python API: :func:`fuse` a model's MoE layers into ``com.microsoft.MoE`` / ``QMoE``.

.. code-block:: python

    from onnx_moe_fuse import fuse
    from onnx_moe_fuse.samples import default_sample

    result = fuse(default_sample().model)          # or an onnx_ir.Model, or a path
    result.model                                   # onnx.ModelProto
    result.report.fusions[0]["op"]                 # "QMoE"
    result.report.to_dict()                        # JSON-ready: fusions, near_misses

``fuse`` runs :func:`onnx_moe_fuse.passes.fusion_pipeline`. It needs onnx, onnx-ir and onnxscript
only (not wgpu, not onnxruntime).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import onnx
import onnx_ir as ir

from .passes import FusionReport, fusion_pipeline

__all__ = ["FuseResult", "FusionReport", "fuse"]

_OPS = ("MoE", "QMoE", "MatMulNBitsQkv")


@dataclass
class FuseResult:
    """The fused model, as a ModelProto and as the onnx-ir model, and the report.

    When nothing fused and a ModelProto was given, ``model`` is an exact copy of it.
    """

    model: onnx.ModelProto
    ir_model: ir.Model
    report: FusionReport

    @property
    def fused(self) -> bool:
        """True when at least one layer was fused."""
        return bool(self.report.fusions)


def _only(only: Iterable[str] | None) -> frozenset[str] | None:
    if only is None:
        return None
    if isinstance(only, str):
        raise TypeError("only must be a set of op names such as {'MoE'}, not a string")
    ops = frozenset(only)
    unknown = ops - set(_OPS)
    if unknown:
        raise ValueError(f"only: unknown ops {sorted(unknown)}; choose among {list(_OPS)}")
    return ops


def fuse(
    model: onnx.ModelProto | ir.Model | str | os.PathLike[str],
    *,
    only: set[str] | frozenset[str] | None = None,
) -> FuseResult:
    """Fuse every layer of ``model`` that provably equals one MoE / QMoE / MatMulNBitsQkv node.

    Args:
        model: a ``ModelProto`` (not modified), an ``onnx_ir.Model`` (fused in place) or the
            path of a ``.onnx`` file (external data is read lazily from beside it).
        only: the ops that may be emitted, e.g. ``{"MoE"}``; default all of
            ``{"MoE", "QMoE", "MatMulNBitsQkv"}``.

    Returns:
        A :class:`FuseResult`. Layers that do not fuse are left exactly as they were; the
        report's ``near_misses`` say why each candidate layer was refused.
    """
    ops = _only(only)
    proto_in: onnx.ModelProto | None = None
    if isinstance(model, ir.Model):
        ir_model = model
    elif isinstance(model, onnx.ModelProto):
        proto_in = model
        ir_model = ir.serde.deserialize_model(model)
    elif isinstance(model, (str, os.PathLike)):
        ir_model = ir.load(os.fspath(model))
    else:
        raise TypeError(f"fuse() takes a ModelProto, an onnx_ir.Model or a path, not {type(model)}")
    report = FusionReport()
    fusion_pipeline(report, ops)(ir_model)
    if not report.fusions and proto_in is not None:
        out = onnx.ModelProto()
        out.CopyFrom(proto_in)
    else:
        out = ir.serde.serialize_model(ir_model)
    return FuseResult(model=out, ir_model=ir_model, report=report)
