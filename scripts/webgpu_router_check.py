"""Run the router families' int4 QMoE fused for ort-webgpu in onnxruntime-webgpu's WebGPU EP.

Two steps, because the GPU machine has no sample models (they do not fit its upload limit):

    .venv/bin/python scripts/webgpu_router_check.py prepare .gpu_models      # here
    bash scripts/gpu_run.sh python3 scripts/webgpu_router_check.py run .gpu_models   # GPU

``prepare`` takes one float32 dynamic export per family (``sample_models/exported/causal_lm``),
quantises its stacked experts to symmetric int4 blocks of 16 (the test suite's ``quantized``),
fuses it for ort-webgpu, and writes the fused model, fresh token ids of two counts, and ORT CPU
1.32's logits of the *quantised original* on them. ``run`` loads each fused model in
onnxruntime-webgpu (``ORT_WEBGPU_DIR``, set by gpu_run.sh) with the WebGPU provider first,
checks that the QMoE nodes were placed on it (session profiling names the provider of each
node), and prints the max error relative to the logits' scale per family and token count.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ((1, 1), (2, 7))


def prepare(folder: Path) -> None:
    import onnx

    sys.path.insert(0, str(ROOT / "tests" / "pipeline"))
    from export_edits import quantized

    from onnx_moe_fuse import fuse
    from onnx_moe_fuse.verify.ort_nodes import session

    causal = ROOT / "sample_models" / "exported" / "causal_lm"
    folder.mkdir(parents=True, exist_ok=True)
    chosen: dict[str, dict] = {}
    for entry in json.loads((causal / "index.json").read_text())["models"]:
        record = json.loads((causal / f"{entry['name']}.json").read_text())
        if record["dtype"] == "float32" and "batched_mm_dynamic_op18" in entry["name"]:
            chosen.setdefault(record["family"], record)
    jobs = []
    for family, record in chosen.items():
        q = quantized(onnx.load(causal / record["file"]), block=16, keep_value_info=True)
        fused = fuse(q, target="ort-webgpu")
        if not fused.report.fusions:
            continue
        onnx.save(fused.model, folder / f"{family}.onnx")
        feeds = {}
        for i, shape in enumerate(SHAPES):
            ids = np.random.default_rng(7 + i).integers(
                0, record["config"]["vocab_size"], size=shape, dtype=np.int64
            )
            feeds[f"ids{i}"] = ids
            feeds[f"ref{i}"] = session(q).run(None, {"input_ids": ids})[0]
        np.savez(folder / f"{family}.npz", **feeds)
        jobs.append({"family": family, "qmoe": len(fused.report.fusions)})
        print(family, len(fused.report.fusions), "QMoE", flush=True)
    (folder / "jobs.json").write_text(json.dumps(jobs))


def run(folder: Path) -> int:
    import os

    sys.path.insert(0, os.environ["ORT_WEBGPU_DIR"])
    import onnxruntime as ort

    print("onnxruntime", ort.__version__, ort.get_available_providers(), flush=True)
    worst = 0.0
    for job in json.loads((folder / "jobs.json").read_text()):
        family = job["family"]
        opts = ort.SessionOptions()
        opts.enable_profiling = True
        opts.profile_file_prefix = f"/tmp/prof_{family}"
        sess = ort.InferenceSession(
            str(folder / f"{family}.onnx"),
            opts,
            providers=["WebGpuExecutionProvider", "CPUExecutionProvider"],
        )
        data = np.load(folder / f"{family}.npz")
        errors = []
        for i in range(len(SHAPES)):
            got = sess.run(None, {"input_ids": data[f"ids{i}"]})[0].astype(np.float64)
            ref = data[f"ref{i}"].astype(np.float64)
            errors.append(float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))))
        profile = json.loads(Path(sess.end_profiling()).read_text())
        placed = {
            e["args"].get("provider")
            for e in profile
            if e.get("cat") == "Node" and e.get("args", {}).get("op_name") == "QMoE"
        }
        worst = max(worst, *errors)
        print(f"{family}: QMoE x{job['qmoe']} on {sorted(p for p in placed if p)}; "
              f"max rel error {errors[0]:.2e} (1 token) / {errors[1]:.2e} (2x7)", flush=True)  # fmt: skip
    print(f"worst {worst:.2e}")
    return 0 if worst <= 1e-5 else 1  # the router-agnostic routing's bound (scale-aware)


if __name__ == "__main__":
    verb, where = sys.argv[1], Path(sys.argv[2])
    sys.exit(prepare(where) or 0 if verb == "prepare" else run(where))
