"""Times ONNX models on onnxruntime-webgpu in a process of its own (a helper of bench_moe_kernels).

onnxruntime-webgpu has the import name ``onnxruntime``, as the CPU package the project
uses, so it lives in its own directory (``pip install --target DIR``) and runs here, in a
subprocess whose ``sys.path`` starts with that directory. The benchmark writes each case
as a model file (weights as initializers, external data; one per layer, its token count
symbolic, so the session is made once and kept) and an ``.npz`` of feeds, and sends one
JSON request a line on stdin::

    {"model": PATH, "feeds": PATH, "output": PATH, "runs": N, "warmup_seconds": S}

The answer is one line on stdout, ``@@answer`` and a JSON object: ``{"times": [seconds],
"version": ...}`` (wall clock around ``session.run``, which includes its synchronisation and
the readback of the output) or ``{"error": "..."}``; onnxruntime's own log lines may come
between. The output of the first run is saved to ``output`` so that the benchmark can
compare it with its references. Sessions refuse CPU fallback
(``session.disable_cpu_ep_fallback``): a node the WebGPU provider does not take is an
error, not a silent CPU run. The process ends at end of input.
"""

from __future__ import annotations

import json
import sys
import time

ANSWER = "@@answer "


def _session(ort, path: str):
    options = ort.SessionOptions()
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    options.log_severity_level = 3
    return ort.InferenceSession(path, options, providers=["WebGpuExecutionProvider"])


_sessions: dict[str, object] = {}


def _serve(ort, np, request: dict) -> dict:
    if request["model"] not in _sessions:
        _sessions.clear()  # one layer at a time: free the previous one's weights
        _sessions[request["model"]] = _session(ort, request["model"])
    sess = _sessions[request["model"]]
    with np.load(request["feeds"]) as data:
        feeds = {name: data[name] for name in data.files}
    out = sess.run(None, feeds)[0]
    np.save(request["output"], out)
    started = time.perf_counter()
    while time.perf_counter() - started < float(request.get("warmup_seconds", 0.5)):
        sess.run(None, feeds)
    times = []
    for _ in range(int(request.get("runs", 10))):
        start = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - start)
    return {"times": times, "version": ort.__version__}


def main() -> None:
    """Answer requests from stdin until it closes."""
    try:
        import numpy as np
        import onnxruntime as ort
    except ImportError as exc:
        print(
            ANSWER + json.dumps({"error": f"cannot import onnxruntime-webgpu: {exc}"}), flush=True
        )
        return
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            answer = _serve(ort, np, json.loads(line))
        except Exception as exc:  # noqa: BLE001 - every failure is reported to the caller
            first = (str(exc).splitlines() or [""])[0]
            answer = {"error": f"{type(exc).__name__}: {first[:300]}"}
        print(ANSWER + json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
