"""Progress on stderr for the command line's stages, and the report's ``run`` section.

:class:`Progress` times each stage (``load``, ``fuse``, ``verify``, ``save``) and shows it:

* stderr a terminal: tqdm bars on stderr, one per stage, a bar of the MoE pass's candidate
  layers (:class:`onnx_moe_fuse.pipeline.LayerObserver`) and one of the bytes of repacked
  weights the weight sink receives (:meth:`Progress.watch_sink`);
* stderr not a terminal (a log, a pipe): one line per stage when it ends,
  ``load: 0.4 s``, ``fuse: 2 layers fused in 3.1 s``;
* ``quiet``: nothing (the stages are timed all the same).

Progress never changes the work: the watched sink returns the tensor of the sink it wraps.
:func:`run_section` is the report's ``run`` section: the tool's and its libraries' versions
(``importlib.metadata``; None when not installed), the WebGPU adapter when verification ran,
each stage's wall time in seconds and the process's peak resident memory in MiB.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from typing import Any, TextIO

import numpy as np

__all__ = ["LIBRARIES", "Progress", "fused_text", "peak_rss_mib", "run_section", "versions"]

#: The distributions whose versions the report records (``None`` when not installed).
LIBRARIES = ("onnx", "onnx-ir", "onnxscript", "onnxruntime", "wgpu", "numpy")


def versions() -> dict[str, str | None]:
    """``{"onnx-moe-fuse": ..., "onnx": ..., ...}``: the installed versions, None if absent."""
    out: dict[str, str | None] = {}
    for name in ("onnx-moe-fuse", *LIBRARIES):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def peak_rss_mib() -> float | None:
    """This process's peak resident set size in MiB (``getrusage``), None where unavailable."""
    try:
        import resource
    except ImportError:  # Windows
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return round(peak * scale / 2**20, 1)


def run_section(stages: dict[str, float], adapter: str | None = None) -> dict[str, Any]:
    """The report's ``run`` section (see the module docstring)."""
    found = versions()
    return {
        "tool": found.pop("onnx-moe-fuse"),
        "versions": found,
        "adapter": adapter,
        "stages": {name: round(seconds, 3) for name, seconds in stages.items()},
        "peak_rss_mib": peak_rss_mib(),
    }


Sink = Callable[[np.ndarray, str], Any]


class _WatchedSink:
    """A weight sink that tells :meth:`Progress.repacked` of each array's bytes."""

    def __init__(self, sink: Sink, progress: Progress) -> None:
        self._sink = sink
        self._progress = progress

    def __call__(self, array: np.ndarray, name: str) -> Any:
        """The wrapped sink's tensor for ``array``; then the bytes are counted."""
        tensor = self._sink(array, name)
        self._progress.repacked(int(array.nbytes))
        return tensor

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sink, name)  # the scratch sink's path, bytes_written, ...


def fused_text(report: Any) -> str:
    """``"2 layers fused"``: what the ``fuse`` stage's line says of a ``FusionReport``."""
    count = len(report.fusions)
    return f"{count} layer{'' if count == 1 else 's'} fused"


def _is_terminal(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty()) if isatty is not None else False
    except (ValueError, OSError):  # a closed stream
        return False


class Progress:
    """Stage timing and display (see the module docstring); also a ``LayerObserver``."""

    def __init__(self, *, quiet: bool = True, stream: TextIO | None = None) -> None:
        """Show nothing when ``quiet`` (the default: the API's), else progress on ``stream``.

        ``stream`` defaults to ``sys.stderr`` as it is now; bars when it is a terminal.
        """
        self.stream = sys.stderr if stream is None else stream
        self.quiet = quiet
        self.bars = not quiet and _is_terminal(self.stream)
        #: Stage name -> wall seconds, in the order the stages ran.
        self.stages: dict[str, float] = {}
        self.detail: str | None = None  # what the current stage's line says before "in"
        self._layers: Any = None
        self._bytes: Any = None
        self.fused = 0

    def _bar(self, **kwargs: Any) -> Any:
        from tqdm import tqdm

        return tqdm(file=self.stream, leave=True, **kwargs)

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[Progress]:
        """Time the stage ``name``; its bar while it runs, its line when it ends (not on error)."""
        self.detail = None
        bar = (
            self._bar(desc=name, total=None, bar_format="{desc}: {elapsed}{postfix}")
            if self.bars
            else None
        )
        start = time.perf_counter()
        try:
            yield self
        finally:
            self.stages[name] = time.perf_counter() - start
            for sub in (self._layers, self._bytes):
                if sub is not None:
                    sub.close()
            self._layers = self._bytes = None
            if bar is not None:
                if self.detail:
                    bar.set_postfix_str(self.detail, refresh=False)
                bar.close()
        if not self.bars and not self.quiet:
            what = f"{self.detail} in " if self.detail else ""
            print(f"{name}: {what}{self.stages[name]:.1f} s", file=self.stream, flush=True)

    # -- the MoE pass's observer ------------------------------------------------------------------

    def layers_found(self, count: int) -> None:
        """The MoE pass found ``count`` candidate layers: a bar of them on a terminal."""
        if self.bars and count:
            self._layers = self._bar(desc="  layers", total=count, unit="layer")

    def layer_done(self, name: str, fused: bool) -> None:
        """One candidate layer is done (fused or not)."""
        self.fused += bool(fused)
        if self._layers is not None:
            self._layers.set_postfix_str(f"{'fused' if fused else 'left'} {name}", refresh=False)
            self._layers.update(1)

    # -- repacked weights -------------------------------------------------------------------------

    def repacked(self, nbytes: int) -> None:
        """``nbytes`` of repacked weights went to the weight sink: a bytes bar on a terminal."""
        if not self.bars:
            return
        if self._bytes is None:
            self._bytes = self._bar(desc="  repack", unit="B", unit_scale=True, unit_divisor=1024)
        self._bytes.update(nbytes)

    def watch_sink(self, sink: Sink | None, default: Sink) -> Sink | None:
        """``sink`` (``default`` when None) reporting the bytes it receives; same tensors.

        Without bars there is nothing to show: ``sink`` itself comes back, None included.
        """
        if not self.bars:
            return sink
        return _WatchedSink(sink if sink is not None else default, self)

    def run_section(self, adapter: str | None = None) -> dict[str, Any]:
        """The report's ``run`` section with the stages timed so far."""
        return run_section(self.stages, adapter)
