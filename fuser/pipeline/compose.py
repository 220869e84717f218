"""The fusion pipeline composed: :func:`fusion_pipeline`, one ``PassManager`` of the passes.

Re-exported by :mod:`onnx_moe_fuse.pipeline` (whose docstring lists the passes).
"""

from __future__ import annotations

from collections.abc import Iterable

import onnx_ir as ir

from onnx_moe_fuse.contract.targets import DEFAULT, Target, as_target
from onnx_moe_fuse.pipeline.common import ALL_FUSED_OPS, INTERNAL_DOMAIN
from onnx_moe_fuse.pipeline.fuse_moe_layers import FuseMoELayersPass, LayerObserver
from onnx_moe_fuse.pipeline.fuse_qkv import FuseQkvPass
from onnx_moe_fuse.pipeline.fused_nodes_check import REQUIRED_ATTRIBUTES, FusedNodesCheckPass
from onnx_moe_fuse.pipeline.lower_opset import OPSET_CHANGES, LowerOpsetPass
from onnx_moe_fuse.pipeline.near_misses import NearMissTracer
from onnx_moe_fuse.pipeline.quantized_layers import check_accuracy_level
from onnx_moe_fuse.pipeline.remove_dead_code import RemoveDeadCodePass
from onnx_moe_fuse.pipeline.report import FusionReport
from onnx_moe_fuse.rewrites.graph.weight_sink import WeightSink
from onnx_moe_fuse.rewrites.moe.quantize import SCHEME, Quantization

__all__ = [
    "INTERNAL_DOMAIN",
    "OPSET_CHANGES",
    "REQUIRED_ATTRIBUTES",
    "FusionReport",
    "NearMissTracer",
    "FuseMoELayersPass",
    "LayerObserver",
    "FuseQkvPass",
    "ALL_FUSED_OPS",
    "RemoveDeadCodePass",
    "LowerOpsetPass",
    "FusedNodesCheckPass",
    "fusion_pipeline",
]


def fusion_pipeline(
    report: FusionReport | None = None,
    only: Iterable[str] | None = None,
    target: Target | str = DEFAULT,
    weight_sink: WeightSink | None = None,
    observer: LayerObserver | None = None,
    quantize: Quantization | None = None,
    accuracy_level: int | None = None,
) -> ir.passes.PassManager:
    """The whole pipeline as one ``PassManager`` (one step); ``report`` collects the results.

    ``weight_sink`` receives every repacked weight (:mod:`onnx_moe_fuse.io.weight_sink`; default in
    memory): the command line's streaming path spills them to a scratch file. ``observer`` (a
    :class:`~onnx_moe_fuse.pipeline.fuse_moe_layers.LayerObserver`) is told of each candidate MoE
    layer as the MoE pass finishes it (the command line's progress); it changes nothing.

    ``only`` names the ops that may be emitted (default: all of :data:`ALL_FUSED_OPS`);
    ``target`` the runtime the fused nodes are written for, a
    :class:`~onnx_moe_fuse.contract.targets.Target` or its name (one of
    :data:`onnx_moe_fuse.contract.targets.TARGETS`, default ``"ort-cpu"``): only ops it has
    kernels for are emitted, each with the attribute set it takes. A name is parsed here, once;
    the passes take the object. ``ValueError`` for an unknown op or target.

    ``quantize`` (opt-in): float MoE layers become QMoE of weights quantised as it says
    (:mod:`onnx_moe_fuse.rewrites.moe.quantize`), each measured by its ``error_meter``; the
    report's ``quantization`` says what was asked. ``accuracy_level`` (opt-in) is written on every
    QMoE node; ``OptionError`` where the target's QMoE does not take it.
    """
    target = as_target(target)
    report = report if report is not None else FusionReport()
    report.target = target.name
    check_accuracy_level(accuracy_level, target)
    if quantize is not None or accuracy_level is not None:
        report.quantization = {
            "quantize": None if quantize is None else quantize.name,
            "block_size": None if quantize is None else quantize.block,
            "scheme": None if quantize is None else SCHEME,
            "accuracy_level": accuracy_level,
            "note": _quantization_note(quantize, accuracy_level),
        }
    return ir.passes.PassManager(
        [
            FuseMoELayersPass(
                report, only, target, weight_sink, observer, quantize, accuracy_level
            ),
            FuseQkvPass(report, only, target, weight_sink),
            RemoveDeadCodePass(report),
            LowerOpsetPass(report, target),
            FusedNodesCheckPass(target),
        ],
        steps=1,
    )


def _quantization_note(quantize: Quantization | None, accuracy_level: int | None) -> str:
    """What the report says of the requested quantisation: it is not exact, and why."""
    parts = []
    if quantize is not None:
        parts.append(
            f"--quantize {quantize.describe()}: float layers are written as QMoE of quantised "
            "weights, not exact; each fusion's quantization entry has the error measured "
            "against the float layer (it does not include int8 activations)"
        )
    if accuracy_level == 4:
        parts.append(
            "accuracy_level 4: ORT CPU computes block-wise 4-bit QMoE with int8 activations, "
            "not exact (measured about 0.9 % off the exact node)"
        )
    elif accuracy_level is not None:
        parts.append(f"accuracy_level {accuracy_level}: ORT 1.32 CPU computes it as 0 (measured)")
    return "; ".join(parts)
