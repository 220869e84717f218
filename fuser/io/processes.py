"""Fresh worker processes: one forkserver for the whole run, its preloaded modules declared first.

The repack's workers (:mod:`.weight_sink`) and per-layer verification's (:mod:`onnx_moe_fuse.
verify.layers`) start their processes from :mod:`multiprocessing`'s forkserver: a clean
interpreter (no threads, no GPU device of the parent) that forks each worker. There is one
forkserver per process, and its preloaded modules are fixed when it starts: set later, they
are ignored, and every worker imports what it needs itself. That is what happened when the
repack started the server and verification came second: each layer's two verification
processes imported numpy, onnx and the verifier afresh (2 layers: 7.8 s a layer instead of
3.0 s, load 4 on 2 cores).

So a run declares, before the first pool starts, every module its workers will need
(:func:`want_preloaded`: the command line does so for ``--verify``), and each pool takes its
context from :func:`worker_context`, which preloads all of them.
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
from multiprocessing.context import BaseContext

__all__ = ["single_threaded_blas", "want_preloaded", "worker_context"]

_PRELOAD: list[str] = []


def want_preloaded(*modules: str) -> None:
    """Have the forkserver import ``modules`` when it starts (no effect once it runs)."""
    for m in modules:
        if m not in _PRELOAD:
            _PRELOAD.append(m)


def worker_context(*modules: str) -> BaseContext:
    """The context for fresh worker processes: forkserver (spawn where there is none).

    ``modules`` (those the pool's tasks live in) join the preload list: the forkserver, when it
    starts, imports every module declared so far, so each fork has them already.
    """
    want_preloaded(*modules)
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(list(_PRELOAD))
    return context


#: The thread-count setters OpenBLAS builds export (plain, 64-bit-integer, numpy's scipy build).
_BLAS_SETTERS = (
    "openblas_set_num_threads",
    "openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads64_",
    "scipy_openblas_set_num_threads",
)


def single_threaded_blas() -> bool:
    """Have the OpenBLAS this process loaded (numpy's) use one thread; whether one was found.

    For a worker whose products are many small matrix-vector ones (per-layer verification's
    reference: one per picked expert and FC part): a second BLAS thread's hand-off costs more
    than it saves, and on a loaded machine far more (2 shared cores, load 4: the Qwen3-size
    reference took 7.8 s with two threads, 2.5 s with one). The environment variable cannot do
    it here: the forkserver loaded numpy before any worker existed.
    """
    found = False
    try:
        with open("/proc/self/maps") as f:
            libraries = {line.split()[-1] for line in f if "openblas" in line.lower()}
    except OSError:
        return False
    for path in sorted(libraries):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for name in _BLAS_SETTERS:
            setter = getattr(lib, name, None)
            if setter is not None:
                setter(1)
                found = True
    return found
