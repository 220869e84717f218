"""Measure every router family's fusion: router form, construction, error, per target.

For one float32 whole-model export of each family (``sample_models/exported/causal_lm``; the
Llama4 block export from ``sample_models/exported``), and its int4 twin (every stacked expert
weight as symmetric int4 DequantizeLinear, blocks of 16: the test suite's ``quantized``), fuse
for each target, run the fused model and the model it came from in ORT CPU on fresh token ids
of two counts, and print a markdown table: family, router form, the fused op per target, the
routing construction, and the max error relative to the output's scale.

    .venv/bin/python scripts/router_family_table.py

ort-cuda gets float32 MoE only (its QMoE has no float32 kernel: refused); ort-webgpu has no
float MoE kernel, so its float32 rows read "left" (left as it was) and only int4 rows fuse.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path

import numpy as np
import onnx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "pipeline"))  # the suite's int4 quantiser

from export_edits import quantized  # noqa: E402

from onnx_moe_fuse import fuse  # noqa: E402
from onnx_moe_fuse.verify.ort_nodes import session  # noqa: E402

CAUSAL = ROOT / "sample_models" / "exported" / "causal_lm"
BLOCKS = ROOT / "sample_models" / "exported"
TARGETS = ("ort-cpu", "ort-cuda", "ort-webgpu")
SHAPES = ((1, 1), (2, 7))


def _exports() -> list[tuple[str, Path, dict]]:
    """(family, path, record): the first float32 dynamic batched_mm export of each family."""
    chosen: dict[str, tuple[Path, dict]] = {}
    index = json.loads((CAUSAL / "index.json").read_text())["models"]
    for entry in index:
        record = json.loads((CAUSAL / f"{entry['name']}.json").read_text())
        dynamic = "batched_mm_dynamic" in entry["name"] or "dense_bmm_dynamic" in entry["name"]
        if record["dtype"] == "float32" and dynamic:  # (Llama4's experts: dense bmm)
            chosen.setdefault(record["family"], (CAUSAL / record["file"], record))
    llama4 = json.loads((BLOCKS / "llama4_text_moe.json").read_text())
    chosen["llama4 (block)"] = (BLOCKS / "llama4_text_moe.onnx", llama4)
    return [(f, p, r) for f, (p, r) in chosen.items()]


def _feeds(model: onnx.ModelProto, record: dict, shape: tuple[int, int], seed: int) -> dict:
    rng = np.random.default_rng(seed)
    name = model.graph.input[0].name
    if name == "input_ids":
        vocab = record["config"]["vocab_size"]
        return {name: rng.integers(0, vocab, size=shape, dtype=np.int64)}
    hidden = model.graph.input[0].type.tensor_type.shape.dim[-1].dim_value
    return {name: rng.standard_normal((*shape, hidden)).astype(np.float32)}


def _error(original: onnx.ModelProto, fused: onnx.ModelProto, record: dict) -> float:
    worst = 0.0
    for i, shape in enumerate(SHAPES):
        feeds = _feeds(original, record, shape, 101 + i)
        ref = session(original).run(None, feeds)[0].astype(np.float64)
        got = session(fused).run(None, feeds)[0].astype(np.float64)
        worst = max(worst, float(np.max(np.abs(got - ref)) / np.max(np.abs(ref))))
    return worst


def _row(family: str, record: dict, model: onnx.ModelProto, weights: str) -> str:
    form = record.get("router", {}).get("form") or record["computes"]["routing"][:24]
    cells, constructions, errors = [], set(), []
    for target in TARGETS:
        result = fuse(model, target=target)
        ops = collections.Counter(f["op"] for f in result.report.fusions)
        if not ops:
            cells.append("left")
            continue
        cells.append(", ".join(f"{op} x{n}" for op, n in sorted(ops.items())))
        for f in result.report.fusions:
            routing = f.get("routing") or {}
            kind = routing.get("construction", "native")
            constructions.add(kind + (" + rescale" if routing.get("rescaled") else ""))
        errors.append(f"{_error(model, result.model, record):.1e}")
    return (
        f"| {family} | {weights} | {form} | "
        + " | ".join(cells)
        + f" | {'; '.join(sorted(constructions)) or '-'} | {' / '.join(errors) or '-'} |"
    )


def main() -> int:
    print("| family | weights | router form | " + " | ".join(TARGETS) + " | construction | "
          "max error (fused targets) |")  # fmt: skip
    print("|" + "---|" * (5 + len(TARGETS)))
    for family, path, record in _exports():
        original = onnx.load(path)
        print(_row(family, record, original, "float32"), flush=True)
        int4 = quantized(original, block=16, keep_value_info=True)
        if any(n.op_type == "DequantizeLinear" for n in int4.graph.node):  # GatherND experts
            print(_row(family, record, int4, "int4 b16"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
