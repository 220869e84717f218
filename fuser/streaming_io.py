"""Fuse a model file into an output file with memory that does not grow with the model.

:func:`fuse_file` is the command line's path for a file input without ``--verify``. It never
holds the model's weights in memory:

1. the input is validated without its tensor data
   (:func:`onnx_moe_fuse.io.model_io.check_model_file`: the header, the opsets and attributes, the
   checker, every external tensor's data file resolved as ORT resolves it and long enough),
   then loaded with ``ir.load``, which maps external data lazily (a tensor whose data onnx-ir's
   own containment check would refuse, a Hugging Face cache blob, is re-pointed at the file it
   resolves to);
2. the output paths are checked before any work, as
   :func:`onnx_moe_fuse.io.model_io.save_model_atomic` checks them
   (:func:`onnx_moe_fuse.io.output_paths.check_output_paths`);
3. the fusion pipeline runs in place with a :class:`~onnx_moe_fuse.io.weight_sink.ScratchFileSink`
   in the output's folder: each fused layer's repacked weights go to the scratch file as they
   are made, and the rules read each layer's source weights transiently
   (:func:`onnx_moe_fuse.rewrites.graph.tensor_reads.read_array`);
4. the scratch file becomes ``<out name>.data`` in a hidden temporary folder inside the
   output's folder (:func:`onnx_moe_fuse.io.sink_save.save_into_sink_file`: the model's other
   large tensors appended to it, copied in the kernel from the input's data), so the fused
   weights are written once, and the model file beside it; both files are fsynced and moved into place with
   ``os.replace``, the data file first, the model file last; a failure on the way removes the
   temporary folder and rolls a moved data file back (the previous one restored, or the new one
   removed), and the scratch file is removed in every case.

When nothing fused, the model is read again from the input and written as it was (the passes'
analyses annotate value shapes of the model they read), as :func:`onnx_moe_fuse.fuse` returns
an unfused ModelProto as it was.

A model whose input keeps its data inside the ``.onnx`` file (no external data) is in memory
once it is parsed anyway: it is fused with the in-memory sink and saved as one file, as
:func:`~onnx_moe_fuse.io.model_io.save_model_atomic` saves it, unless it would exceed protobuf's
2 GB limit, when it gets a data file too. ``--verify`` runs both models and so needs them in
memory: it keeps the in-memory path.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import onnx
import onnx_ir as ir

from onnx_moe_fuse.contract.targets import DEFAULT, Target, as_target
from onnx_moe_fuse.errors import (
    ExternalDataError,
    ModelLoadError,
    MoEFuseError,
    OutputWriteError,
    user_error_in,
)
from onnx_moe_fuse.io.external_data import resolve_external_file
from onnx_moe_fuse.io.model_check import all_tensors, is_external
from onnx_moe_fuse.io.model_io import (
    EXTERNAL_SIZE_THRESHOLD,
    PROTOBUF_LIMIT,
    check_model_file,
    data_file_for,
    fsync_path,
    input_files,
    move_into_place,
)
from onnx_moe_fuse.io.output_paths import check_output_paths, new_file_mode, one_line, size_text
from onnx_moe_fuse.io.sink_save import save_into_sink_file
from onnx_moe_fuse.io.weight_sink import ScratchFileSink, default_jobs
from onnx_moe_fuse.pipeline import FusionReport, fusion_pipeline
from onnx_moe_fuse.progress import Progress, fused_text
from onnx_moe_fuse.rewrites.graph.weight_sink import in_memory
from onnx_moe_fuse.rewrites.moe.quantize import Quantization

__all__ = ["StreamedFusion", "fuse_file"]

#: Bytes copied at a time when a model is written unchanged.
_COPY_CHUNK = 1 << 20


@dataclass
class StreamedFusion:
    """What :func:`fuse_file` did: the report, the files written (data file first)."""

    report: FusionReport
    written: list[Path]

    @property
    def fused(self) -> bool:
        """True when at least one layer was fused."""
        return bool(self.report.fusions)


def _readable_external_tensors(model: ir.Model, path: Path) -> bool:
    """Make every external tensor readable by onnx-ir; return whether the model has any.

    The data files were checked already (:func:`~onnx_moe_fuse.io.model_io.check_model_file`).
    onnx-ir reads only from inside ``base_dir`` after resolving links; a data file that the
    ORT rules allow elsewhere (a link into the folder of the resolved model, as in a Hugging
    Face cache) gets a tensor pointing at the file it resolves to.
    """
    external = False
    for graph in model.graphs():
        for value in graph.initializers.values():
            tensor = value.const_value
            if not isinstance(tensor, ir.ExternalTensor):
                continue
            external = True
            contained = getattr(tensor, "_check_path_containment", None)  # onnx-ir's own check
            try:
                if contained is not None:
                    contained()
                continue
            except ValueError:
                real = Path(tensor.path).resolve()
            value.const_value = ir.ExternalTensor(
                real.name,
                tensor.offset,
                tensor.length,
                tensor.dtype,
                shape=tensor.shape,
                name=tensor.name,
                base_dir=str(real.parent),
            )
            try:
                value.const_value._check_path_containment()
            except ValueError as exc:  # a hard-linked data file
                raise ExternalDataError(real, f"{path}: tensor {tensor.name!r}: {exc}") from exc
    return external


def _initializer_bytes(model: ir.Model) -> int:
    return sum(
        v.const_value.nbytes
        for g in model.graphs()
        for v in g.initializers.values()
        if v.const_value is not None
    )


def _write_unchanged(src: Path, target: Path, data_name: str) -> None:
    """Write the model file ``src`` to ``target`` as it is, its external data copied in chunks.

    Every external tensor's bytes go, in order, into ``data_name`` beside ``target``, and the
    tensor's ``location``/``offset``/``length`` are set to their new place; nothing else of the
    model changes.
    """
    proto = check_model_file(src)
    base = src.parent
    with open(target.with_name(data_name), "wb") as data:
        for tensor in all_tensors(proto):
            if not is_external(tensor):
                continue
            info = {e.key: e.value for e in tensor.external_data}
            path = resolve_external_file(tensor, base, src, str(src))
            start = int(info.get("offset") or 0)
            with open(path, "rb") as source:
                length = (
                    int(info["length"])
                    if info.get("length")
                    else os.fstat(source.fileno()).st_size - start
                )
                source.seek(start)
                offset = data.tell()
                left = length
                while left:
                    chunk = source.read(min(left, _COPY_CHUNK))
                    if not chunk:
                        raise ModelLoadError(
                            path, f"{src}: tensor {tensor.name!r} is short in {path}"
                        )
                    data.write(chunk)
                    left -= len(chunk)
            new = {"location": data_name, "offset": str(offset), "length": str(length)}
            del tensor.external_data[:]
            for key, value in {**info, **new}.items():
                tensor.external_data.add(key=key, value=value)
    onnx.save_model(proto, str(target))


def _write(
    model: ir.Model,
    report: FusionReport,
    src: Path,
    tmp: Path,
    name: str,
    data_name: str,
    external: bool,
    sink: ScratchFileSink | None = None,
) -> list[str]:
    """Write the model file ``name`` (and ``data_name``) into ``tmp``; return the names."""
    if not report.fusions:  # the passes' analyses annotate shapes: write the input as it was
        _write_unchanged(src, tmp / name, data_name)
    elif external and sink is not None:  # the fused weights stay where the sink wrote them
        return save_into_sink_file(model, sink, tmp, name, data_name)
    elif external:
        ir.save(
            model,
            tmp / name,
            external_data=data_name,
            size_threshold_bytes=EXTERNAL_SIZE_THRESHOLD - 1,
        )
    else:
        onnx.save_model(ir.to_proto(model), str(tmp / name))
    if (tmp / data_name).exists() and not (tmp / data_name).stat().st_size:
        (tmp / data_name).unlink()  # no tensor went external: no data file, as model_io
    return [n for n in (data_name, name) if (tmp / n).exists()]


#: Tests only (tests/cli/test_cli_signals.py): when set to a path, :func:`fuse_file` creates
#: that file and sleeps once the output is written into its temporary folder (the scratch file
#: still open), just before moving it into place, so a test can signal a run that is mid-write.
TEST_PAUSE_ENV = "ONNX_MOE_FUSE_TEST_PAUSE_BEFORE_MOVE"


def _test_pause() -> None:
    marker = os.environ.get(TEST_PAUSE_ENV)
    if marker:
        Path(marker).touch()
        time.sleep(60)


def fuse_file(
    input_path: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    only: Iterable[str] | None = None,
    target: Target | str | None = None,
    progress: Progress | None = None,
    quantize: Quantization | None = None,
    accuracy_level: int | None = None,
    jobs: int | None = None,
    check: Callable[[Path, FusionReport], None] | None = None,
) -> StreamedFusion:
    """Fuse the model file ``input_path`` into ``out_path``, streaming weights from disk.

    Args:
        input_path: the ``.onnx`` file (its external data is read from beside it).
        out_path: the model file to write; its data file is ``<out name>.data`` beside it.
        only: the ops that may be emitted (default all; see :func:`onnx_moe_fuse.fuse`).
        target: the runtime the fused nodes are written for, a ``Target`` or its name
            (default: the pipeline's, ``ort-cpu``); a name is parsed here, before any work.
        progress: times and shows the stages ``load``, ``fuse``, ``save``
            (:class:`onnx_moe_fuse.progress.Progress`; default silent); the report's ``run``
            section has their times either way.
        quantize: opt-in quantisation of float layers into QMoE (parsed by
            :func:`onnx_moe_fuse.api.check_quantization`); ``accuracy_level``: QMoE's, on every
            QMoE node (see :func:`onnx_moe_fuse.fuse`).
        jobs: worker processes writing the repacked QMoE weights (default
            :func:`~onnx_moe_fuse.io.weight_sink.default_jobs`, the usable CPUs; 1: in this
            process, as each layer is fused).
        check: called with the written model file (in its temporary folder, its data beside
            it) and the report once the output is written and before it is moved into place;
            an exception there leaves nothing behind, as any failure does (per-layer
            verification, :func:`onnx_moe_fuse.verify.layers.verify_layers`, runs there). Not
            called when nothing fused.

    Raises:
        ModelLoadError: the input is missing, not a valid ONNX model, or its external data is
            missing, outside the model's folder or short (its subclasses say which).
        OutputPathError: the output is the input or the input's data, or cannot be written
            there (:class:`~onnx_moe_fuse.errors.InputOverwriteError` for the first).
        OutputWriteError: writing failed (disk full, permission denied); nothing was left.
        ValueError: ``only`` names an unknown op, or ``target`` an unknown runtime.
    """
    parsed = DEFAULT if target is None else as_target(target)
    src = Path(input_path)
    out = Path(out_path)
    data = data_file_for(out)
    progress = progress if progress is not None else Progress()
    with progress.stage("load"):
        check_model_file(src)  # one clear error for a bad model or data file, before any work
        check_output_paths(
            {"the output model": out, "its data file": data}, protected=input_files(src)
        )
        folder = out.parent if str(out.parent) else Path(".")
        try:
            model = ir.load(os.fspath(src))
        except (ValueError, RuntimeError, TypeError, OSError) as exc:
            raise ModelLoadError(src, f"{src} is not a valid ONNX model: {one_line(exc)}") from exc
        external = (
            _readable_external_tensors(model, src) or _initializer_bytes(model) > PROTOBUF_LIMIT
        )

    report = FusionReport()
    with contextlib.ExitStack() as cleanup:
        workers = default_jobs() if jobs is None else jobs
        sink = cleanup.enter_context(ScratchFileSink(folder, jobs=workers)) if external else None
        watched = progress.watch_sink(sink, in_memory)
        with progress.stage("fuse"):
            try:
                fusion_pipeline(
                    report,
                    only,
                    target=parsed,
                    weight_sink=watched,
                    observer=progress,
                    quantize=quantize,
                    accuracy_level=accuracy_level,
                )(model)
            except Exception as exc:  # onnx-ir's PassError wraps the scratch file's full disk
                found = user_error_in(exc)
                if found is None:
                    raise
                raise found from found.__cause__  # its own cause (the OSError) stays
            if sink is not None:  # the layers' reserved weights, in worker processes
                sink.finish()
            progress.detail = fused_text(report)
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=folder))
        except OSError as exc:
            raise OutputWriteError(
                f"cannot write into {str(folder)!r}: {exc.strerror or exc}", path=out
            ) from exc
        cleanup.callback(shutil.rmtree, tmp, ignore_errors=True)
        try:
            with progress.stage("save"):
                names = _write(model, report, src, tmp, out.name, data.name, external, sink)
                for name in names:
                    os.chmod(tmp / name, new_file_mode())
                    fsync_path(tmp / name)
                _test_pause()
            if check is not None and report.fusions:
                with progress.stage("verify"):
                    check(tmp / out.name, report)
            move_into_place(tmp, folder, names, out.name)
        except OSError as exc:
            if isinstance(exc, MoEFuseError):
                raise
            needed = size_text(_initializer_bytes(model))
            raise OutputWriteError(
                f"cannot write {str(out)!r}: {exc.strerror or one_line(exc)} (the model's "
                f"weights need about {needed}); nothing was written",
                path=out,
            ) from exc
    report.run = progress.run_section()
    return StreamedFusion(report=report, written=[folder / name for name in names])
