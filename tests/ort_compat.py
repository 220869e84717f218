"""ORT CPU references for the kernel tests, also on ONNX Runtime releases older than 1.32.

The lent GPU machine's image has onnxruntime 1.30 (``scripts/gpu_run.sh`` installs the 1.32
the project pins over it when the wheel is carried). 1.30 refuses QMoE's ``accuracy_level``
and MoE's ``swiglu_limit_after_activation``, which ``ort_nodes.kernel_node_attributes``
writes explicitly; at the values written (0) they mean what their absence means, so on an
older ORT they are dropped. On 1.32 and later the node is exactly ``ort_nodes``'s.

Where an older ORT lacks a mode outright (block-wise QMoE scales, below) the ORT comparison
is skipped, never silently: :func:`run_kernel_node` returns None and issues an
:class:`OrtReferenceSkipped` warning that names the ORT version and its refusal, so the
pytest summary says which comparisons did not run and why (the oracle still checks those
calls). On ORT 1.32 and later every refusal is an error.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import Any

import numpy as np

from onnx_moe_fuse.verify.ort_nodes import kernel_node_model, session

#: Attributes ORT before 1.32 does not know, with the written values equal to their absence.
NEW_ATTRIBUTES = {"accuracy_level": (0,), "swiglu_limit_after_activation": (0,)}

#: What ORT before 1.32 says when it refuses block-wise QMoE scales (measured with 1.30:
#: "Input 'fc2_experts_scales' is expected to have shape {2,16,1}, got {2,16,4}" for 4-bit,
#: block 16, H 16, I 64; "{2,16,1}, got {2,16,2}" for 8-bit, block 16, H 16, I 32). 1.32
#: accepts both and matches the oracle.
OLD_ORT_REFUSAL = re.compile(r"Input 'fc[123]_experts_scales' is expected to have shape")


class OrtReferenceSkipped(UserWarning):
    """An ORT comparison that did not run: the installed onnxruntime lacks the mode."""


def ort_version() -> tuple[int, int]:
    """The installed onnxruntime's (major, minor)."""
    import onnxruntime as ort

    return tuple(int(p) for p in ort.__version__.split(".")[:2])


def ort_before_1_32() -> bool:
    """Whether the installed onnxruntime predates 1.32."""
    return ort_version() < (1, 32)


def old_ort_lacks(kernel: str, attrs: Mapping[str, Any]) -> bool:
    """Whether this (older) ORT is known to refuse the mode: block-wise 8-bit QMoE on 1.30.

    Other refusals of an older ORT are recognised by their message (:data:`OLD_ORT_REFUSAL`).
    """
    return (
        kernel == "QMoE"
        and attrs.get("expert_weight_bits", 4) == 8
        and bool(attrs.get("block_size"))
        and ort_before_1_32()
    )


def _skip_ort(kernel: str, attrs: Mapping[str, Any], why: str) -> None:
    import onnxruntime as ort

    mode = {k: attrs[k] for k in ("expert_weight_bits", "block_size") if k in attrs}
    warnings.warn(
        OrtReferenceSkipped(
            f"ORT comparison skipped: onnxruntime {ort.__version__} (< 1.32) lacks {kernel} "
            f"{mode}: {why}; the call is checked against the oracle only"
        ),
        stacklevel=3,
    )


def run_kernel_node(
    kernel: str, call: Mapping[str, Any], attrs: Mapping[str, Any]
) -> np.ndarray | None:
    """ORT CPU's output for a QMoE / MoE kernel call on this onnxruntime.

    None (with an :class:`OrtReferenceSkipped` warning) where an onnxruntime older than
    1.32 lacks the mode; on 1.32 and later any refusal is raised.
    """
    if old_ort_lacks(kernel, attrs):
        _skip_ort(kernel, attrs, "block-wise 8-bit scales are refused (shape check on FC2)")
        return None
    model, feeds = kernel_node_model(kernel, call, attrs)
    old = ort_before_1_32()
    if old:
        node = model.graph.node[0]
        keep = [a for a in node.attribute if a.i not in NEW_ATTRIBUTES.get(a.name, (None,))]
        del node.attribute[:]
        node.attribute.extend(keep)
    try:
        return session(model).run(["out"], feeds)[0]
    except Exception as exc:  # onnxruntime's own error classes (InvalidArgument, Fail)
        first = (str(exc).splitlines() or [""])[0]
        if old and OLD_ORT_REFUSAL.search(first):
            _skip_ort(kernel, attrs, first.split("Status Message: ")[-1])
            return None
        raise
