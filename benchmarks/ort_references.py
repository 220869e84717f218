"""ONNX Runtime references of bench_moe_kernels: ORT CPU in process, onnxruntime-webgpu apart.

One QMoE / MoE node per layer (weights as initializers where the model stays under
protobuf's 2 GB), its token count symbolic so that one session serves every case of a
layer. onnxruntime-webgpu has the import name ``onnxruntime`` too, so it runs in a
subprocess (``ort_webgpu_worker.py``) whose ``sys.path`` starts with its ``pip --target``
directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from onnx_moe_fuse.verify.ort_nodes import kernel_node_inputs, kernel_node_model

OPS = {"qmoe": "com.microsoft.QMoE", "moe": "com.microsoft.MoE"}
WEIGHTS = {
    "qmoe": ("fc1T", "fc1ScalesT", "fc2T", "fc2ScalesT"),
    "moe": ("fc1T", "fc2T", "fc3T"),
}
#: Attributes that ORT before 1.32 does not know, and the values at which dropping them
#: keeps the node's meaning (their defaults; QMoE's raw weight layout is the only one then).
NEW_ATTRIBUTES = {
    "accuracy_level": (0,),
    "swiglu_limit_after_activation": (0,),
    "weights_prepacked": (-1, 0),
}
WORKER = Path(__file__).resolve().parent / "ort_webgpu_worker.py"


def ort_model(op: str, call: dict, attrs: dict, constant_weights: bool, legacy: bool):
    """One QMoE / MoE node (weights as initializers or graph inputs) and its feeds.

    ``legacy`` (ORT before 1.32) drops :data:`NEW_ATTRIBUTES` where that keeps the meaning.
    """
    const_keys = WEIGHTS[op] if constant_weights else ()
    model, feeds = kernel_node_model(OPS[op].split(".")[-1], call, attrs, const_keys=const_keys)
    node = model.graph.node[0]
    keep = [a for a in node.attribute if not (legacy and a.i in NEW_ATTRIBUTES.get(a.name, ()))]
    del node.attribute[:]
    node.attribute.extend(keep)
    # kernel_node_model types its output float32: a float16 call (--dtype float16) has a
    # float16 output, the type of its input.
    model.graph.output[0].type.tensor_type.elem_type = model.graph.input[
        0
    ].type.tensor_type.elem_type
    # The token count symbolic: one session serves every case of a layer (1 ... 512 tokens).
    for value in model.graph.input:
        if value.name in ("in0", "in1"):
            value.type.tensor_type.shape.dim[0].dim_param = "tokens"
    return model, feeds


def ort_feeds(op: str, call: dict, constant_weights: bool) -> dict[str, np.ndarray]:
    """The feeds of :func:`ort_model`'s model for ``call`` (inputs named by ONNX position)."""
    weights = [call.get(k) for k in WEIGHTS[op]] if constant_weights else []
    arrays = kernel_node_inputs(OPS[op].split(".")[-1], call)
    return {
        f"in{i}": a
        for i, a in enumerate(arrays)
        if a is not None and not any(a is w for w in weights)
    }


class OrtCpu:
    """ORT CPU sessions of one node, one per layer (weights), reused across token counts.

    Weights are initializers (as in a fused model) while the model stays under protobuf's
    2 GB, graph inputs otherwise.
    """

    def __init__(self, threads: int | None):
        import onnxruntime as ort

        self.ort, self.threads, self.key, self.sess = ort, threads, None, None
        self.version = ort.__version__
        self.constant = True

    def runner(self, op: str, layer: str, call: dict, attrs: dict):
        """A zero-argument callable running ``call`` on the layer's session."""
        ort = self.ort
        if self.key != (op, layer):
            self.sess = None  # free the previous layer's session first
            weight_bytes = sum(call[k].nbytes for k in WEIGHTS[op] if call.get(k) is not None)
            self.constant = weight_bytes < 1.5e9
            version = tuple(int(p) for p in self.version.split(".")[:2])
            model, _ = ort_model(op, call, attrs, self.constant, legacy=version < (1, 32))
            options = ort.SessionOptions()
            options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
            if self.threads:
                options.intra_op_num_threads = self.threads
            options.log_severity_level = 3
            self.sess = ort.InferenceSession(
                model.SerializeToString(), options, providers=["CPUExecutionProvider"]
            )
            self.key = (op, layer)
        feeds, sess = ort_feeds(op, call, self.constant), self.sess
        return lambda: sess.run(["out"], feeds)[0]


class OrtWebGpu:
    """onnxruntime-webgpu in a subprocess (see ort_webgpu_worker.py)."""

    def __init__(self, target: str):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            [str(Path(target).resolve()), env.get("PYTHONPATH", "")]
        )
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        self.scratch = Path(tempfile.mkdtemp(prefix="bench-ort-webgpu-"))
        self.unsupported: dict[tuple[str, str] | str, str] = {}
        self.probed: set[str] = set()

    def _ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:  # skip onnxruntime's log lines
            if line.startswith("@@answer "):
                return json.loads(line[len("@@answer ") :])
        return {"error": "the worker exited"}

    def run(
        self, op: str, layer: str, call: dict, attrs: dict, runs: int
    ) -> tuple[dict, np.ndarray | None]:
        """Times (or an error) of one case, and its output; one model file per layer."""
        import onnx

        if op == "moe" and "moe" not in self.probed:
            self._probe_float_moe(attrs)
        if (op, layer) in self.unsupported or op in self.unsupported:
            return {"error": self.unsupported.get((op, layer)) or self.unsupported[op]}, None
        path = self.scratch / f"{op}-{layer}.onnx"
        if not path.exists():
            for old in self.scratch.iterdir():
                old.unlink()
            model, _ = ort_model(op, call, attrs, constant_weights=True, legacy=True)
            onnx.save_model(
                model,
                str(path),
                save_as_external_data=True,
                all_tensors_to_one_file=True,
                location=f"{op}-{layer}.weights",
                size_threshold=1024,
            )
            del model
        feeds = ort_feeds(op, call, constant_weights=True)
        np.savez(self.scratch / "feeds.npz", **feeds)
        out_path = self.scratch / "out.npy"
        answer = self._ask(
            {
                "model": str(path),
                "feeds": str(self.scratch / "feeds.npz"),
                "output": str(out_path),
                "runs": runs,
                "warmup_seconds": 0.5,
            }
        )
        out = np.load(out_path) if "times" in answer else None
        if "times" not in answer and "Could not find an implementation" in answer["error"]:
            self.unsupported[(op, layer)] = answer["error"]
        return answer, out

    def _probe_float_moe(self, attrs: dict) -> None:
        """Run a tiny MoE node first.

        float32 layers are gigabytes to write for nothing where the provider has no MoE.
        """
        rng = np.random.default_rng(0)
        fusion = 2 if attrs.get("swiglu_fusion", 0) in (1, 2) else 1
        tiny = {
            "inputT": rng.standard_normal((2, 32), dtype=np.float32),
            "routerT": rng.standard_normal((2, 4), dtype=np.float32),
            "fc1T": rng.standard_normal((4, 32 * fusion, 32), dtype=np.float32),
            "fc2T": rng.standard_normal((4, 32, 32), dtype=np.float32),
        }
        self.probed.add("moe")
        answer, _ = self.run("moe", "probe", tiny, {**attrs, "k": min(attrs["k"], 2)}, runs=1)
        if "error" in answer:
            self.unsupported["moe"] = f"a 4-expert MoE node already fails: {answer['error']}"

    def close(self) -> None:
        """End the worker and remove its scratch files."""
        self.proc.stdin.close()
        self.proc.wait(timeout=30)
        for old in self.scratch.iterdir():
            old.unlink()
        self.scratch.rmdir()
