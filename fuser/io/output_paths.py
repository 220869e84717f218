"""Output paths that cannot destroy data, and atomic writes of small files.

:func:`check_output_paths` runs before any work is done. It refuses an output that

* resolves to the input model or to one of the data files the input reads (symlinks are
  resolved, hard links caught by ``os.path.samefile``): :class:`InputOverwriteError`;
* resolves to another output of the same run (``--report`` naming ``-o`` or ``OUT.onnx.data``);
* is a folder, or an existing file that is not a regular file (a device, a pipe: renaming over
  it would replace the device node), or lies in a folder that does not exist or that we cannot
  create files in (probed by creating and removing a file, which also sees read-only mounts and
  holds for root): :class:`OutputPathError`.

The temporaries of every write are new files and folders created exclusively (``mkdtemp``,
``O_EXCL``) beside their target, so they cannot be an existing file.

:func:`write_text_atomic` writes a small text file (the JSON report): a temporary file in the
target's folder created with mode 0666 less the umask (the same mode as any file the user
creates; ``mkstemp`` would give 0600), flushed and fsynced, then renamed over the target. A
failure raises :class:`OutputWriteError` and leaves no file behind.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path

from onnx_moe_fuse.errors import InputOverwriteError, OutputPathError, OutputWriteError

__all__ = [
    "check_output_paths",
    "fsync_folder",
    "new_file_mode",
    "one_line",
    "size_text",
    "write_text_atomic",
]


def one_line(exc: BaseException) -> str:
    """An exception's message squeezed onto one line."""
    return " ".join(str(exc).split())


def size_text(nbytes: int) -> str:
    """``1536000`` -> ``"1.5 MB"``: a size for a message."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def _same_file(a: Path, b: Path) -> bool:
    try:
        if a.resolve() == b.resolve():
            return True
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except (OSError, ValueError, RuntimeError):
        return False


def _probe_folder(folder: Path, what: str, target: Path) -> None:
    """Create and remove a file in ``folder``: the only test of writability that never lies."""
    probe = folder / f".onnx-moe-fuse-probe-{secrets.token_hex(6)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        raise OutputPathError(
            f"{what} {str(target)!r}: cannot create files in {str(folder)!r}: "
            f"{exc.strerror or one_line(exc)}",
            path=target,
        ) from exc
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(probe)


def _check_destination(what: str, target: Path) -> None:
    folder = target.parent if str(target.parent) else Path(".")
    try:
        is_dir, exists = target.is_dir(), target.exists() or target.is_symlink()
        regular = target.is_file()
        folder_ok = folder.is_dir()
    except (OSError, ValueError) as exc:
        raise OutputPathError(f"{what} {str(target)!r}: unusable path: {exc}", path=target) from exc
    if is_dir:
        raise OutputPathError(f"{what} {str(target)!r} is a folder; name a file", path=target)
    if exists and not regular and not target.is_symlink():
        raise OutputPathError(
            f"{what} {str(target)!r} exists and is not a regular file; refusing to replace it",
            path=target,
        )
    if not folder_ok:
        raise OutputPathError(
            f"{what} {str(target)!r}: the folder {str(folder)!r} does not exist", path=target
        )
    _probe_folder(folder, what, target)


def check_output_paths(
    outputs: Mapping[str, str | os.PathLike[str]],
    *,
    protected: Iterable[tuple[str, str | os.PathLike[str]]] = (),
) -> None:
    """Refuse outputs that would overwrite an input or each other, or cannot be written.

    Args:
        outputs: what each output is (``"-o"``, ``"--report"``, ``"the -o data file"``) ->
            its path. Each is checked; the message names the option.
        protected: ``(what, path)`` of the files the run reads (the input model and its data
            files, :func:`onnx_moe_fuse.io.model_io.input_files`): none may be an output.

    Raises:
        InputOverwriteError: an output is the input, its data, or another output.
        OutputPathError: an output is a folder or a special file, or its folder is missing or
            not writable.
    """
    named = [(what, Path(p)) for what, p in outputs.items()]
    keep_all = [(kind, Path(p)) for kind, p in protected]
    for what, target in named:
        for kind, keep in keep_all:
            if _same_file(target, keep):
                raise InputOverwriteError(
                    f"refusing to write {what} {str(target)!r}: it is {kind} ({str(keep)!r}); "
                    "choose another output path",
                    path=target,
                )
    for i, (what, target) in enumerate(named):
        for other_what, other in named[i + 1 :]:
            if _same_file(target, other):
                raise InputOverwriteError(
                    f"{what} and {other_what} both name {str(target)!r}; one would overwrite "
                    "the other",
                    path=target,
                )
    for what, target in named:
        _check_destination(what, target)


def new_file_mode() -> int:
    """The mode a new file gets here: 0666 less the process umask (0644 usually)."""
    mask = os.umask(0o022)  # reading the umask means setting it: put it straight back
    os.umask(mask)
    return 0o666 & ~mask


def fsync_folder(folder: Path) -> None:
    """Make a rename in ``folder`` durable (where the platform can open folders)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in its folder and a rename.

    Raises:
        OutputWriteError: the file system refused (no space, permission, a folder in the way);
            the temporary file is removed and ``path`` is left as it was.
    """
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    tmp = folder / f".{target.name}.tmp-{secrets.token_hex(6)}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # umask applies
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        try:
            os.replace(tmp, target)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_folder(folder)
    except OSError as exc:
        raise OutputWriteError(
            f"cannot write {str(target)!r}: {exc.strerror or one_line(exc)}; nothing was written",
            path=target,
        ) from exc
