"""Quantised expert weights repacked one expert at a time, in the integer domain.

A QMoE node's weights are the source's codes in another layout: output-major ``[E, N, K /
pack]`` with the codes shifted into the unsigned space (``q + 8`` for int4, ``q + 128`` for
int8). That shift is a fixed bit flip of each code (``^ 0x8`` per nibble, ``^ 0x80`` per byte)
for signed codes, nothing for unsigned ones, so the repack is a move of bits: no code is ever
widened to a float, nor the whole layer's codes unpacked at once.

:class:`RepackedCodes` and :class:`RepackedScales` are streamed arrays
(:mod:`onnx_moe_fuse.rewrites.graph.weight_sink`): each yields the fused input expert by
expert, reading only that expert's bytes of each source tensor (:class:`Source`: a slice of an
external data file read with ``os.pread``, or the packed bytes of an in-memory tensor). A
layer whose sources are all files is *portable*: a file sink may run it in a worker process.

Per expert and projection part (FC1's gate and up are two parts of one fused input), with
``K`` the reduction axis and ``N`` the outputs, a K-major (``"kn"``) source ``[K, N]`` is
transposed, an output-major (``"nk"``) one ``[N, K]`` is already in place:

* 4-bit ``kn`` with even ``N``: each byte of rows ``2i`` and ``2i + 1`` is looked up in a
  256-entry table (:func:`_kn4_tables`) and the two ORed give the two output bytes of columns
  ``2j`` and ``2j + 1`` (``[K / 2, N]``), then one transpose; otherwise the codes are unpacked
  and packed again (still integers);
* FC1's parts are joined along ``N`` and its rows put in the fused order (``columns``);
* scales move as raw bytes (an integer view of their width): ``[blocks, N]`` transposed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

__all__ = [
    "Part",
    "RepackedCodes",
    "RepackedScales",
    "Source",
    "part_sizes",
    "row_order",
    "source_of",
]

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _kn4_tables(signed: bool) -> tuple[np.ndarray, np.ndarray]:
    """``(low, high)``: ``low[a] | high[c]`` is the output pair of bytes of a source pair.

    ``a`` holds codes ``(2i, 2j)`` (low nibble) and ``(2i, 2j + 1)``; ``c`` the same of row
    ``2i + 1``. The output byte of column ``n`` holds ``(2i, n)`` low and ``(2i + 1, n)`` high,
    so as one little-endian 16-bit value (column ``2j`` first): ``a``'s nibbles go to bits 0-3
    and 8-11, ``c``'s to bits 4-7 and 12-15. Signed codes get their shift (``^ 0x8``) in the
    tables, each on its own nibbles (the two tables' bits do not overlap).
    """
    byte = np.arange(256, dtype=np.uint16)
    low = (byte & 0xF) | ((byte >> 4) << 8)
    high = ((byte & 0xF) << 4) | ((byte & 0xF0) << 8)
    if signed:
        low, high = low ^ 0x0808, high ^ 0x8080
    return low.astype("<u2"), high.astype("<u2")


_KN4_TABLES = {signed: _kn4_tables(signed) for signed in (False, True)}


@dataclass(frozen=True, eq=False)
class Source:
    """One stacked source tensor ``[E, ...]``, read one expert's bytes at a time.

    ``path``/``offset``: an external data file and where the tensor starts (portable);
    otherwise ``data`` holds the tensor's packed bytes (an in-memory or computed tensor).
    ``expert_bytes`` is one expert's share (a whole number of bytes).
    """

    experts: int
    expert_bytes: int
    path: str | None = None
    offset: int = 0
    data: np.ndarray | None = field(default=None, repr=False)

    @property
    def portable(self) -> bool:
        """True when the bytes come from a file (a worker process can read them)."""
        return self.path is not None

    def expert(self, e: int, fd: int | None = None) -> np.ndarray:
        """Expert ``e``'s bytes (uint8)."""
        if self.data is not None:
            return self.data[e * self.expert_bytes : (e + 1) * self.expert_bytes]
        assert self.path is not None
        start = self.offset + e * self.expert_bytes
        if fd is not None:
            buf = os.pread(fd, self.expert_bytes, start)
        else:
            with open(self.path, "rb") as f:
                buf = os.pread(f.fileno(), self.expert_bytes, start)
        if len(buf) != self.expert_bytes:
            raise OSError(f"{self.path}: short read of expert {e} at byte {start}")
        return np.frombuffer(buf, np.uint8)


def source_of(tensor: ir.TensorProtocol) -> Source | None:
    """A :class:`Source` over ``tensor`` ``[E, ...]``; None when experts do not start on a byte.

    An external tensor is read from its file (nothing mapped); any other tensor's packed bytes
    are taken once (``tobytes``: what it holds, or what a computed tensor computes).
    """
    shape = tuple(int(d) for d in tensor.shape)
    if not shape or shape[0] == 0:
        return None
    per = int(np.prod(shape[1:], dtype=np.int64))
    bits = tensor.dtype.bitwidth
    if (per * bits) % 8:
        return None
    expert_bytes = per * bits // 8
    if isinstance(tensor, ir.ExternalTensor) and tensor.raw is None:
        return Source(shape[0], expert_bytes, path=tensor.path, offset=int(tensor.offset or 0))
    data = np.frombuffer(tensor.tobytes(), np.uint8)
    if data.size != expert_bytes * shape[0]:
        return None
    return Source(shape[0], expert_bytes, data=data)


def _unpack4(b: np.ndarray) -> np.ndarray:
    out = np.empty(b.size * 2, np.uint8)
    out[0::2] = b & 0xF
    out[1::2] = b >> 4
    return out


def _pack4(codes: np.ndarray) -> np.ndarray:
    """``[..., K]`` 4-bit codes (``K`` even) -> ``[..., K / 2]`` bytes, earliest code lowest."""
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def _output_major(
    b: np.ndarray, layout: str, k: int, n: int, bits: int, signed: bool
) -> np.ndarray:
    """One expert's stored codes -> ``[N, K / pack]`` QMoE bytes (unsigned codes)."""
    if bits == 8:
        w = b.reshape(k, n).T if layout == "kn" else b.reshape(n, k)
        return np.bitwise_xor(w, 0x80) if signed else np.ascontiguousarray(w)
    if layout == "nk":
        w = b.reshape(n, k // 2)
        return np.bitwise_xor(w, 0x88) if signed else w.copy()
    if n % 2 == 0:
        low, high = _KN4_TABLES[signed]
        pairs = b.reshape(k // 2, 2, n // 2)  # rows 2i and 2i + 1
        out = np.take(low, pairs[:, 0, :])
        out |= np.take(high, pairs[:, 1, :])
        return np.ascontiguousarray(out.view(np.uint8).T)  # [K / 2, N] -> [N, K / 2]
    codes = _unpack4(b).reshape(k, n).T  # a row of N codes crosses bytes: through the codes
    if signed:
        codes = codes ^ 0x8
    return _pack4(np.ascontiguousarray(codes))


@dataclass(frozen=True, eq=False)
class Part:
    """One projection's stored codes (or scales): its source, layout and sizes ``K``, ``N``."""

    source: Source
    layout: str
    k: int
    n: int


def _rows(pieces: list[np.ndarray], columns: np.ndarray | None) -> np.ndarray:
    joined = pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=0)
    return joined if columns is None else joined[columns]


def row_order(columns: Sequence[int] | np.ndarray | None, n: int) -> np.ndarray | None:
    """``columns`` as row indices, or None when they are all ``n`` rows in order."""
    if columns is None:
        return None
    cols = np.asarray(columns, np.int64)
    return None if len(cols) == n and np.array_equal(cols, np.arange(n)) else cols


@dataclass(frozen=True, eq=False)
class RepackedCodes:
    """A QMoE weight input ``[E, N, K / pack]`` uint8, made one expert at a time.

    ``parts`` (FC1: gate and up, or one; FC2: one) are joined along ``N`` and ``columns``
    (None: in order) picks the fused rows; ``signed`` sources get the code shift.
    """

    parts: tuple[Part, ...]
    bits: int
    signed: bool
    columns: np.ndarray | None = None
    dtype: np.dtype = field(default=np.dtype(np.uint8))

    @property
    def shape(self) -> tuple[int, int, int]:
        """``[E, N, K / pack]``."""
        n = sum(p.n for p in self.parts) if self.columns is None else len(self.columns)
        return (self.parts[0].source.experts, n, self.parts[0].k * self.bits // 8)

    @property
    def nbytes(self) -> int:
        """The whole input's bytes."""
        return int(np.prod(self.shape))

    @property
    def portable(self) -> bool:
        """True when every part is read from a file."""
        return all(p.source.portable for p in self.parts)

    def chunks(self) -> Iterator[np.ndarray]:
        """Expert by expert: ``[1, N, K / pack]``."""
        yield from _per_expert(self.parts, self._expert, self.shape[0])

    def _expert(self, e: int, fds: list[int | None]) -> np.ndarray:
        pieces = [
            _output_major(p.source.expert(e, fd), p.layout, p.k, p.n, self.bits, self.signed)
            for p, fd in zip(self.parts, fds, strict=True)
        ]
        return _rows(pieces, self.columns)[None]


@dataclass(frozen=True, eq=False)
class RepackedScales:
    """A QMoE scales input ``[E, N, blocks]`` (``[E, N]`` when ``per_channel``), per expert.

    The scales move as raw bytes of their width; ``dtype`` is the float type they are.
    """

    parts: tuple[Part, ...]  # k: the number of blocks
    dtype: np.dtype
    per_channel: bool
    columns: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        """``[E, N, blocks]`` or ``[E, N]``."""
        n = sum(p.n for p in self.parts) if self.columns is None else len(self.columns)
        e, blocks = self.parts[0].source.experts, self.parts[0].k
        return (e, n) if self.per_channel else (e, n, blocks)

    @property
    def nbytes(self) -> int:
        """The whole input's bytes."""
        return int(np.prod(self.shape)) * self.dtype.itemsize

    @property
    def portable(self) -> bool:
        """True when every part is read from a file."""
        return all(p.source.portable for p in self.parts)

    def chunks(self) -> Iterator[np.ndarray]:
        """Expert by expert: ``[1, N, blocks]`` (``[1, N]``)."""
        yield from _per_expert(self.parts, self._expert, self.shape[0])

    def _expert(self, e: int, fds: list[int | None]) -> np.ndarray:
        width = _UINT[self.dtype.itemsize]
        pieces = []
        for p, fd in zip(self.parts, fds, strict=True):
            raw = p.source.expert(e, fd).view(width)
            pieces.append(raw.reshape(p.k, p.n).T if p.layout == "kn" else raw.reshape(p.n, p.k))
        rows = np.ascontiguousarray(_rows(pieces, self.columns)).view(self.dtype)
        return (rows[:, 0] if self.per_channel else rows)[None]


def _per_expert(parts: Sequence[Part], make, experts: int) -> Iterator[np.ndarray]:
    """``make(e, fds)`` for every expert, each file source opened once for the whole run."""
    fds: list[int | None] = []
    try:
        for p in parts:
            fds.append(os.open(p.source.path, os.O_RDONLY) if p.source.path else None)
        for e in range(experts):
            yield make(e, fds)
    finally:
        for fd in fds:
            if fd is not None:
                os.close(fd)


def part_sizes(layout: str, stored: Sequence[int]) -> tuple[int, int]:
    """``(K, N)`` of a stored ``[E, K, N]`` (``"kn"``) or ``[E, N, K]`` (``"nk"``) tensor."""
    return (int(stored[1]), int(stored[2])) if layout == "kn" else (int(stored[2]), int(stored[1]))
