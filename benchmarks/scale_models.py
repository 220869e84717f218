"""N-layer Qwen3-30B-A3B-size int4 models for bench_scale.py, built from one layer in seconds.

Building one 128-expert layer with the sample generator takes ~25 s on 2 cores, so a 48-layer
model built layer by layer would take 20 minutes. Instead one layer is built once
(:func:`onnx_moe_fuse.samples.stacked.stacked_moe_model` with ``layers=1``: the generator's
Gather/Expand/MatMul decomposition behind blocked int4 DequantizeLinear, residual Add) and kept
in the folder; the N-layer model repeats its nodes N times, names prefixed ``l<i>/``, each
layer feeding the next through its residual, and each layer's initializers get their own
copy of the layer's bytes in the N-layer data file (``copy_file_range``, in the kernel). So
every layer reads its own region of the data file, as in a real model; the layers' numbers
are the same (which neither the fuser's time nor its memory depends on).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import onnx

__all__ = ["layer_model", "stacked_model"]


def layer_model(folder: Path, hidden: int, inter: int, experts: int) -> Path:
    """The one-layer model file (built unless an earlier run left it)."""
    from onnx_moe_fuse.samples.stacked import stacked_moe_model

    path = folder / f"layer_{hidden}x{inter}x{experts}.onnx"
    if not (path.is_file() and (folder / (path.name + ".data")).is_file()):
        model = stacked_moe_model(1, hidden, inter, experts, seed_key="bench_scale")
        onnx.save(model, path, save_as_external_data=True, location=path.name + ".data")
    return path


def _copy_range(src: int, dst: int, offset: int, length: int, at: int) -> None:
    while length:
        done = os.copy_file_range(src, dst, length, offset, at)
        if done <= 0:
            raise OSError(f"copy_file_range stopped with {length} bytes left")
        offset, at, length = offset + done, at + done, length - done


def stacked_model(folder: Path, layers: int, layer: Path) -> Path:
    """The ``layers``-layer model made of ``layer``'s nodes and bytes (built unless present)."""
    path = folder / f"{layer.stem}_x{layers}.onnx"
    data = folder / (path.name + ".data")
    if path.is_file() and data.is_file():
        return path
    one = onnx.load(str(layer), load_external_data=False)
    g = one.graph
    entry = g.input[0].name
    last = g.output[0].name
    layer_bytes = os.path.getsize(str(layer) + ".data")
    nodes, inits, infos = [], [], []
    with open(str(layer) + ".data", "rb") as src, open(data, "wb") as dst:
        for i in range(layers):

            def rename(name: str, i: int = i) -> str:
                if name == entry:
                    return "x" if i == 0 else f"x{i}"
                if name == last:
                    return f"x{i + 1}"
                return name.replace("l0/", f"l{i}/", 1) if name.startswith("l0/") else name

            for node in g.node:
                n = copy.deepcopy(node)
                n.input[:] = [rename(v) if v else v for v in n.input]
                n.output[:] = [rename(v) for v in n.output]
                n.name = rename(n.name).replace("residual0", f"residual{i}")
                nodes.append(n)
            for t in g.initializer:
                t2 = copy.deepcopy(t)
                t2.name = rename(t.name)
                for entry_kv in t2.external_data:
                    if entry_kv.key == "location":
                        entry_kv.value = data.name
                    elif entry_kv.key == "offset":
                        entry_kv.value = str(int(entry_kv.value) + i * layer_bytes)
                inits.append(t2)
            for vi in g.value_info:
                v2 = copy.deepcopy(vi)
                v2.name = rename(vi.name)
                infos.append(v2)
            _copy_range(src.fileno(), dst.fileno(), 0, layer_bytes, i * layer_bytes)
    graph = onnx.helper.make_graph(
        nodes,
        "stacked_moe",
        [g.input[0]],
        [onnx.helper.make_tensor_value_info(f"x{layers}", onnx.TensorProto.FLOAT, None)],
        initializer=inits,
        value_info=infos,
    )
    model = onnx.helper.make_model(graph, opset_imports=list(one.opset_import))
    model.ir_version = one.ir_version
    onnx.save(model, str(path))
    return path
