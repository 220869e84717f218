"""The Python API: :func:`fuse` a model's MoE layers into ``com.microsoft.MoE`` / ``QMoE``.

.. code-block:: python

    from onnx_moe_fuse import fuse
    from onnx_moe_fuse.samples import default_sample

    result = fuse(default_sample().model)          # or an onnx_ir.Model, or a path
    result.model                                   # onnx.ModelProto
    result.report.fusions[0]["op"]                 # "QMoE"
    result.report.to_dict()                        # JSON-ready: fusions, near_misses

``fuse`` validates the model first (:func:`onnx_moe_fuse.io.model_check.validate_model`: opset
imports, the attribute sets of standard ops, the ONNX checker; a path also has its external data
checked as ORT reads it), then runs :func:`onnx_moe_fuse.pipeline.fusion_pipeline` for the
``target`` runtime. Bad input or options raise errors of :mod:`onnx_moe_fuse.errors` (each a
``ValueError`` or ``OSError``), never a bare protobuf or checker error. It needs onnx, onnx-ir
and onnxscript only (not wgpu, not onnxruntime).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import onnx
import onnx_ir as ir

from onnx_moe_fuse.contract.targets import (
    DEFAULT_TARGET,
    INEXACT_QMOE_BLOCK_BITS,
    TARGETS,
    Target,
    target_named,
)
from onnx_moe_fuse.errors import OptionError, user_error_in
from onnx_moe_fuse.io.model_check import validate_model
from onnx_moe_fuse.io.model_io import load_model
from onnx_moe_fuse.pipeline import ALL_FUSED_OPS, FusionReport, fusion_pipeline
from onnx_moe_fuse.progress import Progress, fused_text
from onnx_moe_fuse.rewrites.graph.weight_sink import in_memory
from onnx_moe_fuse.rewrites.moe.quantize import BITS, Quantization

__all__ = ["FuseResult", "FusionReport", "check_quantization", "check_target", "fuse"]

#: ``block_size`` when none is given: blocks of 32 for int4 (exact on every target), per
#: channel for int8 (ORT CPU's block-wise 8-bit QMoE quantises the activations; per channel is
#: exact given the weights).
DEFAULT_BLOCK = {"int4": 32, "int8": 0}


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
    unknown = ops - ALL_FUSED_OPS
    if unknown:
        raise OptionError(
            f"only: unknown ops {sorted(unknown)}; choose among {sorted(ALL_FUSED_OPS)}",
            option="only",
        )
    return ops


def check_target(target: Target | str) -> Target:
    """The :class:`~onnx_moe_fuse.contract.targets.Target` a user's ``target`` names.

    A name of ``TARGETS`` is parsed (once: the pipeline takes the object); a ``Target`` is
    returned as it is; anything else is an :class:`OptionError` naming the choices.
    """
    if isinstance(target, Target):
        return target
    try:
        return target_named(target)
    except ValueError:
        # the contract cannot raise the API's error type (it imports nothing of the project)
        raise OptionError(
            f"target: unknown target {target!r}; choose one of {', '.join(TARGETS)}",
            option="target",
        ) from None


def check_quantization(
    quantize: str | None,
    block_size: int | None,
    target: Target,
    only: frozenset[str] | None = None,
    option: str = "quantize",
) -> Quantization | None:
    """The :class:`~onnx_moe_fuse.rewrites.moe.quantize.Quantization` a user's options ask for.

    ``quantize`` is ``"int4"``, ``"int8"`` or None (no quantisation: ``block_size`` must be
    None too); ``block_size`` 0 (per channel) or a power of two >= 16, default
    :data:`DEFAULT_BLOCK`. Every refusal is an :class:`OptionError` naming the option
    (``option`` and ``block_size`` spelled as the caller's front spells them). The rules
    measure each layer with :func:`onnx_moe_fuse.verify.quant_error.measure_quantization_error`.
    """
    cli = option.startswith("--")
    block_option = "--block-size" if cli else "block_size"
    if quantize is None:
        if block_size is not None:
            raise OptionError(
                f"{block_option} has no effect without {option}; drop it", option=block_option
            )
        return None
    if quantize not in BITS:
        raise OptionError(
            f"{option}: {quantize!r} is not a quantisation this tool writes; choose "
            f"{' or '.join(BITS)}",
            option=option,
        )
    block = DEFAULT_BLOCK[quantize] if block_size is None else block_size
    if (
        isinstance(block, bool)
        or not isinstance(block, int)
        or (block and (block < 16 or block & (block - 1)))
    ):
        raise OptionError(
            f"{block_option} must be 0 (per-channel scales) or a power of two >= 16 (QMoE's "
            f"rule), got {block!r}",
            option=block_option,
        )
    bits = BITS[quantize]
    if block and bits in INEXACT_QMOE_BLOCK_BITS.get(target.name, ()):
        raise OptionError(
            f"{option} {quantize} with {block_option} {block}: {target.name}'s block-wise "
            f"{bits}-bit QMoE quantises the activations to int8 as well (measured 0.7-2 % off); "
            f"give {block_option} 0 (per channel, the default for {quantize}: exact given the "
            "weights) or quantise to int4",
            option=block_option,
        )
    if only is not None and "QMoE" not in only:
        raise OptionError(
            f"{option} writes QMoE nodes, which the requested ops ({', '.join(sorted(only))}) "
            "exclude; add QMoE or drop the option",
            option=option,
        )
    from onnx_moe_fuse.verify.quant_error import measure_quantization_error

    return Quantization(
        bits, block, error_meter=measure_quantization_error, default_block=block_size is None
    )


def fuse(
    model: onnx.ModelProto | ir.Model | str | os.PathLike[str],
    *,
    only: set[str] | frozenset[str] | None = None,
    target: Target | str = DEFAULT_TARGET,
    progress: Progress | None = None,
    quantize: str | None = None,
    block_size: int | None = None,
    accuracy_level: int | None = None,
) -> FuseResult:
    """Fuse every layer of ``model`` that provably equals one MoE / QMoE / MatMulNBitsQkv node.

    Args:
        model: a ``ModelProto`` (not modified), an ``onnx_ir.Model`` (fused in place) or the
            path of a ``.onnx`` file (validated and read with its external data, as
            :func:`onnx_moe_fuse.io.model_io.load_model` reads it).
        only: the ops that may be emitted, e.g. ``{"MoE"}``; default all of
            ``{"MoE", "QMoE", "MatMulNBitsQkv"}``.
        target: the runtime the fused nodes are written for, one of
            ``onnx_moe_fuse.contract.targets.TARGETS`` (``"ort-cpu"``, the default,
            ``"ort-cuda"``, ``"ort-webgpu"``): only ops it has kernels for are emitted, each with
            the attribute set it accepts.
        progress: times and shows the ``fuse`` stage, its layers and repacked bytes
            (:class:`onnx_moe_fuse.progress.Progress`; default silent). The report's ``run``
            section has the stage times, the versions and the peak memory either way.
        quantize: ``"int4"`` or ``"int8"`` (opt-in): float MoE layers the fuser proves are
            written as QMoE of their weights quantised (symmetric, round to nearest, scale
            ``max|w| / qmax`` per block along K); each fusion's ``quantization`` entry holds the
            error measured against the float layer. Not exact: verify with
            :func:`onnx_moe_fuse.verify.verify` and ``quantization=`` (see docs/api.md).
        block_size: the block along K (default 32 for int4, 0 = per channel for int8); a
            power of two >= 16 that divides every quantised layer's H and I, or 0.
        accuracy_level: QMoE's ``accuracy_level`` (0-4; 4 = int8 activations on ORT CPU, not
            exact) on every QMoE node; only for targets whose QMoE takes it (``ort-cpu``).

    Returns:
        A :class:`FuseResult`. Layers that do not fuse are left exactly as they were; the
        report's ``near_misses`` say why each candidate layer was refused.

    Raises:
        OptionError: an unknown op in ``only`` or an unknown ``target``; a bad ``quantize``,
            ``block_size`` (also one that does not divide a layer's H or I) or
            ``accuracy_level``.
        ModelLoadError: the model cannot be read or is not valid ONNX (its subclasses
            ``ModelNotFoundError``, ``ModelValidationError``, ``ExternalDataError``).
    """
    ops = _only(only)
    parsed = check_target(target)
    quantization = check_quantization(quantize, block_size, parsed, ops)
    proto_in: onnx.ModelProto | None = None
    if isinstance(model, ir.Model):
        ir_model = model
    elif isinstance(model, onnx.ModelProto):
        validate_model(model)
        proto_in = model
        ir_model = ir.serde.deserialize_model(model)
    elif isinstance(model, (str, os.PathLike)):
        # Our loader, not onnx_ir.load: onnx-ir refuses the links of the Hugging Face cache.
        proto_in = load_model(model)
        ir_model = ir.serde.deserialize_model(proto_in)
    else:
        raise TypeError(f"fuse() takes a ModelProto, an onnx_ir.Model or a path, not {type(model)}")
    report = FusionReport()
    progress = progress if progress is not None else Progress()
    with progress.stage("fuse"):
        try:
            fusion_pipeline(
                report,
                ops,
                target=parsed,
                weight_sink=progress.watch_sink(None, in_memory),
                observer=progress,
                quantize=quantization,
                accuracy_level=accuracy_level,
            )(ir_model)
        except Exception as exc:  # onnx-ir's PassError wraps our OptionError (a block size)
            found = user_error_in(exc)
            if found is None:
                raise
            raise found from None
        progress.detail = fused_text(report)
    report.run = progress.run_section()
    if not report.fusions and proto_in is not None:
        out = onnx.ModelProto()
        out.CopyFrom(proto_in)
    else:
        out = ir.serde.serialize_model(ir_model)
    return FuseResult(model=out, ir_model=ir_model, report=report)
