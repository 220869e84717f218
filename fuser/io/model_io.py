"""Loading and saving models: validated input, external data read as ORT reads it, atomic output.

:func:`load_model` takes a path, an ``onnx.ModelProto`` or an ``onnx_ir.Model`` and returns a
ModelProto with every tensor's data in memory. A model file is validated before any data is
read (:func:`onnx_moe_fuse.io.model_check.validate_model`: opset imports, attribute sets of the
standard ops, the ONNX checker) and every error is one of :mod:`onnx_moe_fuse.errors`, naming
the file and, where it applies, the tensor and data location; never a bare protobuf error.

External data is resolved the way ONNX Runtime resolves it, relative to the model path as
given, symlinks allowed while they stay inside the model's folder (the Hugging Face cache
layout loads), and checked against the file and the tensor's shape before it is read
(:mod:`onnx_moe_fuse.io.external_data`).

:func:`save_model_atomic` writes a model so that readers only ever see the old file or the
complete new one:

* it refuses a destination that is the input model, a data file the input reads, or (for its
  data file ``out.onnx.data``) either of those (:func:`onnx_moe_fuse.io.output_paths.
  check_output_paths`: resolved paths, ``os.path.samefile`` for hard links);
* everything is first written into a fresh hidden folder inside the destination folder (same
  file system), fsynced, then moved into place with ``os.replace``: the data file first, the
  model file last; files get mode 0666 less the umask (0644 usually; onnx's writer would
  leave the data file 0600);
* external data: a model whose input used external data (``input_path``), or that is too large
  for one protobuf (2 GB), is saved with its tensors of 1 KiB or more in ``out.onnx.data``;
  ``external_data=True/False`` forces the choice;
* on any failure the temporary folder is removed, and a data file that was already moved into
  place is rolled back: no partial or temporary file is left behind. A failure of the file
  system (disk full, permission denied) raises :class:`OutputWriteError` naming the file.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import onnx
import onnx_ir
from google.protobuf.message import DecodeError

from onnx_moe_fuse.errors import (
    ExternalDataError,
    InputOverwriteError,
    ModelLoadError,
    ModelNotFoundError,
    ModelValidationError,
    MoEFuseError,
    OutputPathError,
    OutputWriteError,
)
from onnx_moe_fuse.io.external_data import check_external, load_external, resolve_external_file
from onnx_moe_fuse.io.model_check import all_tensors, is_external, validate_model
from onnx_moe_fuse.io.output_paths import (
    check_output_paths,
    fsync_folder,
    new_file_mode,
    one_line,
    size_text,
)

__all__ = [
    "ExternalDataError",
    "InputOverwriteError",
    "ModelLoadError",
    "ModelNotFoundError",
    "ModelValidationError",
    "OutputPathError",
    "OutputWriteError",
    "PROTOBUF_LIMIT",
    "check_model_file",
    "data_file_for",
    "exceeds_protobuf_limit",
    "external_data_files",
    "input_files",
    "load_model",
    "read_model_header",
    "save_model_atomic",
    "uses_external_data",
]

#: Protobuf's hard limit on one serialized message (2 GiB - 1).
PROTOBUF_LIMIT = 2**31 - 1
#: Tensors of at least this many bytes go to the external data file.
EXTERNAL_SIZE_THRESHOLD = 1024

ModelSource = onnx.ModelProto | onnx_ir.Model | str | os.PathLike[str]

# -- reading the model file -----------------------------------------------------------------------


def read_model_header(path: str | os.PathLike[str]) -> onnx.ModelProto:
    """The ModelProto of ``path`` without its external data, with errors naming the file."""
    path = Path(path)
    try:
        exists, is_dir, is_file = path.exists(), path.is_dir(), path.is_file()
    except (OSError, ValueError) as exc:  # a name with NUL bytes, a path too long
        raise ModelLoadError(path, f"{path!s}: cannot use this path: {exc}") from exc
    if not exists:
        raise ModelNotFoundError(path, f"model file not found: {path}")
    if is_dir:
        raise ModelLoadError(path, f"{path} is a folder, not an ONNX model file")
    if not is_file:
        raise ModelLoadError(path, f"{path} is not a regular file (a device or a pipe?)")
    try:
        model = onnx.load_model(str(path), load_external_data=False)
    except OSError as exc:
        raise ModelLoadError(path, f"cannot read {path}: {exc.strerror or exc}") from exc
    except (DecodeError, ValueError, RuntimeError, TypeError, OverflowError) as exc:
        raise ModelLoadError(
            path, f"{path} is not a valid ONNX model: {one_line(exc) or type(exc).__name__}"
        ) from exc
    if not model.HasField("graph") or model.ir_version <= 0:
        raise ModelLoadError(
            path, f"{path} is not a valid ONNX model: it holds no graph or no IR version"
        )
    return model


def _read_proto(path: Path) -> onnx.ModelProto:
    """The header of ``path``, validated (graph, opsets, attributes, checker)."""
    model = read_model_header(path)
    validate_model(model, str(path))
    return model


def check_model_file(path: str | os.PathLike[str]) -> onnx.ModelProto:
    """Validate the model file ``path`` and its external data without reading the data.

    Returns the header (external tensors not loaded). Raises as :func:`load_model` does.
    """
    path = Path(path)
    model = _read_proto(path)
    check_external(model, path.parent, path, str(path))
    return model


def external_data_files(path: str | os.PathLike[str]) -> list[Path]:
    """The data files the model file at ``path`` reads (resolved, deduplicated, existing)."""
    path = Path(path)
    model = read_model_header(path)
    found: set[Path] = set()
    for tensor in all_tensors(model):
        if is_external(tensor):
            with contextlib.suppress(ExternalDataError):
                found.add(resolve_external_file(tensor, path.parent, path, str(path)).resolve())
    return sorted(found)


def input_files(path: str | os.PathLike[str] | None) -> list[tuple[str, Path]]:
    """``(what, path)`` of the files a run reading ``path`` reads: the model and its data."""
    if path is None:
        return []
    found: list[tuple[str, Path]] = [("the input model", Path(path))]
    with contextlib.suppress(MoEFuseError):  # an unreadable input is refused where it is read
        found += [("external data of the input", p) for p in external_data_files(path)]
    return found


def uses_external_data(model: onnx.ModelProto | str | os.PathLike[str]) -> bool:
    """Whether a model (file, or a ModelProto not yet loaded) keeps tensor data externally."""
    if not isinstance(model, onnx.ModelProto):
        model = read_model_header(model)
    return any(is_external(t) for t in all_tensors(model))


# -- loading --------------------------------------------------------------------------------------


def _ir_to_proto(model: onnx_ir.Model) -> onnx.ModelProto:
    """Serialize an onnx_ir model, reading its external tensors into memory (model untouched)."""
    external: dict[tuple[str, str, str], onnx_ir.ExternalTensor] = {}
    for graph in model.graphs():
        values = [v.const_value for v in graph.initializers.values()]
        values += [
            a.value
            for node in graph
            for a in node.attributes.values()
            if isinstance(a.value, onnx_ir.ExternalTensor)
        ]
        for tensor in values:
            if isinstance(tensor, onnx_ir.ExternalTensor):
                key = (os.fspath(tensor.location), str(tensor.offset), str(tensor.length))
                external[key] = tensor
    proto = onnx_ir.to_proto(model)
    for tensor in all_tensors(proto):
        if not is_external(tensor):
            continue
        info = {e.key: e.value for e in tensor.external_data}
        key = (info.get("location", ""), info.get("offset", "None"), info.get("length", "None"))
        source = external.get(key)
        if source is None:
            raise ExternalDataError(
                None,
                f"onnx_ir model: tensor {tensor.name!r} refers to external data "
                f"{info.get('location')!r} that the model's tensors do not describe",
                tensor=tensor.name,
                location=info.get("location"),
            )
        try:
            tensor.raw_data = source.tobytes()
        except (OSError, ValueError) as exc:
            raise ExternalDataError(
                source.path,
                f"onnx_ir model: cannot read tensor {tensor.name!r} from {source.path!r}: {exc}",
                tensor=tensor.name,
                location=info.get("location"),
            ) from exc
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]
    return proto


def load_model(
    source: ModelSource, *, base_dir: str | os.PathLike[str] | None = None
) -> onnx.ModelProto:
    """Return ``source`` as an ``onnx.ModelProto`` with all tensor data in memory.

    Args:
        source: a path to an ``.onnx`` file (validated; external data read from its folder as
            ORT reads it), an ``onnx.ModelProto`` (returned as it is when it holds no external
            references; else a copy with the data read from ``base_dir``), or an
            ``onnx_ir.Model`` (serialized; its external tensors are read, the IR model is left
            as it was).
        base_dir: where a ModelProto's external data files are.

    Raises:
        ModelNotFoundError: the model file does not exist (a ``FileNotFoundError``).
        ModelLoadError: the file is not an ONNX model.
        ModelValidationError: the model is not valid (opsets, attributes, checker).
        ExternalDataError: external data is missing, short or outside the model's folder.
    """
    if isinstance(source, onnx_ir.Model):
        return _ir_to_proto(source)
    if isinstance(source, onnx.ModelProto):
        if not any(is_external(t) for t in all_tensors(source)):
            return source
        if base_dir is None:
            raise ExternalDataError(
                None,
                "the model keeps tensor data in external files; pass base_dir (the folder of "
                "its data files) or load it from its path",
            )
        copy = onnx.ModelProto()
        copy.CopyFrom(source)
        load_external(copy, Path(base_dir), None, "model")
        return copy
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"load_model takes a path, onnx.ModelProto or onnx_ir.Model, not {type(source)}"
        )
    path = Path(source)
    model = _read_proto(path)
    load_external(model, path.parent, path, str(path))
    return model


# -- saving ---------------------------------------------------------------------------------------


def data_file_for(out_path: str | os.PathLike[str]) -> Path:
    """The external data file that :func:`save_model_atomic` writes next to ``out_path``.

    Raises:
        OutputPathError: ``out_path`` names no file (``/``, ``..``, an empty name).
    """
    out = Path(out_path)
    if not out.name or out.name in (".", ".."):
        raise OutputPathError(
            f"{str(out_path)!r} names a folder, not a model file; give a file name such as "
            "fused.onnx",
            path=out,
        )
    return out.with_name(out.name + ".data")


def exceeds_protobuf_limit(model: onnx.ModelProto) -> bool:
    """Whether ``model`` is too large to serialize as one protobuf message (2 GB)."""
    try:
        return model.ByteSize() > PROTOBUF_LIMIT
    except (ValueError, OverflowError):
        return True


def _write_files(
    model: onnx.ModelProto, tmp: Path, name: str, data_name: str, external: bool
) -> list[str]:
    """Write ``name`` (and ``data_name`` when external) into the folder ``tmp``; return names."""
    target = tmp / name
    if not external:
        if exceeds_protobuf_limit(model):
            raise ValueError(
                f"the model is larger than protobuf's 2 GB limit: save {name} with external data"
            )
        onnx.save_model(model, str(target))
        return [name]
    work = onnx.ModelProto()
    work.CopyFrom(model)  # onnx's writer rewrites the tensors it moves out
    onnx.save_model(
        work,
        str(target),
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location=data_name,
        size_threshold=EXTERNAL_SIZE_THRESHOLD,
        convert_attribute=True,
    )
    return [data_name, name] if (tmp / data_name).exists() else [name]


def fsync_path(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def move_into_place(tmp: Path, folder: Path, names: list[str], model_name: str) -> None:
    moved: list[tuple[Path, Path | None]] = []  # (final path, backup of what it replaced)
    try:
        for name in names:
            final = folder / name
            backup = None
            if name != model_name and final.is_file():  # keep the old data file until done
                backup = tmp / f"previous-{name}"
                try:
                    os.link(final, backup)
                except OSError:
                    shutil.copy2(final, backup)
            os.replace(tmp / name, final)
            moved.append((final, backup))
        fsync_folder(folder)
    except BaseException:
        for final, backup in reversed(moved):
            if final == folder / model_name:
                continue  # the model file went last: when it moved, nothing failed after it
            with contextlib.suppress(OSError):
                if backup is not None:
                    os.replace(backup, final)
                else:
                    final.unlink()
        raise


def save_model_atomic(
    model: onnx.ModelProto | onnx_ir.Model,
    out_path: str | os.PathLike[str],
    *,
    input_path: str | os.PathLike[str] | None = None,
    external_data: bool | None = None,
) -> list[Path]:
    """Write ``model`` to ``out_path`` atomically; return the files written (data file first).

    Args:
        model: the model (its tensor data must be in memory, or readable next to
            ``input_path``).
        out_path: the model file to write. Its folder must exist and be writable.
        input_path: the file the model was loaded from: never overwritten (nor its external
            data files), and its use of external data decides ``external_data`` when None.
        external_data: True writes tensors of 1 KiB or more to ``<out name>.data`` next to
            the output; False writes one file; None: True when the input used external data or
            the model exceeds 2 GB.

    Raises:
        InputOverwriteError: ``out_path`` or its data file is the input or the input's data.
        OutputPathError: the destination folder is missing or read-only, or ``out_path`` is a
            folder or not a regular file.
        OutputWriteError: writing failed (disk full, permission denied); nothing was left.
        ValueError: a model over 2 GB with ``external_data=False``.
    """
    out = Path(out_path)
    data = data_file_for(out)
    src = None if input_path is None else Path(input_path)
    check_output_paths({"the output model": out, "its data file": data}, protected=input_files(src))
    folder = out.parent if str(out.parent) else Path(".")

    proto = load_model(model) if isinstance(model, onnx_ir.Model) else model
    if any(is_external(t) for t in all_tensors(proto)):
        if src is None:
            raise ExternalDataError(
                None, "the model refers to external data that is not loaded; pass input_path"
            )
        proto = load_model(proto, base_dir=src.parent)
    if external_data is None:
        external_data = (src is not None and src.is_file() and uses_external_data(src)) or (
            exceeds_protobuf_limit(proto)
        )

    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=folder))
    except OSError as exc:
        raise OutputWriteError(
            f"cannot write into {str(folder)!r}: {exc.strerror or exc}", path=out
        ) from exc
    try:
        names = _write_files(proto, tmp, out.name, data.name, external_data)
        mode = new_file_mode()  # onnx creates its data file 0600
        for name in names:
            os.chmod(tmp / name, mode)
            fsync_path(tmp / name)
        move_into_place(tmp, folder, names, out.name)
    except OSError as exc:
        needed = ""
        with contextlib.suppress(ValueError, OverflowError):
            needed = f" (the model needs about {size_text(proto.ByteSize())})"
        raise OutputWriteError(
            f"cannot write {str(out)!r}: {exc.strerror or one_line(exc)}{needed}; "
            "nothing was written",
            path=out,
        ) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [folder / name for name in names]
