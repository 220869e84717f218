"""External data read the way ONNX Runtime reads it, checked before a byte is read.

ORT's rule (``ValidateExternalDataPath``, with the fix that lets it read the Hugging Face
cache, onnxruntime PR 27374): a tensor's
``location`` is relative to the folder of the model path *as given*; an absolute location is
refused; the resolved file (symlinks followed) must lie inside that folder, or inside the folder
of the model file's real path. So links inside the model's folder work, and so does the Hugging
Face cache, where ``snapshots/<rev>/model.onnx`` and ``model.onnx.data`` both link into
``../../blobs/``; ``../``, an absolute path or a link that leads elsewhere is refused. onnx's
own loader refuses every symlink, so it cannot read that cache: we read the bytes ourselves.

Offsets and lengths are checked against the file's size, and the byte count against the
tensor's shape and type, before anything is read: a truncated file or absurd dims cannot make
us read or allocate more than the file holds. Every refusal is an :class:`ExternalDataError`
naming the model, the tensor and the location.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import onnx

from onnx_moe_fuse.errors import ExternalDataError
from onnx_moe_fuse.io.model_check import all_tensors, is_external, location_of

__all__ = ["check_external", "load_external", "map_external", "resolve_external_file"]

_SUB_BYTE_BITS = {
    onnx.TensorProto.INT4: 4,
    onnx.TensorProto.UINT4: 4,
    onnx.TensorProto.FLOAT4E2M1: 4,
    getattr(onnx.TensorProto, "INT2", -2): 2,
    getattr(onnx.TensorProto, "UINT2", -3): 2,
}


def _expected_bytes(tensor: onnx.TensorProto) -> int | None:
    """How many bytes the tensor's data takes, from its dims and type (None: not fixed-size)."""
    count = math.prod(tensor.dims)
    bits = _SUB_BYTE_BITS.get(tensor.data_type)
    if bits is not None:
        return (count * bits + 7) // 8
    if tensor.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        return None
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, ValueError, TypeError):
        return None
    return count * itemsize


def _external_info(tensor: onnx.TensorProto, name: str) -> tuple[str, int, int | None]:
    info = {entry.key: entry.value for entry in tensor.external_data}
    location = info.get("location", "")
    try:
        offset = int(info.get("offset") or 0)
        length = None if info.get("length") in (None, "") else int(info["length"])
    except ValueError as exc:
        raise ExternalDataError(
            None,
            f"{name}: tensor {tensor.name!r} has a bad external data offset or length: {exc}",
            tensor=tensor.name,
            location=location,
        ) from exc
    if offset < 0 or (length is not None and length < 0):
        raise ExternalDataError(
            None,
            f"{name}: tensor {tensor.name!r} has a negative external data offset or length",
            tensor=tensor.name,
            location=location,
        )
    return location, offset, length


def resolve_external_file(
    tensor: onnx.TensorProto, base_dir: Path, model_path: Path | None, name: str
) -> Path:
    """The data file of an external ``tensor``, checked as ORT checks it (see module doc)."""

    def refuse(why: str) -> ExternalDataError:
        return ExternalDataError(
            base_dir / location if location else None,
            f"{name}: tensor {tensor.name!r} keeps its data in {location!r}, {why}",
            tensor=tensor.name,
            location=location,
        )

    location = location_of(tensor)
    if not location:
        raise refuse("which names no file")
    if Path(location).is_absolute() or location.startswith(("/", "\\")) or ":" in location[:3]:
        raise refuse("an absolute location; ONNX Runtime reads data only from the model's folder")
    candidate = base_dir / location
    try:
        real = candidate.resolve()
        allowed = [base_dir.resolve()]
        if model_path is not None:
            allowed.append(model_path.resolve().parent)
        inside = any(real.is_relative_to(folder) for folder in allowed)
        is_file = real.is_file()
    except (OSError, ValueError, RuntimeError) as exc:  # NUL bytes, link loops
        raise refuse(f"which cannot be resolved: {exc}") from exc
    if not inside:
        raise refuse(
            f"which resolves to {str(real)!r}, outside the model's folder "
            f"{str(base_dir)!r}; ONNX Runtime refuses it too"
        )
    if not is_file:
        raise refuse(f"which does not exist ({str(candidate)!r})")
    return candidate


def _span(
    tensor: onnx.TensorProto, base_dir: Path, model_path: Path | None, name: str
) -> tuple[Path, int, int]:
    """``(file, offset, byte count)`` of an external tensor, every bound checked, nothing read."""
    location, offset, length = _external_info(tensor, name)
    data_path = resolve_external_file(tensor, base_dir, model_path, name)
    expected = _expected_bytes(tensor)

    def refuse(why: str) -> ExternalDataError:
        return ExternalDataError(
            data_path,
            f"{name}: tensor {tensor.name!r} in {location!r}: {why}",
            tensor=tensor.name,
            location=location,
        )

    try:
        size = data_path.stat().st_size
    except OSError as exc:
        raise refuse(f"cannot be read: {exc.strerror or exc}") from exc
    available = size - offset
    want = length if length is not None else (expected if expected is not None else available)
    if offset > size or want > available:
        raise refuse(
            f"needs {want} bytes from offset {offset} but the file holds {size} bytes (truncated?)"
        )
    if expected is not None and want != expected:
        raise refuse(
            f"holds {want} bytes but its shape {list(tensor.dims)} and type need {expected}"
        )
    return data_path, offset, want


def _read(tensor: onnx.TensorProto, span: tuple[Path, int, int], name: str) -> bytes:
    data_path, offset, want = span
    try:
        with open(data_path, "rb") as handle:
            handle.seek(offset)
            data = handle.read(want)
    except OSError as exc:
        raise ExternalDataError(
            data_path,
            f"{name}: tensor {tensor.name!r}: cannot read {str(data_path)!r}: "
            f"{exc.strerror or exc}",
            tensor=tensor.name,
            location=location_of(tensor),
        ) from exc
    if len(data) != want:  # the file shrank since we checked it
        raise ExternalDataError(
            data_path,
            f"{name}: tensor {tensor.name!r}: {str(data_path)!r} ended after {len(data)} of "
            f"{want} bytes",
            tensor=tensor.name,
            location=location_of(tensor),
        )
    return data


def check_external(
    model: onnx.ModelProto, base_dir: Path, model_path: Path | None, name: str
) -> None:
    """Check every external tensor of ``model`` as :func:`load_external` would, reading nothing."""
    for tensor in all_tensors(model):
        if is_external(tensor):
            _span(tensor, base_dir, model_path, name)


def load_external(
    model: onnx.ModelProto, base_dir: Path, model_path: Path | None, name: str
) -> None:
    """Read every external tensor of ``model`` into memory, in place (all checked first).

    ``base_dir``: the folder of the model path as given; ``model_path``: that path (None for a
    model in memory: then only ``base_dir`` counts); ``name``: the model, for messages.
    """
    external = [t for t in all_tensors(model) if is_external(t)]
    spans = [_span(t, base_dir, model_path, name) for t in external]  # refuse before reading
    for tensor, span in zip(external, spans, strict=True):
        tensor.raw_data = _read(tensor, span, name)
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]


def map_external(
    tensor: onnx.TensorProto, base_dir: Path, model_path: Path | None, name: str
) -> np.memmap:
    """An external ``tensor``'s bytes as a read-only memory map, nothing read yet.

    Checked as :func:`load_external` checks them; pages are read as they are touched, only those.
    """
    data_path, offset, want = _span(tensor, base_dir, model_path, name)
    return np.memmap(data_path, dtype=np.uint8, mode="r", offset=offset, shape=(want,))
