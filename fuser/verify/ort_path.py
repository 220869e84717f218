"""The checker's ORT path: whether ONNX Runtime's CPU provider runs the fused model, and exactly.

:func:`ort_unsupported_reason` says, before any session, why the model cannot run there at all
(an op without a CPU kernel: :data:`ORT_NO_CPU_KERNEL`); :func:`ort_inexact_reasons` why a node
runs with int8 activations there (the checker loosens the tolerance); :func:`prepare_ort` makes
the session (graph optimisations off) or marks the path skipped or failed. Attributes are read
over ORT's defaults (:mod:`onnx_moe_fuse.contract.ops`).
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np
import onnx

from onnx_moe_fuse.contract.ops import CONTRIB_OPS, MATMUL_NBITS, MS_DOMAIN, QMOE
from onnx_moe_fuse.contract.targets import SEMANTIC_ATTRIBUTES, target_named
from onnx_moe_fuse.io.model_io import exceeds_protobuf_limit
from onnx_moe_fuse.verify.nodes import describe_node, iter_nodes
from onnx_moe_fuse.verify.report import PathResult, fail_path

__all__ = ["ORT_NO_CPU_KERNEL", "ort_inexact_reasons", "ort_unsupported_reason", "prepare_ort"]

#: Ops for which ONNX Runtime's CPU provider has no kernel (measured with ORT 1.32): the fused
#: ops the ort-cpu target lacks (:mod:`onnx_moe_fuse.contract.targets`), and GroupedMatMul.
ORT_NO_CPU_KERNEL: dict[tuple[str, str], str] = {
    **{
        (MS_DOMAIN, op): f"ORT has no CPU kernel for {MS_DOMAIN}.{op}"
        for op in sorted(set(SEMANTIC_ATTRIBUTES) - target_named("ort-cpu").ops)
    },
    ("", "GroupedMatMul"): (
        "ORT has no CPU kernel for GroupedMatMul (ONNX opset 29; ORT 1.32 refuses opset 29)"
    ),
}


def _attributes(node: onnx.NodeProto) -> dict[str, Any]:
    """A contrib node's attributes over ORT's defaults."""
    given = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    return CONTRIB_OPS[node.op_type].with_defaults(given)


def ort_inexact_reasons(model: onnx.ModelProto) -> list[str]:
    """Why ORT CPU computes some node of ``model`` inexactly (int8 activations), if it does."""
    reasons: list[str] = []
    for node in iter_nodes(model):
        if node.domain != MS_DOMAIN or node.op_type not in (QMOE.name, MATMUL_NBITS.name):
            continue
        attrs = _attributes(node)
        if node.op_type == QMOE.name:
            bits = int(attrs["expert_weight_bits"])
            block = int(attrs.get("block_size") or 0)
            if bits == 8 and block > 0:
                reasons.append(
                    f"{describe_node(node)} is block-wise 8-bit (block_size {block}): ORT CPU "
                    "quantises its activations to int8 per block (measured 1-2% relative error)"
                )
                continue
        if int(attrs["accuracy_level"]) == 4:
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


def _ort_session(model: onnx.ModelProto, data_folder: str | os.PathLike[str] | None) -> Any:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    if data_folder is not None:
        # the proto holds no weights: ORT maps them from their file itself (per-layer
        # verification of a 361 MiB layer: no 3 copies in this process, 12 s -> 2.4 s)
        opts.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", os.fspath(data_folder)
        )
        source = model.SerializeToString()
        return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
    with tempfile.TemporaryDirectory(prefix="onnx-moe-fuse-verify-") as folder:
        source = _serialized_or_file(model, folder)
        return ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])


def prepare_ort(
    result: PathResult,
    fused: onnx.ModelProto,
    runners: dict[str, Any],
    messages: list[str],
    data_folder: str | os.PathLike[str] | None = None,
) -> None:
    """Create the ORT session, or mark the path skipped (no kernel) or failed (load error).

    ``data_folder``: ``fused``'s external data is still in its files, in that folder (ORT
    reads it from there); None: ``fused`` holds its weights.
    """
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
        session = _ort_session(fused, data_folder)
    except Exception as exc:  # classified below
        skip = _ort_skip_reason(exc)
        if skip is not None:
            result.status, result.reason = "skipped", skip
        else:
            fail_path(result, f"ONNX Runtime cannot load the fused model: {exc}", messages)
        return
    names = [o.name for o in session.get_outputs()]

    def run(feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(names, session.run(names, dict(feeds)), strict=True))

    runners["ort"] = run
