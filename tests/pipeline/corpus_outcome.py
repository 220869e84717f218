"""What the fuser should do with each file of the PyTorch corpus, checked on one fuse result.

Shared by ``test_pytorch_corpus.py`` and ``scripts/corpus_table.py`` (which also prints the
``KNOWN_UNFUSED`` dict of the files whose outcome falls short today). No torch needed: the
corpus is committed (``sample_models/exported/pytorch_corpus``, made by
``sample_models/export_pytorch_corpus.py``).
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import onnx

from onnx_moe_fuse import fuse

CORPUS = Path(__file__).resolve().parents[2] / "sample_models" / "exported" / "pytorch_corpus"
MS = "com.microsoft"
FUSED_OPS = ("MoE", "QMoE")
NOT_RECOGNISED = "not recognised"


@functools.cache
def index() -> dict[str, Any]:
    return json.loads((CORPUS / "index.json").read_text())


@functools.cache
def records() -> dict[str, dict[str, Any]]:
    """The index's file records by file stem (``<layer>__<exporter>_op<N>_<dynamic|static>``)."""
    return {r["file"].removesuffix(".onnx"): r for r in index()["files"]}


def load(stem: str) -> onnx.ModelProto:
    """The export ``stem`` as the exporter wrote it.

    An opset-23 export whose graph equals its opset-18 twin's is stored once (``stored_as``
    names the opset-18 file): the model is that file with the record's IR version and opset,
    which the export script checked to reproduce the export exactly.
    """
    rec = records()[stem]
    model = onnx.load(CORPUS / rec["stored_as"])
    if rec["stored_as"] != rec["file"]:
        model.ir_version = rec["ir_version"]
        for entry in model.opset_import:
            if entry.domain in ("", "ai.onnx"):
                entry.version = rec["opset"]
    return model


@functools.cache
def fused(stem: str):
    """``fuse`` of the file (ort-cpu), once per process: every test of a file reads this."""
    return fuse(load(stem))


def fused_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.domain == MS and n.op_type in FUSED_OPS]


def shortfall(stem: str) -> str | None:
    """Why the fuse result of ``stem`` falls short of the corpus's expectation, or None.

    Expressible: every MoE layer of the file (one per corpus file) fused into the expected op.
    Trap: a near miss with a part that names a node. Both: no near miss reads "not
    recognised" (issue 18). Correctness (matching outputs, byte-identical refusals) is not
    judged here: ``test_pytorch_corpus`` asserts it for every file, marked or not.
    """
    rec, result = records()[stem], fused(stem)
    misses = result.report.near_misses
    vague = [m["reason"] for m in misses if NOT_RECOGNISED in m["reason"]]
    if rec["expressible"]:
        ops = [n.op_type for n in fused_nodes(result.model)]
        if ops != [rec["expected_op"]] * rec.get("moe_layers", 1):
            first = misses[0] if misses else None
            return (f"{first['part']}: {first['reason']}" if first else "no near miss") + (
                f" (fused {ops})" if ops else ""
            )
    else:
        pointed = [m for m in misses if m.get("part") and m.get("node")]
        if not pointed:
            first = misses[0] if misses else None
            return f"trap refused without a part and node: {first['reason'] if first else 'no near miss'}"
    if vague:
        return vague[0]
    return None
