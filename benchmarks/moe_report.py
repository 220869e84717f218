"""Tables and the plot of bench_moe_kernels' measurements (its ``--json`` record).

:func:`comparison_rows` gives, per (op, layer, tokens): our kernel (the planner's choice and,
where other variants were timed, the fastest), ONNX Runtime WebGPU and CPU, and the two
floors of that call on this adapter: the selected experts' weight bytes at the copy kernel's
bandwidth and the layer's FLOPs at the FMA kernel's rate. :func:`stage_rows` says where the
planner's choice spends its time (GPU timestamps before every dispatch, summed by pass).
:func:`write_plot` draws time against tokens, one panel per layer (matplotlib, Agg).

``python benchmarks/moe_report.py RECORD.json [--plot PNG]`` prints the tables (and draws the
plot) of a saved record again, e.g. one brought back from the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402

OP_NAMES = {"qmoe": "QMoE", "moe": "MoE"}
COMPARISON_HEADER = [
    "op",
    "layer",
    "tokens",
    "ours ms (planner's choice)",
    "fastest variant ms",
    "ORT WebGPU ms (x ours)",
    "ORT CPU ms (x ours)",
    "copy floor ms",
    "FMA floor ms",
    "ours / floor",
]
STAGE_HEADER = ["op", "layer", "tokens", "variant", "run ms", "per pass us (sum of dispatches)"]


def _short(vid: str | None) -> str:
    if not vid:
        return "-"
    for prefix in ("quant_", "moe_"):
        if vid.startswith(prefix):
            vid = vid[len(prefix) :]
    return vid.removesuffix("_routed")


def fmt_ms(seconds: float) -> str:
    """Milliseconds with 3 significant digits and no exponent (0.0351, 2.33, 46.6, 6160)."""
    ms = seconds * 1e3
    if ms >= 100:
        return f"{ms:.0f}"
    return f"{ms:.3g}" if ms >= 0.001 else f"{ms:.2e}"


def _us(seconds: float) -> str:
    us = seconds * 1e6
    return f"{us:.0f}" if us >= 100 else f"{us:.3g}"


def brief_error(error: str, width: int = 60) -> str:
    """An ORT error without its boilerplate prefix, cut to ``width`` characters."""
    text = re.sub(r"\[ONNXRuntimeError\] : \d+ : \w+ : ", "", error)
    return text if len(text) <= width else text[: width - 3] + "..."


def floors(entry: dict, ceilings: dict) -> tuple[float, float]:
    """(copy floor, FMA floor) in seconds: weights at the copy rate, FLOPs at the FMA rate."""
    copy = entry["weightBytes"] / ceilings["copyBytesPerSecond"]
    fma = entry["flops"] / ceilings["fmaFlopPerSecond"]
    return copy, fma


def ours(entry: dict) -> float | None:
    """Seconds of the planner's choice (None where it was not timed)."""
    return entry["variantSeconds"].get(entry.get("chosen") or "")


def _ratio(other: float | None, mine: float | None) -> str:
    if other is None:
        return "-"
    text = fmt_ms(other)
    return f"{text} ({other / mine:.3g}x)" if mine else text


def comparison_rows(record: dict) -> list[list[str]]:
    """One row per case, in the record's order."""
    rows = []
    for entry in record["cases"]:
        mine = ours(entry)
        ranked = sorted(entry["variantSeconds"].items(), key=lambda kv: kv[1])
        fastest = (
            f"{_short(ranked[0][0])} {fmt_ms(ranked[0][1])}" if ranked and len(ranked) > 1 else "-"
        )
        web = record["ortWebGpu"].get(f"{entry['op']}/{entry['case']}", {})
        web_cell = _ratio(web.get("seconds"), mine)
        if "seconds" not in web:
            web_cell = f"n/a: {brief_error(web.get('error', 'not run'))}"
        copy, fma = floors(entry, record["ceilings"])
        rows.append(
            [
                OP_NAMES.get(entry["op"], entry["op"]),
                entry["model"],
                str(entry["tokens"]),
                f"{fmt_ms(mine)} ({_short(entry.get('chosen'))})" if mine else "-",
                fastest,
                web_cell,
                _ratio(entry.get("ortCpuSeconds"), mine),
                fmt_ms(copy),
                fmt_ms(fma),
                f"{mine / max(copy, fma):.3g}x" if mine else "-",
            ]
        )
    return rows


HALF_HEADER = ["op", "layer", "tokens", "float32 ms", "float16 ms", "float16 / float32", "as fast"]


def half_rows(record: dict) -> list[list[str]]:
    """The planner's choice in float16 against float32, per (op, layer, tokens).

    Only cases run in both dtypes (``--dtype float32 float16``); issue 20 asks float16 to be
    at least as fast at every size.
    """
    by_key: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for entry in record["cases"]:
        dtype = entry.get("dtype", "float32")
        layer = entry["model"].removesuffix(f" {dtype}")
        by_key[(entry["op"], layer, entry["tokens"])][dtype] = entry
    rows = []
    for (op, layer, tokens), pair in by_key.items():
        full, half = (ours(pair[d]) if d in pair else None for d in ("float32", "float16"))
        if full is None or half is None:
            continue
        rows.append(
            [
                OP_NAMES.get(op, op),
                layer,
                str(tokens),
                f"{fmt_ms(full)} ({_short(pair['float32']['chosen'])})",
                f"{fmt_ms(half)} ({_short(pair['float16']['chosen'])})",
                f"{half / full:.2f}",
                "yes" if half <= full else "no",
            ]
        )
    return rows


def stage_rows(record: dict) -> list[list[str]]:
    """Per case, the planner's choice's dispatch times summed by pass id (microseconds)."""
    rows = []
    for entry in record["cases"]:
        chosen = entry.get("chosen")
        stages = entry.get("stageSeconds", {}).get(chosen or "")
        if not stages:
            continue
        by_pass: dict[str, float] = defaultdict(float)
        for label, seconds in stages:
            by_pass[label] += seconds
        mine = ours(entry)
        rows.append(
            [
                OP_NAMES.get(entry["op"], entry["op"]),
                entry["model"],
                str(entry["tokens"]),
                _short(chosen),
                fmt_ms(mine) if mine else "-",
                ", ".join(f"{k} {_us(v)}" for k, v in by_pass.items()),
            ]
        )
    return rows


def print_report(record: dict) -> None:
    """The comparison table, then the per-pass table (where timestamps inside passes exist)."""
    ceil = record["ceilings"]
    print(
        f"{record.get('adapter', '?')}, {record.get('date', '?')}: copy kernel "
        f"{ceil['copyBytesPerSecond'] / 1e9:.0f} GB/s (read + write), FMA kernel "
        f"{ceil['fmaFlopPerSecond'] / 1e12:.3g} TFLOP/s (float32); ORT CPU "
        f"{record.get('ortCpuVersion', '?')} (threads: {record.get('ortCpuThreads', '?')})"
    )
    print()
    print_table(COMPARISON_HEADER, comparison_rows(record))
    halves = half_rows(record)
    if halves:
        print()
        print("float16 against float32 (the planner's choice in each, same draws):")
        print_table(HALF_HEADER, halves)
    stages = stage_rows(record)
    if stages:
        print()
        print("Where the planner's choice spends its time (timestamps before every dispatch):")
        print_table(STAGE_HEADER, stages)


def write_plot(record: dict, path: str | Path) -> None:
    """Time against tokens, one panel per (op, layer): ours, ORT WebGPU / CPU, the floors."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    layers: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for entry in record["cases"]:
        layers[(entry["op"], entry["model"])].append(entry)
    order = list(OP_NAMES)
    panels = sorted(layers, key=lambda k: (order.index(k[0]) if k[0] in order else 9, k[1]))
    cols = min(2, len(panels)) or 1
    rows = -(-len(panels) // cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols, 4.4 * rows), squeeze=False)
    web_version = next(
        (w["version"] for w in record["ortWebGpu"].values() if "version" in w), "1.27"
    )
    for ax, key in zip(axes.flat, panels, strict=False):
        entries = sorted(layers[key], key=lambda e: e["tokens"])
        tokens = [e["tokens"] for e in entries]

        def series(values, entries=entries):
            pts = [(e["tokens"], v * 1e3) for e, v in zip(entries, values, strict=True) if v]
            return [p[0] for p in pts], [p[1] for p in pts]

        web = [
            record["ortWebGpu"].get(f"{e['op']}/{e['case']}", {}).get("seconds") for e in entries
        ]
        lines = [
            ("ours (planner's choice)", [ours(e) for e in entries], "o-", "C0"),
            (f"ORT WebGPU {web_version}", web, "s-", "C1"),
            (
                f"ORT CPU {record.get('ortCpuVersion', '')}",
                [e.get("ortCpuSeconds") for e in entries],
                "^-",
                "C2",
            ),
            (
                "copy-bandwidth floor",
                [floors(e, record["ceilings"])[0] for e in entries],
                "x--",
                "0.45",
            ),
            ("FMA floor", [floors(e, record["ceilings"])[1] for e in entries], "+:", "0.2"),
        ]
        for label, values, style, color in lines:
            xs, ys = series(values)
            if xs:
                ax.plot(xs, ys, style, color=color, label=label)
        if not any(web):
            errors = [
                record["ortWebGpu"].get(f"{e['op']}/{e['case']}", {}).get("error") for e in entries
            ]
            why = next((e for e in errors if e), "not run")
            ax.text(
                0.98, 0.02, f"ORT WebGPU: {brief_error(why, 50)}", transform=ax.transAxes,
                ha="right", va="bottom", fontsize=7, color="C1",
            )  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(tokens, [str(t) for t in tokens])
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("tokens")
        ax.set_ylabel("ms per layer")
        ax.set_title(f"{OP_NAMES.get(key[0], key[0])} {key[1]}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.suptitle(
        f"MoE layer time, {record.get('adapter', '')} ({record.get('date', '')})", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot written to {path}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record", help="a bench_moe_kernels.py --json file")
    parser.add_argument("--plot", default=None, help="write the plot (PNG) here")
    args = parser.parse_args(argv)
    record: dict[str, Any] = json.loads(Path(args.record).read_text())
    print_report(record)
    if args.plot:
        write_plot(record, args.plot)


if __name__ == "__main__":
    main()
