"""Load (and where it can, run) models in onnxruntime-webgpu; run in ``.venv-webgpu`` only.

onnxruntime-webgpu installs as ``onnxruntime``, like the CPU package of the main venv, so the
test (``test_ort_loads.py``) runs this script in its own venv: ``python webgpu_load.py JOB``.
``JOB`` is a JSON list of ``{"name", "model", "feeds", "outputs"}`` paths (``feeds`` an ``.npz``
of inputs, ``outputs`` where the ``.npz`` of results goes). Each model is checked against the
package's own com.microsoft schemas (every attribute known, every required one present) and
loaded in a session on the CPU provider, which checks the same schema: the WebGPU provider
finds no adapter on Debian's Mesa lavapipe. A model whose only load error is a missing CPU
kernel (MatMulNBitsQkv has a WebGPU kernel only) is ``"schema-only"``; the others run on the
feeds. Prints a JSON object ``{name: {"status": "ran" | "schema-only" | "failed", "error"}}``.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.capi import onnxruntime_pybind11_state as C

#: ORT's words for a node it resolved (schema checked) but has no kernel for on the provider.
NO_KERNEL = ("Could not find an implementation for ", "Failed to find kernel for ")


def _schemas() -> dict[tuple[str, str], object]:
    return {(s.domain, s.name): s for s in C.get_all_operator_schema() if s.domain}


def _schema_errors(model: onnx.ModelProto, schemas: dict) -> list[str]:
    errors = []
    for node in model.graph.node:
        if node.domain != "com.microsoft":
            continue
        schema = schemas.get((node.domain, node.op_type))
        if schema is None:
            errors.append(f"{node.op_type}: no schema")
            continue
        names = {a.name for a in node.attribute}
        unknown = sorted(names - set(schema.attributes))
        required = sorted(n for n, a in schema.attributes.items() if a.required and n not in names)
        if unknown:
            errors.append(f"{node.op_type} '{node.name}': unknown attributes {unknown}")
        if required:
            errors.append(f"{node.op_type} '{node.name}': missing required attributes {required}")
    return errors


def _check(entry: dict, schemas: dict) -> dict:
    model = onnx.load(entry["model"])
    errors = _schema_errors(model, schemas)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4
    try:
        sess = ort.InferenceSession(entry["model"], so, providers=["CPUExecutionProvider"])
    except Exception as exc:  # the test reads the message
        text = str(exc).strip().splitlines()[0]
        if not errors and any(k in text for k in NO_KERNEL) and "MatMulNBitsQkv" in text:
            return {"status": "schema-only", "error": text}
        return {"status": "failed", "error": "; ".join([*errors, f"ORT: {text}"])}
    if errors:
        return {"status": "failed", "error": "; ".join(errors)}
    feeds = dict(np.load(entry["feeds"]))
    names = [o.name for o in sess.get_outputs()]
    np.savez(entry["outputs"], **dict(zip(names, sess.run(names, feeds), strict=True)))
    return {"status": "ran", "error": None}


def main(job_path: str) -> None:
    """Check every model of the job; print the results as JSON."""
    schemas = _schemas()
    with open(job_path) as f:
        job = json.load(f)
    results = {"onnxruntime": ort.__version__}
    for entry in job:
        results[entry["name"]] = _check(entry, schemas)
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
