#!/usr/bin/env bash
# Set up everything onnx-moe-fuse needs on this machine, then run the demo or the tests.
#
#   scripts/bootstrap.sh demo    set up, then fuse and verify the embedded default sample
#   scripts/bootstrap.sh test    set up (plus the onnx-weekly reference venv), then run pytest
#
# Set-up: a virtual environment in .venv with the package (editable) and its test extras;
# Mesa's Vulkan driver (lavapipe) through apt-get when wgpu finds no Vulkan or GPU adapter
# (the OpenGL fallback lacks the subgroup and f16 features the kernels use); for tests, a
# second venv .venv-weekly with onnx-weekly (opset 29's GroupedMatMul reference), kept
# apart because onnxscript pins the released onnx, and a third, .venv-webgpu, with
# onnxruntime-webgpu 1.27 (the ort-webgpu target's package: it installs as `onnxruntime`, like
# the CPU package in .venv), which tests/pipeline/test_ort_loads.py loads every model fused for ort-webgpu in.
set -euo pipefail
cd "$(dirname "$0")/.."
mode="${1:-}"
case "$mode" in
  demo|test) ;;
  *) echo "usage: $0 demo|test" >&2; exit 2 ;;
esac

PYTHON="${PYTHON:-python3}"
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  "$PYTHON" -m venv .venv
fi
echo "== installing onnx-moe-fuse into .venv"
.venv/bin/python -m pip install -q -e '.[test]'

has_vulkan_adapter() {
  .venv/bin/python - <<'PY'
import sys
from onnx_moe_fuse.kernels.device import list_adapters
sys.exit(0 if any(kind in ("gpu", "vulkan-cpu") for kind, _ in list_adapters()) else 1)
PY
}

if ! has_vulkan_adapter 2>/dev/null; then
  echo "== no Vulkan WebGPU adapter: installing Mesa's Vulkan driver (lavapipe)"
  if [ "$(id -u)" -eq 0 ]; then SUDO=""; elif command -v sudo >/dev/null; then SUDO="sudo"; else
    echo "need root (or sudo) to run: apt-get install mesa-vulkan-drivers libvulkan1" >&2; exit 1
  fi
  if ! command -v apt-get >/dev/null; then
    echo "no apt-get here: install Mesa's Vulkan driver (lavapipe) with your package manager" >&2
    exit 1
  fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq mesa-vulkan-drivers libvulkan1 >/dev/null
  has_vulkan_adapter || { echo "still no Vulkan adapter after installing Mesa" >&2; exit 1; }
fi
.venv/bin/onnx-moe-fuse --list-adapters

if [ "$mode" = demo ]; then
  # The main job on the embedded default sample (a Mixtral-like int4 MoE layer): fuse it
  # into one com.microsoft.QMoE node, verify on the WebGPU kernels and in ONNX Runtime,
  # write the fused model and the JSON report under out/.
  mkdir -p out
  exec .venv/bin/onnx-moe-fuse --demo --explain -o out/demo-fused.onnx --report out/demo-report.json
fi

if [ ! -x .venv-weekly/bin/python ]; then
  echo "== creating .venv-weekly (onnx-weekly reference)"
  "$PYTHON" -m venv .venv-weekly
fi
.venv-weekly/bin/python -m pip install -q onnx-weekly numpy
export ONNX_WEEKLY_PYTHON="$PWD/.venv-weekly/bin/python"
if [ ! -x .venv-webgpu/bin/python ]; then
  echo "== creating .venv-webgpu (onnxruntime-webgpu, the ort-webgpu target's package)"
  "$PYTHON" -m venv .venv-webgpu
fi
.venv-webgpu/bin/python -m pip install -q onnxruntime-webgpu==1.27.0 numpy onnx
export ORT_WEBGPU_PYTHON="$PWD/.venv-webgpu/bin/python"
echo "== ruff"
.venv/bin/ruff check .
# pytest-xdist: PYTEST_WORKERS processes (default 2, CI's cores; 1 runs in this process).
# Measured on 2 cores: the suite took 14 min with 2 workers; CI's one-process run took 45 min.
workers="${PYTEST_WORKERS:-2}"
if [ "$workers" = 1 ]; then exec .venv/bin/python -m pytest -q "${@:2}"; fi
exec .venv/bin/python -m pytest -q -n "$workers" "${@:2}"
