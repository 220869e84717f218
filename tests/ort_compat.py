"""ORT CPU references for the kernel tests on ONNX Runtime releases older than 1.32.

The lent GPU machine's image has onnxruntime 1.30, and its upload limit leaves no room for
the 1.32 wheel beside onnxruntime-webgpu. 1.30 refuses QMoE's ``accuracy_level`` and MoE's
``swiglu_limit_after_activation``, which ``ort_nodes.kernel_node_attributes`` writes
explicitly; at the values written (0) they mean what their absence means, so on an older
ORT they are dropped. On 1.32 and later the node is exactly ``ort_nodes``'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from onnx_moe_fuse.verify.ort_nodes import kernel_node_model, session

#: Attributes ORT before 1.32 does not know, with the written values equal to their absence.
NEW_ATTRIBUTES = {"accuracy_level": (0,), "swiglu_limit_after_activation": (0,)}


def ort_before_1_32() -> bool:
    """Whether the installed onnxruntime predates 1.32."""
    import onnxruntime as ort

    return tuple(int(p) for p in ort.__version__.split(".")[:2]) < (1, 32)


def old_ort_lacks(kernel: str, attrs: Mapping[str, Any]) -> bool:
    """Whether this (older) ORT refuses the mode: block-wise 8-bit QMoE on ORT 1.30.

    Measured on the H200 image: for 8-bit weights, block 16, H 16, I 32, ORT 1.30 says
    "fc2_experts_scales is expected to have shape {2,16,1}, got {2,16,2}" (I / 16 = 2 is
    right; it seems to take I from the packed columns as if 4-bit).
    """
    return (
        kernel == "QMoE"
        and attrs.get("expert_weight_bits", 4) == 8
        and bool(attrs.get("block_size"))
        and ort_before_1_32()
    )


def run_kernel_node(
    kernel: str, call: Mapping[str, Any], attrs: Mapping[str, Any]
) -> np.ndarray | None:
    """ORT CPU's output for a QMoE / MoE kernel call on this onnxruntime (None: it lacks it)."""
    if old_ort_lacks(kernel, attrs):
        return None
    model, feeds = kernel_node_model(kernel, call, attrs)
    if ort_before_1_32():
        node = model.graph.node[0]
        keep = [a for a in node.attribute if a.i not in NEW_ATTRIBUTES.get(a.name, (None,))]
        del node.attribute[:]
        node.attribute.extend(keep)
    return session(model).run(["out"], feeds)[0]
