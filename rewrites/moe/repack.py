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

* 4-bit ``kn`` with even ``N``: rows ``2i`` and ``2i + 1`` give the bytes of rows ``2i`` and
  ``2i + 1`` of output columns ``2j`` and ``2j + 1`` by four bit operations on machine words
  (:func:`_kn4_into`), then a transpose a cache-sized tile at a time (:func:`_transpose_into`);
  an odd ``N`` goes through the unpacked codes (still integers);
* FC1's parts are joined along ``N`` and its rows put in the fused order (``columns``): a
  part whose rows land at a stride (SwiGLU's interleaved gate and up) is written straight into
  them, so an expert is assembled in one buffer; the signed shift is one XOR over it;
* scales move as raw bytes (an integer view of their width): ``[blocks, N]`` transposed.

Measured on a Qwen3-30B-A3B-size int4 expert (2048 x 768, gate + up + down): 3-4x less CPU
than the earlier lookup table and row gathers (``benchmarks/bench_scale.py`` has the layer
figures).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

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


#: Bytes of a source tile in :func:`_transpose_into`: a tile and its transpose stay in cache.
_TILE_BYTES = 32 << 10


def _transpose_into(src: np.ndarray, dest: np.ndarray) -> None:
    """``dest[...] = src.T`` for a 2-D ``src``, a tile of rows at a time.

    numpy's transposed copy walks the destination column by column through the whole array;
    a tile of ~32 KiB of rows at a time keeps both sides in cache (4x faster on a Qwen3-size
    expert). ``dest`` may be any view with ``src``'s shape reversed (rows at a stride).
    """
    rows, cols = src.shape
    step = max(8, _TILE_BYTES // max(1, cols * src.itemsize))
    for i in range(0, rows, step):
        dest[:, i : i + step] = src[i : i + step].T


def _word(nbytes: int) -> type[np.unsignedinteger]:
    """The widest unsigned type whose size divides ``nbytes`` (the bit ops' word)."""
    return next(
        w for w in (np.uint64, np.uint32, np.uint16, np.uint8) if nbytes % w().itemsize == 0
    )


def _each_byte(word: type[np.unsignedinteger], byte: int) -> np.unsignedinteger:
    """``byte`` repeated in every byte of ``word``."""
    return word(int.from_bytes(bytes([byte]) * word().itemsize, "little"))


def _kn4_into(b: np.ndarray, k: int, n: int, dest: np.ndarray) -> None:
    """One expert's K-major 4-bit codes ``[K, N / 2]`` bytes -> ``dest [N, K / 2]`` (``N`` even).

    Source rows ``2i`` (bytes ``a``) and ``2i + 1`` (``c``) hold codes of columns ``2j`` (low
    nibble) and ``2j + 1``; output row ``n`` holds ``(2i, n)`` low and ``(2i + 1, n)`` high. So
    column ``2j``'s byte is ``(a & 0xF) | (c & 0xF) << 4`` and column ``2j + 1``'s is
    ``a >> 4 | (c & 0xF0)``: four bit operations on whole machine words (each byte's nibbles
    stay in that byte whatever the byte order), then each of the two byte matrices
    ``[K / 2, N / 2]`` transposed into the even and the odd output rows.
    """
    half = n // 2
    word = _word(half)
    w = b.view(word).reshape(k // 2, 2, half // word().itemsize)
    a, c = w[:, 0, :], w[:, 1, :]
    low, high, four = _each_byte(word, 0x0F), _each_byte(word, 0xF0), word(4)
    even = a & low
    even |= (c & low) << four
    odd = (a >> four) & low
    odd |= c & high
    _transpose_into(even.view(np.uint8).reshape(k // 2, half), dest[0::2])
    _transpose_into(odd.view(np.uint8).reshape(k // 2, half), dest[1::2])


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

    def prefetch(self, e: int, fd: int | None) -> None:
        """Ask the kernel to start reading expert ``e``'s bytes now (read while we compute)."""
        if fd is not None and e < self.experts and hasattr(os, "posix_fadvise"):
            start = self.offset + e * self.expert_bytes
            os.posix_fadvise(fd, start, self.expert_bytes, os.POSIX_FADV_WILLNEED)

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


def _codes_into(b: np.ndarray, layout: str, k: int, n: int, bits: int, dest: np.ndarray) -> None:
    """One expert's stored codes -> ``dest [N, K / pack]``, as stored (the sign shift later)."""
    if bits == 8:
        if layout == "kn":
            _transpose_into(b.reshape(k, n), dest)
        else:
            dest[...] = b.reshape(n, k)
    elif layout == "nk":
        dest[...] = b.reshape(n, k // 2)
    elif n % 2 == 0:
        _kn4_into(b, k, n, dest)
    else:  # a row of N codes crosses bytes: through the codes
        dest[...] = _pack4(np.ascontiguousarray(_unpack4(b).reshape(k, n).T))


def _flip_sign(rows: np.ndarray, bits: int) -> None:
    """Signed codes -> QMoE's unsigned ones in place: ``q + 8`` is ``q ^ 8`` per nibble."""
    flat = rows.reshape(-1)
    word = _word(flat.size)
    flat.view(word)[...] ^= _each_byte(word, 0x88 if bits == 4 else 0x80)


def _placements(
    sizes: Sequence[int], columns: np.ndarray | None
) -> list[slice | np.ndarray] | None:
    """Where each part's rows go in the fused rows: a slice (in order, at a stride) or indices.

    The parts' rows joined in order are the rows ``columns`` picks from (None: all, in order).
    None when ``columns`` is not an arrangement of all of them (a selection: through a copy).
    """
    starts = np.cumsum([0, *sizes[:-1]])
    if columns is None:
        return [slice(int(s), int(s) + n) for s, n in zip(starts, sizes, strict=True)]
    total = sum(sizes)
    if len(columns) != total or not np.array_equal(np.sort(columns), np.arange(total)):
        return None
    where = np.empty(total, np.int64)
    where[columns] = np.arange(total)  # the fused row of each joined row
    out: list[slice | np.ndarray] = []
    for s, n in zip(starts, sizes, strict=True):
        rows = where[s : s + n]
        step = int(rows[1] - rows[0]) if n > 1 else 1
        if step > 0 and np.array_equal(rows, rows[0] + step * np.arange(n)):
            out.append(slice(int(rows[0]), int(rows[0]) + step * (n - 1) + 1, step))
        else:
            out.append(rows)
    return out


def _assemble(
    parts: Sequence[Part],
    places: list[slice | np.ndarray] | None,
    columns: np.ndarray | None,
    width: int,
    dtype: np.dtype,
    fill,
) -> np.ndarray:
    """One expert's fused rows ``[rows, width]``: ``fill(i, dest)`` writes part ``i``'s rows.

    A part whose rows land at a stride (SwiGLU's interleaved gate and up) is written straight
    into its rows of the result; others through a copy of their own.
    """
    sizes = [p.n for p in parts]
    if places is None:  # a selection of rows
        joined = np.empty((sum(sizes), width), dtype)
        for i, where in enumerate(_placements(sizes, None)):
            fill(i, joined[where])
        return joined[columns]
    out = np.empty((sum(sizes), width), dtype)
    for i, where in enumerate(places):
        if isinstance(where, slice):
            fill(i, out[where])
        else:
            rows = np.empty((sizes[i], width), dtype)
            fill(i, rows)
            out[where] = rows
    return out


@dataclass(frozen=True, eq=False)
class Part:
    """One projection's stored codes (or scales): its source, layout and sizes ``K``, ``N``."""

    source: Source
    layout: str
    k: int
    n: int


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
        places = _placements([p.n for p in self.parts], self.columns)
        yield from _per_expert(self.parts, partial(self._expert, places), self.shape[0])

    def _expert(self, places, e: int, fds: list[int | None]) -> np.ndarray:
        def fill(i: int, dest: np.ndarray) -> None:
            p = self.parts[i]
            _codes_into(p.source.expert(e, fds[i]), p.layout, p.k, p.n, self.bits, dest)

        width = self.shape[2]
        rows = _assemble(self.parts, places, self.columns, width, np.dtype(np.uint8), fill)
        if self.signed:
            _flip_sign(rows, self.bits)
        return rows[None]


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
        places = _placements([p.n for p in self.parts], self.columns)
        yield from _per_expert(self.parts, partial(self._expert, places), self.shape[0])

    def _expert(self, places, e: int, fds: list[int | None]) -> np.ndarray:
        width = np.dtype(_UINT[self.dtype.itemsize])

        def fill(i: int, dest: np.ndarray) -> None:
            p = self.parts[i]
            raw = p.source.expert(e, fds[i]).view(width)
            if p.layout == "kn":
                _transpose_into(raw.reshape(p.k, p.n), dest)
            else:
                dest[...] = raw.reshape(p.n, p.k)

        blocks = self.parts[0].k
        rows = _assemble(self.parts, places, self.columns, blocks, width, fill).view(self.dtype)
        return (rows[:, 0] if self.per_channel else rows)[None]


def _per_expert(parts: Sequence[Part], make, experts: int) -> Iterator[np.ndarray]:
    """``make(e, fds)`` for every expert, each file source opened once for the whole run."""
    fds: list[int | None] = []
    try:
        for p in parts:
            fds.append(os.open(p.source.path, os.O_RDONLY) if p.source.path else None)
        for e in range(experts):
            # the next expert's reads run in the kernel while this one is repacked and
            # written (cold files: 4.1 s of 8 layers' reads waited for, without)
            for p, fd in zip(parts, fds, strict=True):
                p.source.prefetch(e + 1, fd)
            yield make(e, fds)
    finally:
        for fd in fds:
            if fd is not None:
                os.close(fd)


def part_sizes(layout: str, stored: Sequence[int]) -> tuple[int, int]:
    """``(K, N)`` of a stored ``[E, K, N]`` (``"kn"``) or ``[E, N, K]`` (``"nk"``) tensor."""
    return (int(stored[1]), int(stored[2])) if layout == "kn" else (int(stored[2]), int(stored[1]))
