"""Run GroupedMatMul through onnx-weekly's ReferenceEvaluator (opset 29).

Runs in the separate onnx-weekly venv (``ONNX_WEEKLY_PYTHON``), not the project's: it
imports nothing of onnx_moe_fuse. Usage: ``weekly_grouped_matmul.py IN.npz OUT.npz`` where
IN holds ``case<i>.input``, ``case<i>.weights``, ``case<i>.group_indices`` and optionally
``case<i>.bias``; OUT receives ``case<i>.output``.
"""

import sys

import numpy as np
import onnx
import onnx.parser
from onnx.reference import ReferenceEvaluator

TYPES = {
    np.dtype(np.float32): "float",
    np.dtype(np.float16): "float16",
    np.dtype(np.float64): "double",
    np.dtype(np.int32): "int32",
    np.dtype(np.int64): "int64",
}


def model_text(t: str, ti: str, with_bias: bool) -> str:
    bias_input = f", {t}[G, N] bias" if with_bias else ""
    bias_arg = ", bias" if with_bias else ""
    return f"""
    <ir_version: 11, opset_import: ["" : 29]>
    grouped ({t}[M, K] input, {t}[G, K, N] weights, {ti}[M, S] group_indices{bias_input})
        => ({t}[M, S, N] output) {{
        output = GroupedMatMul(input, weights, group_indices{bias_arg})
    }}
    """


def main() -> None:
    data = np.load(sys.argv[1])
    results = {}
    cases = sorted({key.split(".")[0] for key in data.files})
    for case in cases:
        x, w, idx = (data[f"{case}.{n}"] for n in ("input", "weights", "group_indices"))
        feeds = {"input": x, "weights": w, "group_indices": idx}
        with_bias = f"{case}.bias" in data.files
        if with_bias:
            feeds["bias"] = data[f"{case}.bias"]
        model = onnx.parser.parse_model(model_text(TYPES[x.dtype], TYPES[idx.dtype], with_bias))
        (results[f"{case}.output"],) = ReferenceEvaluator(model).run(None, feeds)
    np.savez(sys.argv[2], **results)
    print(f"onnx {onnx.__version__}: {len(cases)} cases")


if __name__ == "__main__":
    main()
