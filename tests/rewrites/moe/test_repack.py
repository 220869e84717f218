"""The per-expert integer repack (rewrites/moe/repack.py) against the whole-array numpy reference.

The reference unpacks the source's codes (onnx's own numpy helper), shifts them into QMoE's
unsigned space and packs them with ``contract.packing`` as the emission did before streaming;
the streamed arrays are read from an external data file and from an in-memory tensor, in both
stored layouts, for every bit width and sign, with odd sizes where the layout allows them.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import onnx
import onnx_ir as ir
from hypothesis import given, settings
from hypothesis import strategies as st

from onnx_moe_fuse.contract.packing import pack_qmoe
from onnx_moe_fuse.io.weight_sink import ScratchFileSink
from onnx_moe_fuse.rewrites.graph.weight_sink import in_memory, materialise
from onnx_moe_fuse.rewrites.moe import repack
from onnx_moe_fuse.rewrites.moe.repack import (
    Part,
    RepackedCodes,
    RepackedScales,
    row_order,
    source_of,
)

_TYPES = {
    (4, True): ir.DataType.INT4,
    (4, False): ir.DataType.UINT4,
    (8, True): ir.DataType.INT8,
    (8, False): ir.DataType.UINT8,
}


def _external(tmp_path, name: str, array: np.ndarray, dtype: ir.DataType) -> ir.ExternalTensor:
    """``array`` written as ONNX stores it (packed for 4 bits) into a data file; its tensor."""
    proto = onnx.numpy_helper.from_array(array, name) if dtype.bitwidth == 8 else None
    if proto is None:
        proto = onnx.helper.make_tensor(name, dtype.value, array.shape, array.reshape(-1).tolist())
    raw = ir.serde.deserialize_tensor(proto).tobytes()
    path = tmp_path / f"{name}.bin"
    path.write_bytes(b"\x07" * 13 + raw)  # an offset that is not aligned
    return ir.ExternalTensor(
        path.name,
        13,
        len(raw),
        dtype,
        shape=ir.Shape(array.shape),
        name=name,
        base_dir=str(tmp_path),
    )


def _columns(rng, kind: str, n: int, parts: int) -> np.ndarray:
    """The fused rows' sources: in order, shuffled, SwiGLU-interleaved, or a selection."""
    total = n * parts
    if kind == "shuffle":
        return rng.permutation(total)
    if kind == "interleave":  # row 2j from the first part, 2j + 1 from the second
        return np.arange(total).reshape(parts, n).T.reshape(-1)
    if kind == "select":
        return rng.integers(0, total, max(1, total - 1))
    return np.arange(total)


@settings(max_examples=40, deadline=None)
@given(
    bits=st.sampled_from([4, 8]),
    signed=st.booleans(),
    layout=st.sampled_from(["kn", "nk"]),
    e=st.integers(1, 3),
    half_k=st.sampled_from([1, 2, 3, 5, 12]),
    n=st.sampled_from([1, 2, 3, 5, 7, 16, 24, 40]),
    parts=st.integers(1, 2),
    kind=st.sampled_from(["order", "shuffle", "interleave", "select"]),
    tile=st.sampled_from([16, repack._TILE_BYTES]),
    seed=st.integers(0, 2**31 - 1),
)
def test_streamed_codes_equal_the_whole_array_pack(
    tmp_path_factory, bits, signed, layout, e, half_k, n, parts, kind, tile, seed
):
    """Every word width of the bit operations, tiles of 8 rows or one, rows in any order."""
    rng = np.random.default_rng(seed)
    k = 2 * half_k  # QMoE packs pairs along K
    lo, hi = (-(1 << (bits - 1)), 1 << (bits - 1)) if signed else (0, 1 << bits)
    dtype = _TYPES[(bits, signed)]
    stored_shape = (e, k, n) if layout == "kn" else (e, n, k)
    if layout == "kn" and bits == 4 and (k * n) % 2:
        n += 1  # an expert must start on a whole byte
        stored_shape = (e, k, n)
    tmp = tmp_path_factory.mktemp("repack")
    stored = [
        rng.integers(lo, hi, stored_shape).astype(np.int8 if signed else np.uint8)
        for _ in range(parts)
    ]
    kmajor = [s if layout == "kn" else s.transpose(0, 2, 1) for s in stored]
    codes = np.concatenate(kmajor, axis=2).astype(np.int16) + (1 << (bits - 1) if signed else 0)
    cols = _columns(rng, kind, n, parts)
    want = pack_qmoe(
        np.ascontiguousarray(codes[:, :, cols].transpose(0, 2, 1)).astype(np.uint8), bits
    )
    for external in (True, False):
        pieces = []
        for i, s in enumerate(stored):
            tensor = _external(tmp, f"q{i}", s, dtype)
            if not external:
                tensor = ir.Tensor(tensor.numpy(), dtype=dtype)
            src = source_of(tensor)
            assert src is not None and src.portable == external
            pieces.append(Part(src, layout, k, n))
        streamed = RepackedCodes(tuple(pieces), bits, signed, row_order(cols, n * parts))
        assert streamed.shape == want.shape and streamed.nbytes == want.nbytes
        with mock.patch.object(repack, "_TILE_BYTES", tile):
            np.testing.assert_array_equal(materialise(streamed), want)


@settings(max_examples=25, deadline=None)
@given(
    layout=st.sampled_from(["kn", "nk"]),
    per_channel=st.booleans(),
    dtype=st.sampled_from([np.float32, np.float16]),
    n=st.sampled_from([1, 5, 16]),
    parts=st.integers(1, 2),
    kind=st.sampled_from(["order", "shuffle", "interleave", "select"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_streamed_scales_equal_the_transposed_scales(
    tmp_path_factory, layout, per_channel, dtype, n, parts, kind, seed
):
    rng = np.random.default_rng(seed)
    e, blocks = 3, 1 if per_channel else 4
    tmp = tmp_path_factory.mktemp("scales")
    kmajor, pieces = [], []
    for i in range(parts):
        part = rng.standard_normal((e, blocks, n)).astype(dtype)
        stored = part if layout == "kn" else np.ascontiguousarray(part.transpose(0, 2, 1))
        path = tmp / f"s{i}.bin"
        path.write_bytes(stored.tobytes())
        tensor = ir.ExternalTensor(
            path.name, 0, stored.nbytes, ir.DataType.from_numpy(stored.dtype),
            shape=ir.Shape(stored.shape), name=f"s{i}", base_dir=str(tmp),
        )  # fmt: skip
        src = source_of(tensor)
        assert src is not None
        kmajor.append(part)
        pieces.append(Part(src, layout, blocks, n))
    cols = _columns(rng, kind, n, parts)
    streamed = RepackedScales(
        tuple(pieces), np.dtype(dtype), per_channel, row_order(cols, n * parts)
    )
    want = np.concatenate(kmajor, axis=2).transpose(0, 2, 1)[:, cols]
    want = want[:, :, 0] if per_channel else want
    np.testing.assert_array_equal(materialise(streamed), want)


def test_file_sink_workers_write_what_the_main_process_writes(tmp_path):
    """Deferred streamed arrays, written by two worker processes, read back as written at once."""
    rng = np.random.default_rng(7)
    q = rng.integers(-8, 8, (6, 8, 10)).astype(np.int8)
    tensor = _external(tmp_path, "q", q, ir.DataType.INT4)
    src = source_of(tensor)
    streamed = [RepackedCodes((Part(src, "kn", 8, 10),), 4, True, row_order(c, 10)) for c in
                (None, rng.permutation(10), rng.permutation(10))]  # fmt: skip
    want = [in_memory(s, f"w{i}").numpy() for i, s in enumerate(streamed)]
    small = rng.standard_normal((3, 4)).astype(np.float32)
    with ScratchFileSink(tmp_path, jobs=2, min_parallel_bytes=0) as sink:
        tensors = [sink(s, f"w{i}") for i, s in enumerate(streamed)]
        plain = sink(small, "small")
        sink.finish()
        for t, w in zip(tensors, want, strict=True):
            np.testing.assert_array_equal(t.numpy(), w)
            t.release()
        np.testing.assert_array_equal(plain.numpy(), small)
        plain.release()
    assert not sink.path.exists()
