"""Loading and saving models: external data, clear errors, atomic writes that never clobber input.

:func:`load_model` takes a path, an ``onnx.ModelProto`` or an ``onnx_ir.Model`` and returns a
ModelProto with every tensor's data in memory (external data read from the files next to the
model). A missing file raises ``FileNotFoundError``; a file that is not an ONNX model, or whose
external data is missing or short, raises :class:`ModelLoadError`; both name the file.

:func:`save_model_atomic` writes a model so that readers only ever see the old file or the
complete new one:

* it refuses to write over the input model, or over an external data file the input reads
  (compared by resolved path and by ``os.path.samefile``, so links and other spellings of the
  same file are caught): :class:`InputOverwriteError`;
* everything is first written into a hidden temporary folder inside the destination folder
  (same file system), flushed and fsynced, then moved into place with ``os.replace``: the data
  file first, the model file last;
* external data: a model whose input used external data (``input_path``), or that is too large
  for one protobuf (2 GB), is saved with its tensors of 1 KiB or more in one data file named
  after the output (``out.onnx`` -> ``out.onnx.data``), next to it; ``external_data=True/False``
  forces the choice;
* on any failure the temporary folder is removed, and a data file that was already moved into
  place is rolled back (the previous one restored, or the new one removed): no partial or
  temporary files are left behind.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import onnx
import onnx.external_data_helper as edh
import onnx_ir
from google.protobuf.message import DecodeError

__all__ = [
    "InputOverwriteError",
    "ModelLoadError",
    "PROTOBUF_LIMIT",
    "data_file_for",
    "exceeds_protobuf_limit",
    "external_data_files",
    "load_model",
    "save_model_atomic",
    "uses_external_data",
]

#: Protobuf's hard limit on one serialized message (2 GiB - 1).
PROTOBUF_LIMIT = 2**31 - 1
#: Tensors of at least this many bytes go to the external data file.
EXTERNAL_SIZE_THRESHOLD = 1024

ModelSource = onnx.ModelProto | onnx_ir.Model | str | os.PathLike[str]


class ModelLoadError(ValueError):
    """A model file (or its external data) cannot be read as an ONNX model."""

    def __init__(self, path: str | os.PathLike[str] | None, message: str) -> None:
        """``path``: the file at fault (None for an in-memory model)."""
        self.path = None if path is None else os.fspath(path)
        super().__init__(message)


class InputOverwriteError(ValueError):
    """Saving would overwrite the input model or a data file the input model reads."""


# -- tensors --------------------------------------------------------------------------------------


def _graph_tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    for node in graph.node:
        yield from _node_tensors(node)


def _node_tensors(node: onnx.NodeProto) -> Iterator[onnx.TensorProto]:
    for attr in node.attribute:
        if attr.HasField("t"):
            yield attr.t
        yield from attr.tensors
        if attr.HasField("g"):
            yield from _graph_tensors(attr.g)
        for g in attr.graphs:
            yield from _graph_tensors(g)


def _all_tensors(model: onnx.ModelProto) -> Iterator[onnx.TensorProto]:
    """Every TensorProto of the model: initializers, attributes, subgraphs, functions."""
    yield from _graph_tensors(model.graph)
    for function in model.functions:
        for node in function.node:
            yield from _node_tensors(node)


def _is_external(tensor: onnx.TensorProto) -> bool:
    return tensor.data_location == onnx.TensorProto.EXTERNAL


def _location(tensor: onnx.TensorProto) -> str:
    for entry in tensor.external_data:
        if entry.key == "location":
            return entry.value
    return ""


def external_data_files(path: str | os.PathLike[str]) -> list[Path]:
    """The external data files the model file at ``path`` refers to (resolved, deduplicated)."""
    model = _read_proto(Path(path))
    base = Path(path).resolve().parent
    found = {(base / _location(t)).resolve() for t in _all_tensors(model) if _is_external(t)}
    return sorted(found)


def uses_external_data(model: onnx.ModelProto | str | os.PathLike[str]) -> bool:
    """Whether a model (file, or a ModelProto not yet loaded) keeps tensor data externally."""
    if not isinstance(model, onnx.ModelProto):
        model = _read_proto(Path(model))
    return any(_is_external(t) for t in _all_tensors(model))


# -- loading --------------------------------------------------------------------------------------


def _read_proto(path: Path) -> onnx.ModelProto:
    """The ModelProto of ``path`` without its external data, with errors naming the file."""
    if not path.exists():
        raise FileNotFoundError(errno.ENOENT, f"model file not found: {path}", str(path))
    if path.is_dir():
        raise ModelLoadError(path, f"{path} is a folder, not an ONNX model file")
    try:
        model = onnx.load_model(str(path), load_external_data=False)
    except (DecodeError, ValueError, RuntimeError, TypeError) as exc:
        raise ModelLoadError(path, f"{path} is not a valid ONNX model: {exc}") from exc
    if not model.HasField("graph") or model.ir_version <= 0:
        raise ModelLoadError(
            path, f"{path} is not a valid ONNX model: it holds no graph or no IR version"
        )
    return model


def _load_external(model: onnx.ModelProto, base_dir: Path, model_name: str) -> None:
    """Read every external tensor of ``model`` from files relative to ``base_dir``, in place."""
    for tensor in _all_tensors(model):
        if not _is_external(tensor):
            continue
        location = _location(tensor)
        data_path = base_dir / location
        if not location or not data_path.is_file():
            raise ModelLoadError(
                data_path,
                f"{model_name}: tensor {tensor.name!r} keeps its data in {str(data_path)!r}, "
                "which does not exist",
            )
        try:
            edh.load_external_data_for_tensor(tensor, str(base_dir))
        except (OSError, ValueError) as exc:
            raise ModelLoadError(
                data_path,
                f"{model_name}: cannot read tensor {tensor.name!r} from {str(data_path)!r}: {exc}",
            ) from exc


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
    for tensor in _all_tensors(proto):
        if not _is_external(tensor):
            continue
        info = {e.key: e.value for e in tensor.external_data}
        key = (info.get("location", ""), info.get("offset", "None"), info.get("length", "None"))
        source = external.get(key)
        if source is None:
            raise ModelLoadError(
                None,
                f"onnx_ir model: tensor {tensor.name!r} refers to external data "
                f"{info.get('location')!r} that the model's tensors do not describe",
            )
        try:
            tensor.raw_data = source.tobytes()
        except OSError as exc:
            raise ModelLoadError(
                source.path,
                f"onnx_ir model: cannot read tensor {tensor.name!r} from {source.path!r}: {exc}",
            ) from exc
        tensor.data_location = onnx.TensorProto.DEFAULT
        del tensor.external_data[:]
    return proto


def load_model(
    source: ModelSource, *, base_dir: str | os.PathLike[str] | None = None
) -> onnx.ModelProto:
    """Return ``source`` as an ``onnx.ModelProto`` with all tensor data in memory.

    Args:
        source: a path to an ``.onnx`` file (external data read from next to it), an
            ``onnx.ModelProto`` (returned as it is when it holds no external references; else
            a copy with the data read from ``base_dir``), or an ``onnx_ir.Model`` (serialized;
            its external tensors are read, the IR model is left as it was).
        base_dir: where a ModelProto's external data files are.

    Raises:
        FileNotFoundError: the model file does not exist.
        ModelLoadError: the file is not an ONNX model, or external data is missing or short.
    """
    if isinstance(source, onnx_ir.Model):
        return _ir_to_proto(source)
    if isinstance(source, onnx.ModelProto):
        if not any(_is_external(t) for t in _all_tensors(source)):
            return source
        if base_dir is None:
            raise ModelLoadError(
                None,
                "the model keeps tensor data in external files; pass base_dir (the folder of "
                "its data files) or load it from its path",
            )
        copy = onnx.ModelProto()
        copy.CopyFrom(source)
        _load_external(copy, Path(base_dir), "model")
        return copy
    if not isinstance(source, (str, os.PathLike)):
        raise TypeError(
            f"load_model takes a path, onnx.ModelProto or onnx_ir.Model, not {type(source)}"
        )
    path = Path(source)
    model = _read_proto(path)
    _load_external(model, path.resolve().parent, str(path))
    return model


# -- saving ---------------------------------------------------------------------------------------


def data_file_for(out_path: str | os.PathLike[str]) -> Path:
    """The external data file that :func:`save_model_atomic` writes next to ``out_path``."""
    out = Path(out_path)
    return out.with_name(out.name + ".data")


def _same_file(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def _check_not_input(targets: list[Path], input_path: Path | None) -> None:
    if input_path is None:
        return
    protected = [input_path]
    if input_path.is_file():
        with contextlib.suppress(ModelLoadError, OSError):
            protected += external_data_files(input_path)
    for target in targets:
        for keep in protected:
            if _same_file(target, keep):
                what = "the input model" if keep is input_path else "external data of the input"
                raise InputOverwriteError(
                    f"refusing to write {str(target)!r}: it is {what} ({str(keep)!r}); "
                    "choose another output path"
                )


def exceeds_protobuf_limit(model: onnx.ModelProto) -> bool:
    """Whether ``model`` is too large to serialize as one protobuf message (2 GB)."""
    try:
        return model.ByteSize() > PROTOBUF_LIMIT
    except (ValueError, OverflowError):
        return True


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):  # not every platform/file system opens folders
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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
        out_path: the model file to write. Its folder must exist.
        input_path: the file the model was loaded from: never overwritten (nor its external
            data files), and its use of external data decides ``external_data`` when None.
        external_data: True writes tensors of 1 KiB or more to ``<out name>.data`` next to
            the output; False writes one file; None: True when the input used external data or
            the model exceeds 2 GB.

    Raises:
        InputOverwriteError: ``out_path`` or its data file is the input or the input's data.
        FileNotFoundError: the destination folder does not exist.
        ValueError: a model over 2 GB with ``external_data=False``.
    """
    out = Path(out_path)
    data = data_file_for(out)
    src = None if input_path is None else Path(input_path)
    _check_not_input([out], src)
    folder = out.parent if str(out.parent) else Path(".")
    if not folder.is_dir():
        raise FileNotFoundError(
            errno.ENOENT, f"output folder does not exist: {folder}", str(folder)
        )
    if out.is_dir():
        raise IsADirectoryError(errno.EISDIR, f"output path is a folder: {out}", str(out))

    proto = load_model(model) if isinstance(model, onnx_ir.Model) else model
    if any(_is_external(t) for t in _all_tensors(proto)):
        if src is None:
            raise ModelLoadError(
                None, "the model refers to external data that is not loaded; pass input_path"
            )
        proto = load_model(proto, base_dir=src.resolve().parent)
    if external_data is None:
        external_data = (src is not None and src.is_file() and uses_external_data(src)) or (
            exceeds_protobuf_limit(proto)
        )
    if external_data:
        _check_not_input([data], src)

    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=folder))
    moved: list[tuple[Path, Path | None]] = []  # (final path, backup of what it replaced)
    try:
        names = _write_files(proto, tmp, out.name, data.name, external_data)
        for name in names:
            _fsync(tmp / name)
        for name in names:
            final = folder / name
            backup = None
            if name != out.name and final.is_file():  # keep the old data file until done
                backup = tmp / f"previous-{name}"
                try:
                    os.link(final, backup)
                except OSError:
                    shutil.copy2(final, backup)
            os.replace(tmp / name, final)
            moved.append((final, backup))
        _fsync_dir(folder)
    except BaseException:
        for final, backup in reversed(moved):
            if final == folder / out.name:
                continue  # the model file went last: when it moved, nothing failed after it
            with contextlib.suppress(OSError):
                if backup is not None:
                    os.replace(backup, final)
                else:
                    final.unlink()
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return [folder / name for name in names]
