"""Expert weights read where the reference path gathers them: memory maps instead of copies.

Per-layer verification runs the original region on the reference path (:mod:`.layers`). After
:func:`.regions.select_before_dequantize`, a stacked expert tensor is read only by ``Gather``
along its expert axis, so only the selected experts' bytes matter. Loading the tensor would
read the whole layer (361 MiB for a Qwen3-30B-A3B int4 layer), and ``onnx.reference`` would
then unpack every 4-bit code to a byte (722 MiB more) before the first node runs.
:func:`map_gathered_weights` instead makes each such initializer a graph input fed with a
read-only memory map of its bytes in the data file: the ``Gather`` touches the pages of the
experts it picks, and nothing else is read.

A 4-bit tensor is fed as its packed bytes, one row per expert (``[E, elements / 2]`` uint8; an
expert with an odd count of elements does not start on a whole byte and is left as it is), and
an :class:`UnpackFourBit` node after the ``Gather`` unpacks the picked rows: the same values,
in the same dtype, as onnx's ``numpy_helper.to_array`` of the whole tensor followed by the
``Gather`` (tested against onnx's evaluator on the loaded weights).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx
from onnx.reference.op_run import OpRun

from onnx_moe_fuse.io.external_data import map_external
from onnx_moe_fuse.io.model_check import is_external
from onnx_moe_fuse.verify.regions import copy_node

__all__ = ["MAPPED_DOMAIN", "UnpackFourBit", "map_gathered_weights", "unpack_four_bit"]

#: The domain of :class:`UnpackFourBit` (a node of the reference run only, never written out).
MAPPED_DOMAIN = "onnx_moe_fuse.verify"

_FOUR_BIT = (onnx.TensorProto.INT4, onnx.TensorProto.UINT4)


class UnpackFourBit(OpRun):
    """Packed 4-bit bytes ``[..., n / 2]`` to the codes ``[..., *dims]`` as onnx reads them."""

    op_domain = MAPPED_DOMAIN

    def _run(self, packed: np.ndarray, data_type: int = 0, dims: list[int] | None = None):  # type: ignore[override]
        return (unpack_four_bit(packed, data_type, dims),)


def unpack_four_bit(packed: np.ndarray, data_type: int, dims: list[int] | None) -> np.ndarray:
    """Packed 4-bit bytes ``[..., n / 2]`` to the codes ``[..., *dims]`` (``data_type``'s)."""
    # onnx packs element 2i in the low nibble of byte i and 2i + 1 in the high one, and
    # ml_dtypes keeps a 4-bit code in the low nibble of its byte (as to_array makes them)
    codes = np.empty((*packed.shape[:-1], 2 * packed.shape[-1]), dtype=np.uint8)
    np.bitwise_and(packed, np.uint8(15), out=codes[..., 0::2])
    np.right_shift(packed, np.uint8(4), out=codes[..., 1::2])
    dtype = onnx.helper.tensor_dtype_to_np_dtype(int(data_type))
    return codes.view(dtype).reshape(*packed.shape[:-1], *(dims or []))


def _gathered_only(graph: onnx.GraphProto, name: str) -> list[onnx.NodeProto] | None:
    """The nodes reading ``name``, when every one is a ``Gather`` of it along axis 0."""
    users = [n for n in graph.node if name in n.input]
    for n in users:
        axis = next((a.i for a in n.attribute if a.name == "axis"), 0)
        if n.op_type != "Gather" or n.domain not in ("", "ai.onnx") or axis != 0:
            return None
        if list(n.input).count(name) != 1 or n.input[0] != name:
            return None
    return users or None


def map_gathered_weights(
    model: onnx.ModelProto, base_dir: Path, name: str = "original region"
) -> dict[str, np.ndarray]:
    """Feed ``model``'s gathered-only external weights from memory maps, in place; the feeds.

    Each external initializer read only by ``Gather`` along axis 0 becomes a graph input; the
    returned ``{input name: memory map}`` go into the reference run beside the random inputs.
    Models with subgraphs are left as they are (their nodes may read any initializer).
    """
    g = model.graph
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
           for n in g.node for a in n.attribute):  # fmt: skip
        return {}
    outputs = {o.name for o in g.output}
    feeds: dict[str, np.ndarray] = {}
    kept: list[onnx.TensorProto] = []
    unpack_after: dict[str, onnx.NodeProto] = {}  # a 4-bit Gather's output: its unpacking
    for t in g.initializer:
        users = _gathered_only(g, t.name) if is_external(t) and t.name not in outputs else None
        count = math.prod(t.dims)
        four_bit = t.data_type in _FOUR_BIT
        if four_bit:
            fits = len(t.dims) >= 2 and (count // max(t.dims[0], 1)) % 2 == 0
        else:
            np_type = onnx.helper.tensor_dtype_to_np_dtype(t.data_type)
            fits = np.dtype(np_type).kind in "fiub"
        if users is None or count == 0 or not fits:
            kept.append(t)
            continue
        raw = map_external(t, base_dir, None, name)
        if four_bit:
            feeds[t.name] = raw.reshape(t.dims[0], -1)
            g.input.append(
                onnx.helper.make_tensor_value_info(
                    t.name, onnx.TensorProto.UINT8, list(feeds[t.name].shape)
                )
            )
            for gather in users:
                unpack_after[gather.output[0]] = onnx.helper.make_node(
                    "UnpackFourBit", [f"{gather.output[0]}/packed"], [gather.output[0]],
                    domain=MAPPED_DOMAIN, data_type=t.data_type, dims=list(t.dims[1:]),
                )  # fmt: skip
        else:
            feeds[t.name] = raw.view(np.dtype(np_type).newbyteorder("<")).reshape(t.dims)
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    if feeds:
        del g.initializer[:]
        g.initializer.extend(kept)
        nodes = []
        for n in g.node:
            n = copy_node(n)  # copies: the fields below are rebuilt
            unpack = unpack_after.get(n.output[0]) if n.output else None
            if unpack is not None:
                n.output[0] = unpack.input[0]
                nodes += [n, unpack]
            else:
                nodes.append(n)
        del g.node[:]
        g.node.extend(nodes)
        if not any(o.domain == MAPPED_DOMAIN for o in model.opset_import):
            model.opset_import.append(onnx.helper.make_opsetid(MAPPED_DOMAIN, 1))
    return feeds
