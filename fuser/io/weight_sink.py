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

The scratch file is hidden (``.<prefix>-<random>.weights``), created with ``mkstemp`` (never an
existing file), and removed by :meth:`ScratchFileSink.close` (the sink is a context manager, so
an error on the way removes it too). The model must be saved before the sink is closed: its
spilled initializers read the scratch file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from types import TracebackType
from typing import BinaryIO

import numpy as np
import onnx_ir as ir

from onnx_moe_fuse.errors import OutputWriteError
from onnx_moe_fuse.io.output_paths import one_line, size_text
from onnx_moe_fuse.rewrites.graph.weight_sink import WeightSink, in_memory

__all__ = ["ScratchFileSink", "WeightSink", "in_memory"]

#: Tensor offsets in the scratch file are multiples of this (a memory map then reads aligned data).
ALIGNMENT = 64


def _reason(exc: OSError, file: BinaryIO) -> str:
    """Why a write to ``file`` failed, in words.

    numpy's ``tofile`` reports a short write without the errno: writing one more byte asks the
    file system again, and its refusal says why (no space left, file too large).
    """
    if exc.strerror:
        return exc.strerror
    try:
        file.write(b"\0")
        file.flush()
    except OSError as again:
        if again.strerror:
            return again.strerror
    return f"short write, the disk is full or a file size limit is reached ({one_line(exc)})"


class ScratchFileSink:
    """A weight sink that spills each array to one scratch data file in ``folder``.

    Use as a context manager (or call :meth:`close`): the file is removed on exit, whether the
    work succeeded or not.
    """

    def __init__(self, folder: str | os.PathLike[str], prefix: str = "onnx-moe-fuse") -> None:
        """Create the (empty) scratch file in ``folder``, which must exist and be writable."""
        self.folder = Path(folder).resolve()
        fd, path = tempfile.mkstemp(prefix=f".{prefix}-", suffix=".weights", dir=self.folder)
        self.path = Path(path)
        self._file = os.fdopen(fd, "wb")
        self.bytes_written = 0
        self.tensors_written = 0

    def __call__(self, array: np.ndarray, name: str) -> ir.TensorProtocol:
        """Append ``array``'s bytes (little-endian, C order) to the file; return the tensor."""
        if self._file is None:
            raise ValueError(f"the scratch weight file {self.path} is closed")
        tensor = ir.tensor(np.ascontiguousarray(array), name=name)
        offset = -(-self._file.tell() // ALIGNMENT) * ALIGNMENT
        try:
            self._file.seek(offset)
            tensor.tofile(self._file)
            self._file.flush()  # the tensor may be read back (mapped) before the sink is closed
        except OSError as exc:  # a full disk, a file size limit: the user's, not ours
            raise OutputWriteError(
                f"cannot write the scratch weight file {str(self.path)!r}: {_reason(exc, self._file)} "
                f"(tensor {name!r} needed {size_text(array.nbytes)} more, after "
                f"{size_text(self.bytes_written)} already there); nothing was written",
                path=self.path,
            ) from exc
        length = self._file.tell() - offset
        self.bytes_written += length
        self.tensors_written += 1
        return ir.ExternalTensor(
            self.path.name,
            offset,
            length,
            tensor.dtype,
            shape=tensor.shape,
            name=name,
            base_dir=str(self.folder),
        )

    def close(self) -> None:
        """Close and remove the scratch file (idempotent)."""
        if self._file is not None:
            with contextlib.suppress(OSError):  # a full disk may refuse the buffered rest
                self._file.close()
            self._file = None
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
