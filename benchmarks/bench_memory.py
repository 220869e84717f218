"""Does the fuser's memory grow with the model? Peak RSS of ``onnx-moe-fuse`` on 1..N-layer models.

Builds models of N stacked int4 MoE layers (the sample generator's Gather/Expand/MatMul
decomposition behind DequantizeLinear, blocked 32; each layer's output feeds the next through
a residual Add), saves each with external data, then runs the command line on it in a child
process and reads the child's peak resident memory (``getrusage(RUSAGE_CHILDREN)``). Side by
side for reference: a child that only loads and saves the same model through onnx-ir
(``ir.load`` + ``ir.save`` with external data: lazy, streamed), and the data file's size. If
the fuser streams, its peak stays near the load+save reference; if it holds the model, the
peak grows by about a layer's bytes per layer.

    .venv/bin/python benchmarks/bench_memory.py [--layers 1 2 4 8] [--experts 32]
        [--hidden 2048] [--inter 768] [--folder /tmp/bench_memory]
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table  # noqa: E402

_LOAD_SAVE = """
import sys, onnx_ir as ir
model = ir.load(sys.argv[1])
ir.save(model, sys.argv[2], external_data=sys.argv[3])
"""


def _stacked_model(layers: int, hidden: int, inter: int, experts: int) -> onnx.ModelProto:
    """``layers`` MoE layers in sequence: ``x_{i+1} = x_i + layer_i(x_i)``."""
    from onnx_moe_fuse.samples._layers import LayerSpec, build_layer

    nodes, inits, value_info = [], [], []
    first = None
    current = "x"
    for i in range(layers):
        spec = LayerSpec(
            name=f"layer{i}",
            hidden=hidden,
            inter=inter,
            experts=experts,
            top_k=8 if experts >= 8 else 2,
            routing="softmax_topk_renorm",
            activation="swiglu",
            spelling="dec",
            weights="int4b32",
            seed_key=f"bench_memory_{i}",
        )
        layer = build_layer(spec)
        first = first or layer
        g = layer.graph
        prefix = f"l{i}/"

        def rename(
            name: str, prefix: str = prefix, source: str = current, entry: str = g.input[0].name
        ) -> str:
            if not name:
                return name
            return source if name == entry else prefix + name

        for node in g.node:
            node.input[:] = [rename(n) for n in node.input]
            node.output[:] = [rename(n) for n in node.output]
            node.name = prefix + (node.name or node.op_type)
            nodes.append(node)
        for t in g.initializer:
            t.name = rename(t.name)
            inits.append(t)
        for vi in g.value_info:
            vi.name = rename(vi.name)
            value_info.append(vi)
        out = rename(g.output[0].name)
        residual = f"x{i + 1}"
        nodes.append(onnx.helper.make_node("Add", [current, out], [residual], name=f"residual{i}"))
        current = residual
    assert first is not None
    graph = onnx.helper.make_graph(
        nodes,
        "stacked_moe",
        [first.graph.input[0]],
        [onnx.helper.make_tensor_value_info(current, onnx.TensorProto.FLOAT, None)],
        initializer=inits,
        value_info=value_info,
    )
    model = onnx.helper.make_model(graph, opset_imports=list(first.opset_import))
    model.ir_version = first.ir_version
    return model


_PEAK_OF = """
import resource, subprocess, sys
proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
sys.stderr.write(proc.stdout[-2000:] + proc.stderr[-2000:] if proc.returncode else "")
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, proc.returncode)
"""


def _child_peak_mib(argv: list[str]) -> tuple[float, float, int]:
    """Run ``argv``; its peak RSS in MiB, its wall seconds, its exit code.

    A fresh wrapper process runs it and reports ``RUSAGE_CHILDREN`` (whose max is over that
    wrapper's one child), so each measurement is of one command alone.
    """
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _PEAK_OF, *argv], capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.stderr:
        print(proc.stderr, file=sys.stderr)
    peak_kib, code = proc.stdout.split()
    return int(peak_kib) / 1024.0, wall, int(code)


def main() -> None:
    """Build, fuse and measure each model size; print one table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--folder", default="/tmp/bench_memory")
    args = parser.parse_args()

    folder = Path(args.folder)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    cli = str(Path(sys.executable).with_name("onnx-moe-fuse"))
    rows = []
    for n in sorted(args.layers):
        path = folder / f"moe_{n}layers.onnx"
        model = _stacked_model(n, args.hidden, args.inter, args.experts)
        onnx.save(model, path, save_as_external_data=True, location=path.name + ".data")
        del model
        data_mib = (folder / (path.name + ".data")).stat().st_size / 2**20
        ref_mib, ref_s, _ = _child_peak_mib(
            [sys.executable, "-c", _LOAD_SAVE, str(path), str(folder / f"copy_{n}.onnx"),
             f"copy_{n}.onnx.data"]
        )  # fmt: skip
        fuse_mib, fuse_s, rc = _child_peak_mib(
            [cli, str(path), "-o", str(folder / f"fused_{n}.onnx")]
        )
        rows.append(
            [
                n,
                f"{data_mib:.0f}",
                f"{ref_mib:.0f}",
                f"{fuse_mib:.0f}",
                f"{fuse_mib / ref_mib:.1f}x",
                f"{ref_s:.1f}",
                f"{fuse_s:.1f}",
                rc,
            ]
        )
    print_table(
        [
            "layers",
            "data MiB",
            "load+save peak MiB",
            "fuse peak MiB",
            "fuse/load+save",
            "load+save s",
            "fuse s",
            "exit",
        ],
        rows,
    )


if __name__ == "__main__":
    main()
