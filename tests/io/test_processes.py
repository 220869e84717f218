"""The run's one forkserver preloads every module declared before it starts (fuser/io/processes.py).

The repack's pool usually starts the forkserver; per-layer verification's pool comes second.
A module declared with ``want_preloaded`` before the first pool is imported by the server, so
the second pool's workers have it without importing it (before, each verification process
imported the verifier afresh). Run in a fresh interpreter: the test process may have a
forkserver already.
"""

from __future__ import annotations

import subprocess
import sys

_CODE = """
from concurrent.futures import ProcessPoolExecutor
from onnx_moe_fuse.io.processes import want_preloaded, worker_context

want_preloaded("onnx_moe_fuse.verify.coverage")  # as the command line does for --verify
first = worker_context("onnx_moe_fuse.io.weight_sink")  # the repack's pool starts the server
with ProcessPoolExecutor(1, mp_context=first) as pool:
    pool.submit(abs, -1).result()
second = worker_context("json.tool")  # declared too late: the server runs already
probe = "sorted(m for m in __import__('sys').modules if m in {0})".format(
    {"onnx_moe_fuse.io.weight_sink", "onnx_moe_fuse.verify.coverage", "json.tool"})
with ProcessPoolExecutor(1, mp_context=second) as pool:
    print(pool.submit(eval, probe).result())
"""


def test_modules_declared_before_the_first_pool_are_in_every_worker():
    done = subprocess.run([sys.executable, "-c", _CODE], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    got = eval(done.stdout.strip().splitlines()[-1])
    assert got == ["onnx_moe_fuse.io.weight_sink", "onnx_moe_fuse.verify.coverage"]
