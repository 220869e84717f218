"""Weight sinks: where the fusion rules put the weights they repack (in memory, or on disk).

A rule that fuses a layer repacks its expert weights into new arrays and hands each to a
*weight sink* (the type: :class:`onnx_moe_fuse.rewrites.graph.weight_sink.WeightSink`), which returns
the tensor of the new initializer. Two sinks:

* :func:`in_memory` (the default, for API users and in-memory models): the array becomes an
  ``ir.Tensor``; every fused layer's repacked arrays stay in memory with the model;
* :class:`ScratchFileSink`: the array's bytes are appended to a scratch external-data file in
  the output's folder (flushed at once) and the initializer gets an ``ir.ExternalTensor`` that
  reads them back. The rule's array is dropped when the rewrite returns, so one layer's repacked
  arrays are alive at a time; saving (``ir.save`` with external data) copies the bytes from the
  scratch file into the output's data file without reading them into memory.

A streamed array (a QMoE layer's weights, made one expert at a time) is written piece by piece;
with ``jobs`` > 1 the portable ones (read from the input's data files) are written later, by
:meth:`ScratchFileSink.finish`, in worker processes, each layer's inputs in parallel.

The scratch file is hidden (``.<prefix>-<random>.weights``), created with ``mkstemp`` (never an
existing file), and removed by :meth:`ScratchFileSink.close` (the sink is a context manager, so
an error on the way removes it too). The model must be saved before the sink is closed: its
spilled initializers read the scratch file.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from types import TracebackType

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.errors import OutputWriteError
from onnx_moe_fuse.io.output_paths import one_line, size_text
from onnx_moe_fuse.io.processes import worker_context
from onnx_moe_fuse.rewrites.graph.weight_sink import StreamedArray, WeightSink, in_memory

__all__ = [
    "ScratchFileSink",
    "WeightSink",
    "default_jobs",
    "in_memory",
    "reuse_freed_memory",
    "write_deferred",
]

#: Tensor offsets in the scratch file are multiples of this (a memory map then reads aligned data).
ALIGNMENT = 64


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (``os.pwrite`` may write less than asked)."""
    while data:
        done = os.pwrite(fd, data, offset)
        if done <= 0:
            raise OSError(
                errno.ENOSPC, "short write, the disk is full or a file size limit is reached"
            )
        data, offset = data[done:], offset + done


def _write_pieces(fd: int, array: np.ndarray | StreamedArray, offset: int) -> int:
    """Write ``array`` (a streamed one piece by piece) at ``offset``; return its byte count."""
    pieces = [array] if isinstance(array, np.ndarray) else array.chunks()
    at = offset
    for piece in pieces:
        piece = np.ascontiguousarray(piece)
        if piece.dtype.byteorder == ">":
            piece = piece.astype(piece.dtype.newbyteorder("<"))
        _pwrite_all(fd, memoryview(piece.reshape(-1).view(np.uint8)), at)
        at += piece.nbytes
    return at - offset


def write_deferred(path: str, offset: int, array: StreamedArray) -> tuple[int, str] | None:
    """A worker's job: write the portable ``array`` into ``path`` at ``offset``.

    Returns None, or ``(errno, reason)`` of the OS error that stopped it (the parent raises the
    user's error: exceptions of the fuser's own types do not cross processes reliably).
    """
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            _write_pieces(fd, array, offset)
        finally:
            os.close(fd)
    except OSError as exc:
        return exc.errno or 0, exc.strerror or one_line(exc)
    return None


#: glibc's ``mallopt`` parameters (malloc.h) and what :func:`reuse_freed_memory` sets them to.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD = 32 << 20
_TRIM_THRESHOLD = 64 << 20


def reuse_freed_memory() -> None:
    """Have glibc's malloc keep freed blocks of up to 32 MiB for reuse (a no-op elsewhere).

    Why: repacking allocates and frees a few MiB per expert (the bytes read, the bit
    operations' words, the assembled rows). By default glibc maps blocks over its adaptive
    threshold afresh and trims the heap after frees, so each expert's buffers were page-faulted
    and zeroed again: 420 thousand page faults and half the wall time on 8 Qwen3-size layers
    (16-21 s -> 9-11 s with this, the peak unchanged). Blocks over 32 MiB are still mapped and
    returned at once, and at most 64 MiB of free heap is kept.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): its own allocator's policy
        return
    mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
    mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)


#: Below this many reserved bytes :meth:`ScratchFileSink.finish` writes in this process: starting
#: a worker costs about a second (its imports), more than repacking a small model takes.
PARALLEL_MIN_BYTES = 64 << 20


def default_jobs() -> int:
    """Worker processes for repacking by default: the CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


class ScratchFileSink:
    """A weight sink that spills each array to one scratch data file in ``folder``.

    Use as a context manager (or call :meth:`close`): the file is removed on exit, whether the
    work succeeded or not. An array is written at once; a streamed array
    (:class:`~onnx_moe_fuse.rewrites.graph.weight_sink.StreamedArray`) piece by piece (one
    expert at a time), or, when ``jobs`` > 1 and it is portable, its place in the file is
    reserved and it is written by :meth:`finish` in ``jobs`` worker processes, each holding one
    expert's bytes at a time. :meth:`finish` must run before the model is saved.
    """

    def __init__(
        self,
        folder: str | os.PathLike[str],
        prefix: str = "onnx-moe-fuse",
        jobs: int = 1,
        min_parallel_bytes: int = PARALLEL_MIN_BYTES,
    ) -> None:
        """Create the (empty) scratch file in ``folder``, which must exist and be writable."""
        self.folder = Path(folder).resolve()
        reuse_freed_memory()  # this process writes streamed arrays expert by expert too
        fd, path = tempfile.mkstemp(prefix=f".{prefix}-", suffix=".weights", dir=self.folder)
        self.path = Path(path)
        self._fd: int | None = fd
        self.jobs = max(1, int(jobs))
        self.min_parallel_bytes = int(min_parallel_bytes)
        self.bytes_written = 0
        self.tensors_written = 0
        self._end = 0
        self._pending: list[tuple[int, StreamedArray, str]] = []

    def __call__(self, array: np.ndarray | StreamedArray, name: str) -> ir.TensorProtocol:
        """Write (or reserve the place of) ``array``'s bytes, little-endian, C order; its tensor."""
        if self._fd is None:
            raise ValueError(f"the scratch weight file {self.path} is closed")
        if isinstance(array, np.ndarray):
            array = np.ascontiguousarray(array)
        dtype = ir.DataType.from_numpy(array.dtype)
        shape = tuple(int(d) for d in array.shape)
        offset = -(-self._end // ALIGNMENT) * ALIGNMENT
        length = int(np.prod(shape, dtype=np.int64)) * array.dtype.itemsize
        if not isinstance(array, np.ndarray) and array.portable and self.jobs > 1:
            self._pending.append((offset, array, name))
        else:
            try:
                _write_pieces(self._fd, array, offset)
            except OSError as exc:  # a full disk, a file size limit: the user's, not ours
                raise self._write_error(exc.strerror or one_line(exc), name, length) from exc
        self._end = offset + length
        self.bytes_written += length
        self.tensors_written += 1
        return ir.ExternalTensor(
            self.path.name,
            offset,
            length,
            dtype,
            shape=ir.Shape(shape),
            name=name,
            base_dir=str(self.folder),
        )

    def _write_error(self, reason: str, name: str, length: int) -> OutputWriteError:
        return OutputWriteError(
            f"cannot write the scratch weight file {str(self.path)!r}: {reason} "
            f"(tensor {name!r} needed {size_text(length)} more, of "
            f"{size_text(self._end)} in all); nothing was written",
            path=self.path,
        )

    def finish(self) -> None:
        """Write the reserved streamed arrays, in ``jobs`` worker processes; errors as the user's.

        Each job is one fused input (a layer's FC1 or FC2 weights or scales); the workers read
        the source's data file and write their own region of the scratch file.
        """
        pending, self._pending = self._pending, []
        if not pending:
            return
        if self._fd is None:
            raise ValueError(f"the scratch weight file {self.path} is closed")
        workers = min(self.jobs, len(pending))
        if sum(a.nbytes for _, a, _ in pending) < self.min_parallel_bytes:
            workers = 1
        if workers == 1:  # a small model: no process to start
            for offset, array, name in pending:
                try:
                    _write_pieces(self._fd, array, offset)
                except OSError as exc:
                    raise self._write_error(
                        exc.strerror or one_line(exc), name, array.nbytes
                    ) from exc
            return
        context = worker_context(__name__)
        with ProcessPoolExecutor(
            max_workers=workers, mp_context=context, initializer=reuse_freed_memory
        ) as pool:
            futures = [
                (pool.submit(write_deferred, str(self.path), offset, array), name, array.nbytes)
                for offset, array, name in pending
            ]
            for future, name, length in futures:
                failed = future.result()
                if failed is not None:
                    for other, _, _ in futures:
                        other.cancel()
                    raise self._write_error(failed[1], name, length) from OSError(*failed)

    def append_tensor(self, tensor: ir.TensorProtocol) -> tuple[int, int]:
        """Append ``tensor``'s bytes (an external one copied in the kernel); ``(offset, length)``.

        For :meth:`become`: the model's other tensors join the fused weights in this file.
        """
        if self._fd is None:
            raise ValueError(f"the scratch weight file {self.path} is closed")
        offset = -(-self._end // ALIGNMENT) * ALIGNMENT
        try:
            if isinstance(tensor, ir.ExternalTensor) and tensor.raw is None:
                length = int(tensor.length if tensor.length is not None else tensor.nbytes)
                with open(tensor.path, "rb") as src:
                    start, at, left = int(tensor.offset or 0), offset, length
                    while left:
                        done = os.copy_file_range(src.fileno(), self._fd, left, start, at)
                        if done <= 0:
                            raise OSError(errno.EIO, f"{tensor.path} ended early")
                        start, at, left = start + done, at + done, left - done
            else:
                data = tensor.tobytes()
                length = len(data)
                _pwrite_all(self._fd, memoryview(data), offset)
        except OSError as exc:
            raise self._write_error(
                exc.strerror or one_line(exc), tensor.name or "", tensor.nbytes
            ) from exc
        self._end = offset + length
        return offset, length

    def become(self, path: Path) -> None:
        """Move the scratch file to ``path`` (the output's data file in its temporary folder).

        From here on the file is the caller's: :meth:`close` no longer removes it.
        """
        if self._pending:
            raise ValueError("finish() must write the reserved arrays first")
        if self._fd is not None:
            os.fsync(self._fd)
            os.close(self._fd)
            self._fd = None
        os.replace(self.path, path)
        self.path = Path(path)
        self._kept = True

    def close(self) -> None:
        """Close and remove the scratch file (idempotent)."""
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
        self._pending = []
        if not getattr(self, "_kept", False):
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> ScratchFileSink:
        """The sink itself."""
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Remove the scratch file."""
        self.close()
