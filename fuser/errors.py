"""The errors onnx-moe-fuse raises on purpose: one hierarchy, each a ValueError or an OSError.

Every error that the user's input or options can cause is a :class:`MoEFuseError`, so callers
can catch one base, and the command line can map it to exit code 2 with its one-line message;
anything else that escapes is a bug of ours (exit code 4). Each class also derives from the
built-in exception callers would catch without knowing this module (``ValueError`` for bad
content, ``OSError`` for paths), so ``except ValueError`` keeps working.

The message is the whole story on one line: it names the file, tensor, node, attribute or
option at fault. The details are attributes as well (``path``, ``tensor``, ``location``,
``option``) for programs.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = [
    "ExternalDataError",
    "InputOverwriteError",
    "ModelLoadError",
    "ModelNotFoundError",
    "ModelValidationError",
    "MoEFuseError",
    "OptionError",
    "OutputPathError",
    "OutputWriteError",
    "user_error_in",
]


class MoEFuseError(Exception):
    """Base of the errors onnx-moe-fuse raises for bad input, options or paths."""

    def __init__(self, message: str, **details: Any) -> None:
        """``message``: one line naming what is at fault; ``details`` become attributes."""
        super().__init__(message)
        for key, value in details.items():
            setattr(self, key, os.fspath(value) if isinstance(value, os.PathLike) else value)

    def __str__(self) -> str:
        """The message alone (OSError would prefix ``[Errno n]``)."""
        return str(self.args[0]) if self.args else ""


class OptionError(MoEFuseError, ValueError):
    """An option or argument has a value we cannot use (``option`` names it)."""

    option: str | None = None


class ModelLoadError(MoEFuseError, ValueError):
    """A model file (or its external data) cannot be read as an ONNX model (``path``)."""

    path: str | None = None

    def __init__(self, path: str | os.PathLike[str] | None, message: str, **details: Any) -> None:
        """``path``: the file at fault (None for an in-memory model)."""
        super().__init__(message, path=path, **details)


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """The model file does not exist."""


class ModelValidationError(ModelLoadError):
    """The model reads, but is not a valid ONNX model (checker, opsets, attributes, tensors)."""


class ExternalDataError(ModelLoadError):
    """A tensor's external data is missing, short, or lies outside the model's folder."""

    tensor: str | None = None
    location: str | None = None


class OutputPathError(MoEFuseError, OSError):
    """An output path cannot be used: its folder is missing or read-only, or it is a folder."""

    path: str | None = None


class InputOverwriteError(OutputPathError, ValueError):
    """Writing would overwrite the input model, a data file it reads, or another output."""


class OutputWriteError(MoEFuseError, OSError):
    """Writing an output failed (disk full, permission denied); nothing partial was left."""

    path: str | None = None


def user_error_in(exc: BaseException) -> MoEFuseError | None:
    """The :class:`MoEFuseError` that ``exc`` is or wraps (``raise ... from``), or None.

    onnx-ir's pass manager wraps whatever a pass raises in a ``PassError``: a full disk met by
    the scratch weight file (:class:`OutputWriteError`) reaches the caller as the cause of one.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, MoEFuseError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None
