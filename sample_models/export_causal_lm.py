"""Export whole 2-layer transformers ``*ForCausalLM`` MoE models to ONNX with torch.onnx.

Run it in the export venv (torch is never needed by the package, its tests or CI)::

    .venv-export/bin/python sample_models/export_causal_lm.py [--only NAME ...] [--family F ...]
        [--resume]

For each family of ``export_causal_lm_families.py`` (the configs and the per-family facts; the
torch.onnx call and its opset-23 workarounds are in ``export_causal_lm_onnx.py``, the grid of
variants and what each record expects in ``export_causal_lm_grid.py``) it builds the model from a tiny config made in
code (no download), fills its weights from a fixed torch seed, and exports it with
``torch.onnx.export(..., dynamo=True)`` in each variant: experts implementation ``batched_mm``
and ``grouped_mm`` (transformers' default, exported with transformers' own translation table,
``transformers.exporters.exporter_onnx._ONNX_TRANSLATION_TABLE``, since plain torch.onnx has no
translation of ``transformers::grouped_mm_fallback``), batch and sequence dynamic or static, opset
18 or 23, float32; plus float16 (dynamic, opset 23; also static for a family without dynamic
exports); plus, for four families, float16 and bfloat16 at opset 18 (bfloat16 at 24 where 18
cannot type it; bfloat16 checked on its float32 twin, ``upcast.py``). Variants run most telling first across all families (``priority``). The model's input is ``input_ids``
(``[2, 8]`` int64), its output ``logits`` (``use_cache=False``). Into
``sample_models/exported/causal_lm/`` it writes per model:

- ``<name>.onnx``: the export, weights inside the file;
- ``<name>.npz``: ``input_ids`` and the PyTorch ``logits`` on them;
- ``<name>.json``: versions, config, export options, op histogram, the router form read from the
  modeling code, ``expected`` (what a correct fuser must do with each MoE layer) and the
  ORT-vs-PyTorch errors measured here;

and ``index.json`` (the models, and each failed export with its exception's first line), linked
from ``exported/index.json`` under ``causal_lm``. ``--only``/``--family`` redo just those and
merge them into the existing index; ``--resume`` skips what the index already lists.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from export_causal_lm_families import FAMILIES, Family, make_config  # noqa: E402
from export_causal_lm_grid import Variant, expected_record, priority, variants  # noqa: E402
from export_causal_lm_onnx import PATCHES, broken_fusion, export, first_line  # noqa: E402
from export_records import jsonable, ort_session, rel_err, versions  # noqa: E402
from upcast import upcast_to_float32  # noqa: E402

OUT_DIR = Path(__file__).resolve().parent / "exported" / "causal_lm"
SEED = 0
REF_IDS_SHAPE = (2, 8)
# Other [batch, sequence] shapes each dynamic export is checked on here (one token, odd, longer).
CHECK_SHAPES = [(1, 1), (1, 5), (3, 11)]
MAX_FILE_BYTES = 2 << 20
# float16 logits against PyTorch's float16 CPU run: rounding differs op by op (ORT computes
# some fp16 ops in float32 internally, PyTorch others), so the tolerance is looser; bfloat16
# (8 significant bits) looser again, and checked on the export upcast to float32 (ORT 1.32 CPU
# runs few bfloat16 ops: see ``upcast_to_float32``).
RTOL = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 5e-2}
# -- the model -----------------------------------------------------------------------------------


class LogitsOnly(torch.nn.Module):
    """``model(input_ids).logits``, no cache: the graph a user exports for a forward pass."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The logits, ``[batch, sequence, vocab]``."""
        return self.model(input_ids=input_ids, use_cache=False).logits


def build(variant: Variant) -> tuple[torch.nn.Module, Any]:
    """The family's tiny model with seeded weights, in ``variant.dtype``, eval mode."""
    torch.manual_seed(SEED)
    cfg = make_config(variant.family, variant.impl)
    model = getattr(transformers, variant.family.model_class)(cfg)
    # transformers' init leaves biases and some buffers (DeepSeek's e_score_correction_bias) at
    # zero: a zero tensor tests nothing, so those get small random values too.
    with torch.no_grad():
        for _, tensor in list(model.named_parameters()) + list(model.named_buffers()):
            if tensor.is_floating_point() and tensor.numel() > 0 and not tensor.any():
                tensor.normal_(0.0, 0.1)
    if variant.dtype == "float16":
        model = model.half()
    elif variant.dtype == "bfloat16":
        model = model.to(torch.bfloat16)
    return LogitsOnly(model).eval(), cfg


def moe_layers(model: torch.nn.Module, family: Family) -> list[tuple[int, str]]:
    """``(layer index, block class)`` for each decoder layer: its MoE block or its dense MLP."""
    out = []
    for i, layer in enumerate(model.model.model.layers):
        names = [type(m).__name__ for m in layer.modules()]
        moe = [n for n in names if n in family.moe_blocks]
        out.append((i, moe[0] if moe else ""))
    return out


# -- checks and records ------------------------------------------------------------------------


def random_ids(shape: tuple[int, int], seed: int, vocab: int) -> torch.Tensor:
    """Token ids in ``[3, vocab)`` (above pad/bos/eos), seeded."""
    return torch.randint(3, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _checked_form(path: Path, dtype: str) -> Path | bytes:
    """What ORT CPU checks: the export, or for bfloat16 its float32 twin (``upcast.py``).

    ORT 1.32 CPU has no bfloat16 ``Mul``/``MatMul`` kernels, so a bfloat16 export is checked
    against PyTorch's bfloat16 logits on the same graph computing in float32.
    """
    if dtype != "bfloat16":
        return path
    return upcast_to_float32(onnx.load(str(path))).SerializeToString()


def run_variant(variant: Variant, out_dir: Path) -> dict[str, Any]:
    """Build, export, check and record one variant; raises on any failure."""
    module, cfg = build(variant)
    ids = random_ids(REF_IDS_SHAPE, SEED + 1, cfg.vocab_size)
    path = out_dir / f"{variant.name}.onnx"
    started = time.monotonic()
    patch, unpatched_error = None, None
    try:
        call = export(variant, module, ids, path)
    except Exception as exc:  # noqa: BLE001 (a family with an export patch tries it next)
        if variant.family.export_patch is None:
            raise
        patch, unpatched_error = variant.family.export_patch, first_line(exc)
        call = export(variant, module, ids, path, patch=patch)
    if variant.dynamic:
        (given,) = _io(onnx.load(str(path), load_external_data=False).graph.input)
        if any(isinstance(d, int) for d in given["shape"]):
            raise RuntimeError(
                f"dynamic_shapes asked, but torch.export specialised input_ids to {given['shape']}"
            )
    off: tuple[str, ...] = ()
    plain_errors = []
    while True:
        try:
            session = ort_session(_checked_form(path, variant.dtype))
            session.run(None, {"input_ids": ids.numpy()})
            break
        except Exception as exc:  # noqa: BLE001 (a known opset-23 fusion fault is retried)
            fusion = broken_fusion(path, exc)
            if fusion is None or fusion in off:
                raise
            plain_errors.append({"fusion": fusion, "error_in_ort": first_line(exc)})
            off += (fusion,)
            call = export(variant, module, ids, path, off, patch)
    workaround: dict[str, Any] | None = None
    if off:
        workaround = {
            "what": f"onnxscript's {' and '.join(off)} fusion turned off for this export",
            "errors_with_the_fusion_on": plain_errors,
        }
    if patch is not None:
        workaround = workaround or {}
        what = PATCHES[patch][0]
        workaround["what"] = f"{workaround['what']}; {what}" if "what" in workaround else what
        workaround["error_without_the_patch"] = unpatched_error
    export_s = time.monotonic() - started
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        path.unlink()
        raise RuntimeError(f"{path.name} is {size} bytes, over {MAX_FILE_BYTES}")
    model = onnx.load(str(path))
    onnx.checker.check_model(model, full_check=True)

    def compare(shape: tuple[int, int], seed: int) -> tuple[np.ndarray, np.ndarray, float]:
        x = random_ids(shape, seed, cfg.vocab_size)
        with torch.no_grad():
            want = module(x).float().numpy()
        (got,) = session.run(None, {"input_ids": x.numpy()})
        assert got.shape == want.shape, (got.shape, want.shape)
        return x.numpy(), want, rel_err(got.astype(np.float32), want)

    ref_ids, ref_logits, ref_err = compare(REF_IDS_SHAPE, SEED + 1)
    errors = {"x".join(map(str, REF_IDS_SHAPE)): ref_err}
    if variant.dynamic:
        for i, shape in enumerate(CHECK_SHAPES):
            errors["x".join(map(str, shape))] = compare(shape, SEED + 10 + i)[2]
    tol = RTOL[variant.dtype]
    if max(errors.values()) > tol:
        raise RuntimeError(f"ORT vs PyTorch max relative error {errors} over {tol}")
    # bfloat16 logits are stored widened to float32 (exact): numpy has no bfloat16 of its own,
    # and an npz of ml_dtypes' bfloat16 reads back as raw bytes
    stored = variant.dtype if variant.dtype != "bfloat16" else "float32"
    np.savez_compressed(
        out_dir / f"{variant.name}.npz",
        input_ids=ref_ids,
        logits=ref_logits.astype(stored),
    )

    layers = moe_layers(module, variant.family)
    expected, expected_layers, expected_cuda = expected_record(
        variant.family, cfg, layers, variant.dtype
    )
    hist = collections.Counter(n.op_type for n in model.graph.node)
    record = {
        "name": variant.name,
        "file": path.name,
        "file_bytes": size,
        "family": variant.family.name,
        "model_class": variant.family.model_class,
        "config_class": variant.family.config_class,
        "experts_implementation": (
            variant.impl if variant.family.dispatches_experts else variant.family.experts_note
        ),
        "dynamic_shapes": variant.dynamic,
        "opset": variant.opset,
        "dtype": variant.dtype,
        "export_call": call,
        "export_workaround": workaround,
        "export_seconds": round(export_s, 1),
        "versions": versions(),
        "seed": SEED,
        "config": jsonable(cfg.to_diff_dict()),
        "opset_import": {(o.domain or "ai.onnx"): o.version for o in model.opset_import},
        "inputs": _io(model.graph.input),
        "outputs": _io(model.graph.output),
        "router": variant.family.router,
        "expected": expected,
        "expected_layers": expected_layers,
        **_attention_experts(variant.family, layers),
        **({"expected_ort_cuda": expected_cuda} if variant.dtype != "float32" else {}),
        "reference": {
            "file": f"{variant.name}.npz",
            "input_ids_shape": list(REF_IDS_SHAPE),
            "logits_shape": list(ref_logits.shape),
            "logits_dtype": stored,
            "rtol": tol,
        },
        "ort_vs_torch_max_rel_err": errors,
        "ort_checked_on": (
            "the export"
            if variant.dtype != "bfloat16"
            else "its float32 twin (sample_models/upcast.py): ORT 1.32 CPU has no bfloat16 "
            "Mul/MatMul kernels"
        ),
        "op_histogram": dict(sorted(hist.items(), key=lambda kv: (-kv[1], kv[0]))),
        "node_count": len(model.graph.node),
        "node_metadata_props": "dropped (torch.onnx provenance only)",
        "functions": sorted(f"{f.domain}::{f.name}" for f in model.functions),
    }
    (out_dir / f"{variant.name}.json").write_text(
        json.dumps(record, indent=2) + "\n", encoding="utf-8"
    )
    return record


def _attention_experts(family: Family, layers: list[tuple[int, str]]) -> dict[str, Any]:
    """The record's ``expected_attention_experts``: each MoA layer's TopK, refused (no fused op)."""
    if not family.attention_experts:
        return {}
    why = (
        "a mixture of attention experts (per-slot query and output projections around the "
        "attention): no fused MoE op computes it, so its TopK is left alone"
    )
    return {
        "expected_attention_experts": [
            {"layer": index, "outcome": "refused", "why": why} for index, _ in layers
        ]
    }


def _io(values: Any) -> list[dict[str, Any]]:
    out = []
    for v in values:
        t = v.type.tensor_type
        dims = [d.dim_param if d.HasField("dim_param") else d.dim_value for d in t.shape.dim]
        dtype = onnx.TensorProto.DataType.Name(t.elem_type)
        out.append({"name": v.name, "dtype": dtype, "shape": dims})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="export only these variants")
    parser.add_argument("--family", nargs="+", metavar="F", help="export only these families")
    parser.add_argument("--out-dir", type=Path, default=OUT_DIR)
    parser.add_argument(
        "--resume", action="store_true", help="skip variants the index already lists"
    )
    args = parser.parse_args(argv)
    todo = sorted((v for f in FAMILIES for v in variants(f)), key=priority)
    if args.family:
        todo = [v for v in todo if v.family.name in args.family]
    if args.only:
        todo = [v for v in todo if v.name in args.only]
    if not todo:
        parser.error("nothing selected")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    index_path = args.out_dir / "index.json"
    partial = bool(args.only or args.family or args.resume)
    index = {"models": [], "failed_exports": []}
    if partial and index_path.exists():
        index = json.loads(index_path.read_text(encoding="utf-8"))
    if args.resume:
        listed = {m["name"] for m in index["models"]} | {f["name"] for f in index["failed_exports"]}
        todo = [v for v in todo if v.name not in listed]
    redone = {v.name for v in todo}
    models = {m["name"]: m for m in index["models"] if m["name"] not in redone}
    failed = {f["name"]: f for f in index["failed_exports"] if f["name"] not in redone}

    for variant in todo:
        print(f"== {variant.name}", flush=True)
        started = time.monotonic()
        specialised = [
            f
            for f in failed.values()
            if f["family"] == variant.family.name and "specialised" in f["error"]
        ]
        try:
            if variant.dynamic and specialised:
                # torch.export fixes the same dimension in every variant (minutes each): not
                # tried again, recorded with the first failure's error.
                raise RuntimeError(
                    f"not tried, as {specialised[0]['name']}: {specialised[0]['error']}"
                )
            rec = run_variant(variant, args.out_dir)
        except Exception as exc:  # noqa: BLE001 (recorded in the index, the run goes on)
            traceback.print_exc(limit=3)
            for suffix in (".onnx", ".npz", ".json"):
                (args.out_dir / f"{variant.name}{suffix}").unlink(missing_ok=True)
            failed[variant.name] = {
                "name": variant.name,
                "family": variant.family.name,
                "experts_implementation": variant.impl,
                "dynamic_shapes": variant.dynamic,
                "opset": variant.opset,
                "dtype": variant.dtype,
                "error": first_line(exc),
            }
            print(
                f"   FAILED ({time.monotonic() - started:.0f} s): {failed[variant.name]['error']}"
            )
        else:
            print(
                f"   {rec['file_bytes']} bytes, {rec['node_count']} nodes, "
                f"{time.monotonic() - started:.0f} s, errors {rec['ort_vs_torch_max_rel_err']}",
                flush=True,
            )
            models[variant.name] = {
                k: rec[k]
                for k in (
                    "name",
                    "file",
                    "family",
                    "experts_implementation",
                    "dynamic_shapes",
                    "opset",
                    "dtype",
                    "expected",
                    "file_bytes",
                )
            }
        order = {v.name: i for i, v in enumerate(v for f in FAMILIES for v in variants(f))}
        index = {
            "generator": "sample_models/export_causal_lm.py",
            "versions": versions(),
            "models": sorted(models.values(), key=lambda m: order.get(m["name"], 1 << 30)),
            "failed_exports": sorted(failed.values(), key=lambda m: order.get(m["name"], 1 << 30)),
        }
        # Written after every variant, so a long run interrupted keeps what it made.
        index_path.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    if args.out_dir.resolve() == OUT_DIR:
        link_from_block_index(index)
    return 0


def link_from_block_index(index: dict[str, Any]) -> None:
    """Point ``exported/index.json`` (the block exports') at this index, under ``causal_lm``.

    Only that key changes: its ``models`` stay the block exports that
    ``tests/pipeline/test_exported_models_fuse.py`` fuses.
    """
    top_path = OUT_DIR.parent / "index.json"
    top = json.loads(top_path.read_text(encoding="utf-8"))
    top["causal_lm"] = {
        "generator": index["generator"],
        "index": f"{OUT_DIR.name}/index.json",
        "models": len(index["models"]),
        "failed_exports": len(index["failed_exports"]),
    }
    top_path.write_text(json.dumps(top, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    sys.exit(main())
