"""Export the PyTorch MoE corpus (``sample_models/pytorch_corpus``) with torch.onnx.

Every layer goes through both exporters (TorchScript ``dynamo=False``, ``dynamo=True``) at
opsets 18 and 23, with dynamic (``batch``, ``sequence``) and static token counts: up to 8 files
per layer under ``sample_models/exported/pytorch_corpus/``, each checked here against the
PyTorch module in ONNX Runtime CPU (graph optimisations off):

* on the fixed reference input (``<layer>.npz``: ``input`` ``[2, 3, 8]`` and the module's
  ``output``): a file is written only when ORT matches within 1e-5 of the output's scale;
  otherwise (and when an exporter raises) the error text goes into ``index.json``;
* an opset-23 export equal to its opset-18 twin but for the IR version and opset stamps is
  not stored again (``stored_as`` in its record; ``restamped`` makes it);
* on more random inputs (two; three, other token counts, for dynamic exports): an export that
  disagrees there is specialised to the example input (a traced host-side list, a baked
  loop), so that *file* is marked ``expressible: false`` with that reason: fusing it would
  change what the graph computes.

Run with the export venv from outside the repository root (the root shadows ``kernels``):
``cd /tmp && /work/main/.venv-export/bin/python /path/to/sample_models/export_pytorch_corpus.py``
(``--only NAME`` for some layers, the other layers' records are kept; ``--out DIR`` writes
elsewhere, e.g. while a test run reads the committed folder).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from pytorch_corpus import LAYERS  # noqa: E402
from pytorch_corpus.common import H, seeded  # noqa: E402

OUT = HERE / "exported" / "pytorch_corpus"
REF_SHAPE = (2, 3, H)
#: the extra inputs of the faithfulness check: same shape for static exports, others for dynamic
STATIC_CHECKS = ((2, 3, H), (2, 3, H))
#: token counts of the dynamic checks: 20 tokens pass a 12-token capacity baked from the example
DYNAMIC_CHECKS = ((1, 5, H), (3, 2, H), (4, 5, H))
RTOL = 1e-5
VARIANTS = [
    (exporter, opset, dynamic)
    for exporter in ("torchscript", "dynamo")
    for opset in (18, 23)
    for dynamic in (True, False)
]


def file_name(layer: str, exporter: str, opset: int, dynamic: bool) -> str:
    return f"{layer}__{exporter}_op{opset}_{'dynamic' if dynamic else 'static'}"


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    if got.shape != want.shape:
        return float("inf")
    return float(np.abs(got.astype(np.float64) - want).max() / max(np.abs(want).max(), 1e-30))


def export(
    module: torch.nn.Module, x: torch.Tensor, exporter: str, opset: int, dynamic: bool
) -> bytes:
    """The ONNX bytes of ``module`` at ``x`` (weights inside), or the exporter's exception."""
    buf = io.BytesIO()
    noise = io.StringIO()
    with (
        contextlib.redirect_stdout(noise),
        contextlib.redirect_stderr(noise),
        warnings.catch_warnings(),
    ):
        warnings.simplefilter("ignore")
        if exporter == "torchscript":
            axes = {"x": {0: "batch", 1: "sequence"}, "output": {0: "batch", 1: "sequence"}}
            torch.onnx.export(
                module,
                (x,),
                buf,
                dynamo=False,
                opset_version=opset,
                input_names=["x"],
                output_names=["output"],
                dynamic_axes=axes if dynamic else None,
            )
            return buf.getvalue()
        dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("sequence")} if dynamic else None
        program = torch.onnx.export(
            module,
            (x,),
            dynamo=True,
            opset_version=opset,
            input_names=["x"],
            output_names=["output"],
            dynamic_shapes=(dims,) if dynamic else None,
        )
        return strip_metadata(program.model_proto).SerializeToString()


def restamped(model: onnx.ModelProto, ir_version: int, opset: int) -> onnx.ModelProto:
    """``model`` with another IR version and default-domain opset, nothing else changed.

    Both exporters give the same graph at opsets 18 and 23 for most layers (TorchScript also
    bumps the IR version 8 -> 11): such an opset-23 export is not stored twice; its record's
    ``stored_as`` names the opset-18 file and ``tests/pipeline/corpus_outcome.load`` restamps it
    (checked here to reproduce the export exactly, as a proto).
    """
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.ir_version = ir_version
    for entry in out.opset_import:
        if entry.domain in ("", "ai.onnx"):
            entry.version = opset
    return out


def strip_metadata(model: onnx.ModelProto) -> onnx.ModelProto:
    """Drop the dynamo exporter's per-node ``metadata_props`` and doc strings.

    They are stack traces and FX names, about 80% of a corpus file's bytes; nodes, names,
    shapes and weights stay as exported.
    """
    for graph in [model.graph, *(f for f in model.functions)]:
        for node in graph.node:
            del node.metadata_props[:]
            node.doc_string = ""
    return model


def ort_run(model_bytes: bytes, x: np.ndarray) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    opts.log_severity_level = 3
    sess = ort.InferenceSession(model_bytes, opts, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def error_text(exc: BaseException) -> str:
    cause = exc.__cause__ or exc
    lines = [ln for ln in str(cause).splitlines() if ln.strip()]
    return f"{type(cause).__name__}: {lines[0][:400] if lines else ''}"


def input_dims(model: onnx.ModelProto) -> list[int | str]:
    dims = model.graph.input[0].type.tensor_type.shape.dim
    return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in dims]


def row_independence(module: torch.nn.Module) -> float:
    """How far the module's output for 12 tokens is from its output for each token alone.

    An independent check of the ``expressible`` marks: one fused node computes every token
    from that token alone, so an expressible layer must give 0 (up to rounding); a capacity
    limit makes tokens compete for expert slots, and shows here.
    """
    x = torch.randn(1, 12, H, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        together = module(x).numpy()
        alone = np.concatenate([module(x[:, t : t + 1]).numpy() for t in range(12)], axis=1)
    return rel_err(alone, together)


def run_layer(name: str) -> tuple[list[dict], list[dict], dict]:
    layer = LAYERS[name]
    torch.manual_seed(0)
    module = seeded(layer.build(), name)
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(REF_SHAPE, generator=gen)
    with torch.no_grad():
        ref = module(x).numpy()
    np.savez(OUT / f"{name}.npz", input=x.numpy(), output=ref)
    files, failures = [], []
    for exporter, opset, dynamic in VARIANTS:
        stem = file_name(name, exporter, opset, dynamic)
        where = {"layer": name, "exporter": exporter, "opset": opset, "dynamic": dynamic}
        try:
            blob = export(module, x, exporter, opset, dynamic)
            got = ort_run(blob, x.numpy())
        except Exception as exc:  # noqa: BLE001 (recorded, not raised)
            failures.append({**where, "error": error_text(exc)})
            continue
        err = rel_err(got, ref)
        if not err <= RTOL:
            failures.append(
                {**where, "error": f"ORT CPU differs from torch on the reference input: {err:.3g}"}
            )
            continue
        checks, check_errors = [], []
        for i, shape in enumerate(DYNAMIC_CHECKS if dynamic else STATIC_CHECKS):
            xi = torch.randn(shape, generator=torch.Generator().manual_seed(99 + i))
            with torch.no_grad():
                want = module(xi).numpy()
            try:
                checks.append(rel_err(ort_run(blob, xi.numpy()), want))
            except Exception as exc:  # noqa: BLE001 (an input the traced graph cannot take)
                checks.append(float("inf"))
                check_errors.append(f"{list(shape)}: {error_text(exc)}")
        faithful = all(c <= RTOL for c in checks)
        model = onnx.load_from_string(blob)
        twin = file_name(name, exporter, 18, dynamic) if opset != 18 else None
        stored = f"{stem}.onnx"
        if (
            twin
            and (OUT / f"{twin}.onnx").exists()
            and restamped(
                onnx.load(OUT / f"{twin}.onnx"), model.ir_version, opset
            ).SerializeToString()
            == model.SerializeToString()
        ):
            stored = f"{twin}.onnx"  # the same graph: only the stamps differ (see restamped)
        else:
            (OUT / stored).write_bytes(blob)
        files.append(
            {
                "file": f"{stem}.onnx",
                "stored_as": stored,
                "ir_version": model.ir_version,
                **where,
                "upstream": layer.upstream,
                "expressible": layer.expressible and faithful,
                "trap_reason": None
                if layer.expressible and faithful
                else (
                    layer.why
                    if not layer.expressible
                    else "the export is specialised to the example input: ORT on other inputs differs "
                    f"from torch (max rel {max(checks):.3g}); the graph is not the layer"
                ),
                "expected_op": layer.expected if faithful else None,
                "input_shape": input_dims(model),
                "reference": f"{name}.npz",
                "ref_max_rel_err": err,
                "faithful": faithful,
                "check_max_rel_err": max(checks),
                "check_errors": check_errors,
                "moe_layers": 1,
                "bytes": len(blob),
                "nodes": len(model.graph.node),
            }
        )
    row_wise = row_independence(module)
    if layer.expressible:  # a fused node computes each token from that token alone
        assert row_wise <= RTOL, (
            f"{name}: marked expressible, but its tokens interact ({row_wise:.3g})"
        )
    info = {
        "layer": name,
        "upstream": layer.upstream,
        "follows": layer.follows,
        "expressible": layer.expressible,
        "why": layer.why,
        "k": layer.k,
        "experts": layer.experts,
        "adaptations": list(layer.adaptations),
        "reference": f"{name}.npz",
        "input_shape": list(REF_SHAPE),
        "row_wise_max_rel_err": row_wise,
    }
    return files, failures, info


def main() -> None:
    global OUT  # --out redirects every writer of this module
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="layer names (default: all)")
    parser.add_argument("--out", type=Path, help=f"output folder (default: {OUT})")
    args = parser.parse_args()
    if args.out:
        OUT = args.out.resolve()
    OUT.mkdir(parents=True, exist_ok=True)
    index_path = OUT / "index.json"
    old = json.loads(index_path.read_text()) if index_path.exists() and args.only else None
    names = args.only or list(LAYERS)
    unknown = sorted(set(names) - set(LAYERS))
    if unknown:
        sys.exit(f"unknown layer(s): {', '.join(unknown)}; known: {', '.join(LAYERS)}")
    files, failures, layers = [], [], []
    if old:
        files = [f for f in old["files"] if f["layer"] not in names]
        failures = [f for f in old["failures"] if f["layer"] not in names]
        layers = [entry for entry in old["layers"] if entry["layer"] not in names]
    for name in names:
        for stale in OUT.glob(f"{name}__*.onnx"):
            stale.unlink()
        got, failed, info = run_layer(name)
        files += got
        failures += failed
        layers.append(info)
        print(f"{name}: {len(got)} files, {len(failed)} failed", flush=True)
    order = list(LAYERS)
    files.sort(key=lambda f: (order.index(f["layer"]), f["file"]))
    failures.sort(
        key=lambda f: (order.index(f["layer"]), f["exporter"], f["opset"], not f["dynamic"])
    )
    layers.sort(key=lambda entry: order.index(entry["layer"]))
    index = {
        "versions": {
            "torch": torch.__version__,
            "onnx": onnx.__version__,
            "onnxruntime": ort.__version__,
            "numpy": np.__version__,
            "python": sys.version.split()[0],
        },
        "rtol": RTOL,
        "layers": layers,
        "files": files,
        "failures": failures,
    }
    index_path.write_text(json.dumps(index, indent=1) + "\n")
    total = sum(p.stat().st_size for p in OUT.iterdir())
    print(f"{len(files)} files, {len(failures)} failures, {total / 1e6:.2f} MB in {OUT}")


if __name__ == "__main__":
    main()
