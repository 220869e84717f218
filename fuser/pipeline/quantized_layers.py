"""The MoE pass's handling of opt-in quantisation (``--quantize``) and ``--accuracy-level``.

Kept beside :mod:`.fuse_moe_layers` (the pass) so the pass stays readable:

* :func:`check_accuracy_level`: ``accuracy_level`` must be one of ORT's values (0-4) and the
  target's QMoE must take the attribute (:meth:`~onnx_moe_fuse.contract.targets.Target.
  attribute_names`), else an :class:`~onnx_moe_fuse.errors.OptionError` naming the target;
* :func:`check_block_sizes`: a requested block size that does not fit a layer the rules would
  fuse is the user's mistake, an :class:`~onnx_moe_fuse.errors.OptionError` naming the layer,
  raised after the dry run and before anything is rewritten;
* :func:`set_accuracy_level`: the requested ``accuracy_level`` on a QMoE node (the fronts have
  checked that the target takes the attribute);
* :func:`quantization_record`: the rule's record of a float layer quantised on request (the
  scheme and the measured error), moved from the node's metadata into the report.
"""

from __future__ import annotations

import json
from typing import Any

import onnx_ir as ir

from onnx_moe_fuse.contract.ops import QMOE
from onnx_moe_fuse.contract.targets import Target
from onnx_moe_fuse.errors import OptionError
from onnx_moe_fuse.pipeline.common import label
from onnx_moe_fuse.pipeline.near_misses import NearMissTracer
from onnx_moe_fuse.rewrites.moe.quantize import BLOCK_ADVICE, BlockSizeRefusal
from onnx_moe_fuse.rewrites.moe.rule_base import QUANTIZATION_KEY

__all__ = ["check_block_sizes", "check_accuracy_level", "quantization_record", "set_accuracy_level"]

#: The ``accuracy_level`` values of ORT's QMoE/MatMulNBits: 0 unset, 1 float32, 2 float16,
#: 3 bfloat16, 4 int8 activations. ORT 1.32 CPU's QMoE loads any integer and changes its result
#: only for 4 with block-wise 4-bit weights (measured: 0-3 and 5 the same as 0).
ACCURACY_LEVELS = range(5)


def check_accuracy_level(level: int | None, target: Target) -> None:
    """:class:`OptionError` when ``level`` is not 0-4 or the target's QMoE does not take it."""
    if level is None:
        return
    if isinstance(level, bool) or not isinstance(level, int) or level not in ACCURACY_LEVELS:
        raise OptionError(
            f"--accuracy-level must be 0, 1, 2, 3 or 4 (4: int8 activations), got {level!r}",
            option="--accuracy-level",
        )
    if QMOE.name not in target.ops or "accuracy_level" not in target.attribute_names(QMOE.name):
        raise OptionError(
            f"--accuracy-level: {target.name}'s QMoE does not take accuracy_level "
            f"({target.contracts[QMOE.name].source if QMOE.name in target.ops else 'no QMoE'}: "
            "its schema rejects the attribute); target ort-cpu or drop the option",
            option="--accuracy-level",
        )


def check_block_sizes(tracer: NearMissTracer) -> None:
    """Raise :class:`OptionError` for the first layer the requested block size does not fit."""
    for attempt in tracer.attempts:
        if isinstance(attempt.refusal, BlockSizeRefusal):
            where = label(attempt.topk) if attempt.topk is not None else label(attempt.root)
            raise OptionError(
                f"{attempt.refusal.reason} of the MoE layer routed by {where!r}; {BLOCK_ADVICE}",
                option="--block-size",
            )


def set_accuracy_level(node: ir.Node, level: int | None) -> None:
    """Write ``accuracy_level = level`` on a QMoE ``node`` (nothing for None or another op)."""
    if level is None or node.op_type != QMOE.name:
        return
    node.attributes["accuracy_level"] = ir.AttrInt64("accuracy_level", int(level))


def quantization_record(node: ir.Node) -> dict[str, Any] | None:
    """Pop the rule's quantisation record off ``node`` (None: not quantised on request)."""
    text = node.metadata_props.pop(QUANTIZATION_KEY, None)
    return None if text is None else json.loads(text)
