"""Save a fused model whose scratch weight file becomes the output's data file: no second copy.

The streaming path (``onnx_moe_fuse.streaming_io``) writes each fused layer's repacked weights
into a :class:`~onnx_moe_fuse.io.weight_sink.ScratchFileSink` as they are made. Saving with
``ir.save`` would copy them again into ``OUT.onnx.data``; here the scratch file *is* the data
file: every other initializer of size :data:`~onnx_moe_fuse.io.model_io.EXTERNAL_SIZE_THRESHOLD`
or more is appended to it (an external one copied in the kernel with ``copy_file_range``, never
read into Python), smaller ones are kept inside the model file (as ``ir.save`` would), the file
is moved into the temporary output folder under the data file's name, and the model proto,
which then holds no large tensor, is written beside it. The model's weights are written once.
"""

from __future__ import annotations

from pathlib import Path

import onnx
import onnx_ir as ir

from onnx_moe_fuse.io.model_io import EXTERNAL_SIZE_THRESHOLD
from onnx_moe_fuse.io.weight_sink import ScratchFileSink

__all__ = ["save_into_sink_file"]


def save_into_sink_file(
    model: ir.Model, sink: ScratchFileSink, tmp: Path, name: str, data_name: str
) -> list[str]:
    """Write ``model`` as ``tmp/name`` with ``tmp/data_name`` (the sink's file); the names."""
    scratch = str(sink.path)
    data_path = tmp / data_name
    for graph in model.graphs():
        for value in graph.initializers.values():
            tensor = value.const_value
            if tensor is None:
                continue
            if isinstance(tensor, ir.ExternalTensor) and tensor.path == scratch:
                offset, length = int(tensor.offset or 0), int(tensor.length or tensor.nbytes)
            elif tensor.nbytes >= EXTERNAL_SIZE_THRESHOLD:
                offset, length = sink.append_tensor(tensor)
            else:
                if isinstance(tensor, ir.ExternalTensor):  # small: inside the model file
                    value.const_value = ir.Tensor(
                        tensor.numpy(), dtype=tensor.dtype, name=tensor.name
                    )
                    tensor.release()
                continue
            value.const_value = ir.ExternalTensor(
                data_name,
                offset,
                length,
                tensor.dtype,
                shape=ir.Shape(tuple(tensor.shape)),
                name=tensor.name,
                base_dir=str(tmp),
            )
    sink.become(data_path)
    onnx.save_model(ir.to_proto(model), str(tmp / name))
    return [data_name, name]
