"""Write every sample MoE layer as ``<name>.onnx``, plus ``index.json``, into a folder.

Usage::

    python sample_models/generate.py [OUT_DIR] [--only NAME ...]

``OUT_DIR`` defaults to ``sample_models/generated/`` next to this script. ``index.json`` holds
``{"default_sample": NAME, "samples": [{"name", "file", "expected", "near_miss_reason",
"description", ...}, ...]}``. A thin wrapper over :mod:`onnx_moe_fuse.samples`, which documents
each sample (see also ``docs/samples.md``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import onnx

from onnx_moe_fuse.samples import DEFAULT_SAMPLE, get_sample, sample_names

DEFAULT_OUT = Path(__file__).resolve().parent / "generated"


def write_samples(out_dir: Path, names: Sequence[str] | None = None) -> list[dict[str, object]]:
    """Write the named samples (default: all) and ``index.json``; returns the index entries."""
    out_dir.mkdir(parents=True, exist_ok=True)
    entries = []
    for name in names or sample_names(kind="all"):
        sample = get_sample(name)
        onnx.save_model(sample.model, out_dir / f"{sample.name}.onnx")
        entries.append(sample.index_entry())
    index = {"default_sample": DEFAULT_SAMPLE, "samples": entries}
    tmp = out_dir / "index.json.tmp"
    tmp.write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    tmp.replace(out_dir / "index.json")
    return entries


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", nargs="?", type=Path, default=DEFAULT_OUT, help="output folder")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="write only these samples")
    args = parser.parse_args(argv)
    known = set(sample_names(kind="all"))
    unknown = [n for n in args.only or [] if n not in known]
    if unknown:
        parser.error(f"unknown sample(s): {', '.join(unknown)}")
    entries = write_samples(args.out_dir, args.only)
    print(f"wrote {len(entries)} samples and index.json to {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
