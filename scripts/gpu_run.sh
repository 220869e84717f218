#!/usr/bin/env bash
# Run a command with this checkout on the lent GPU machine (the device tool's H200): the
# recipe of shared/tools/device-wgpu/README.md as code.
#
#   bash scripts/gpu_run.sh COMMAND [ARGS...]
#   bash scripts/gpu_run.sh python3 -m pytest -q tests/kernels
#   bash scripts/gpu_run.sh python3 benchmarks/bench_moe_kernels.py --plot "$OUT/moe.png"
#
# What the run carries (scripts/gpu_prepare.sh makes both here, once): .gl/ (the Vulkan and
# EGL loader debs, which the image lacks) and .whl/ (wheels for the image's Python 3.12:
# wgpu, cffi, pycparser, rendercanvas, jsonschema and its needs, onnx-ir; and onnxruntime
# 1.32 as a trimmed .tar.xz, because its wheel does not fit the upload limit beside the
# working tree). Steps:
#
#   1. unpack the loader debs into / when no libvulkan is installed (never on a machine
#      that has one: unpacking over a system's own libraries can break it);
#   2. point Vulkan (and EGL) at NVIDIA's driver files when they exist and nothing else
#      was set (VK_DRIVER_FILES, __EGL_VENDOR_LIBRARY_FILENAMES);
#   3. install the carried wheels and unpack the carried .tar.xz archives into $GPU_SITE
#      (default /tmp/site), ahead of the image's packages on PYTHONPATH: the image's
#      onnxruntime 1.30 lacks what the ORT comparisons need (block-wise QMoE scales, new
#      attributes), so the carried 1.32 must win; .whl/ort-webgpu/*.tar.xz (onnxruntime-
#      webgpu) into $GPU_SITE-webgpu, exported as ORT_WEBGPU_DIR;
#   4. make the package importable from this checkout (onnx_moe_fuse -> fuser/, with
#      .rewrites -> rewrites/ and .kernels -> kernels/ as pyproject.toml maps them) by
#      symbolic links in $GPU_SITE, so the checkout's files are the ones that run;
#   5. print the versions and the adapter, then exec the command.
#
# GPU_REQUIRE_ORT=1.32 (the default) makes an older onnxruntime an error; set it empty to
# run with whatever onnxruntime is there (the ORT comparisons it lacks are then skipped,
# tests/ort_compat.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
SITE="${GPU_SITE:-/tmp/site}"
PY="${PYTHON:-python3}"
REQUIRE_ORT="${GPU_REQUIRE_ORT-1.32}"

if [ "$#" -eq 0 ]; then
  echo "usage: $0 COMMAND [ARGS...]" >&2
  exit 2
fi

# 1. Vulkan / EGL loaders.
if ! ldconfig -p | grep -q 'libvulkan\.so\.1'; then
  if compgen -G ".gl/*.deb" >/dev/null; then
    for f in .gl/*.deb; do dpkg -x "$f" /; done
    ldconfig
  else
    echo "gpu_run: no libvulkan here and no .gl/*.deb to unpack (scripts/gpu_prepare.sh)" >&2
  fi
fi

# 2. The driver's ICD and EGL vendor files.
icd=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json
egl=/usr/local/nvidia/share/glvnd/egl_vendor.d/10_nvidia.json
if [ -z "${VK_DRIVER_FILES:-}" ] && [ -f "$icd" ]; then export VK_DRIVER_FILES="$icd"; fi
if [ -z "${__EGL_VENDOR_LIBRARY_FILENAMES:-}" ] && [ -f "$egl" ]; then
  export __EGL_VENDOR_LIBRARY_FILENAMES="$egl"
fi
export PYTHONUNBUFFERED=1 XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"

# 3. Carried wheels and archives.
mkdir -p "$SITE"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl
fi
if compgen -G ".whl/*.tar.xz" >/dev/null; then
  for archive in .whl/*.tar.xz; do tar -xJf "$archive" -C "$SITE"; done
fi
# onnxruntime-webgpu has the import name onnxruntime too: a folder of its own, for
# bench_moe_kernels.py --ort-webgpu "$ORT_WEBGPU_DIR" (which runs it in a subprocess).
if compgen -G ".whl/ort-webgpu/*.tar.xz" >/dev/null; then
  export ORT_WEBGPU_DIR="$SITE-webgpu"
  mkdir -p "$ORT_WEBGPU_DIR"
  for archive in .whl/ort-webgpu/*.tar.xz; do tar -xJf "$archive" -C "$ORT_WEBGPU_DIR"; done
fi

# 4. The package, linked to this checkout.
pkg="$SITE/onnx_moe_fuse"
rm -rf "$pkg"
mkdir -p "$pkg"
for entry in fuser/*; do
  case "$entry" in */__pycache__) continue ;; esac
  ln -s "$ROOT/$entry" "$pkg/"
done
ln -s "$ROOT/rewrites" "$pkg/rewrites"
ln -s "$ROOT/kernels" "$pkg/kernels"
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

# 5. What runs.
GPU_REQUIRE_ORT="$REQUIRE_ORT" "$PY" - <<'PY'
import os
import sys

import numpy
import onnx
import onnxruntime
import wgpu

import onnx_moe_fuse.kernels.device as device

print(f"gpu_run: python {sys.version.split()[0]}, numpy {numpy.__version__}, onnx {onnx.__version__}, "
      f"onnxruntime {onnxruntime.__version__} ({onnxruntime.__file__}), wgpu {wgpu.__version__}")
print(f"gpu_run: adapters: {device.list_adapters()}")
want = os.environ.get("GPU_REQUIRE_ORT", "")
if want:
    have = tuple(int(p) for p in onnxruntime.__version__.split(".")[:2])
    if have < tuple(int(p) for p in want.split(".")[:2]):
        sys.exit(f"gpu_run: onnxruntime {onnxruntime.__version__} < {want}: carry its wheel "
                 "(scripts/gpu_prepare.sh) or set GPU_REQUIRE_ORT= to run without it")
PY
exec "$@"
