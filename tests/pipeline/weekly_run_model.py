"""Run one ONNX model through onnx-weekly's ReferenceEvaluator (opset 29: GroupedMatMul).

Runs in the separate onnx-weekly venv (``ONNX_WEEKLY_PYTHON``), not the project's: it imports
nothing of onnx_moe_fuse. Usage: ``weekly_run_model.py MODEL.onnx IN.npz OUT.npz``; IN holds the
graph inputs by name, OUT receives the first graph output as ``output``.
"""

import sys

import numpy as np
import onnx
from onnx.reference import ReferenceEvaluator


def main() -> None:
    model = onnx.load(sys.argv[1])
    onnx.checker.check_model(model, full_check=True)  # this onnx knows opset 29
    data = np.load(sys.argv[2])
    (output, *_) = ReferenceEvaluator(model).run(None, {k: data[k] for k in data.files})
    np.savez(sys.argv[3], output=output)


if __name__ == "__main__":
    main()
