#!/usr/bin/env bash
# Prepare, on this machine, what a GPU run carries (scripts/gpu_run.sh unpacks it there).
#
#   bash scripts/gpu_prepare.sh [--webgpu]
#
# Writes two git-ignored folders in this checkout:
#   .gl/   the Vulkan and EGL loader debs (amd64), which the GPU image lacks;
#   .whl/  wheels for the image's Python 3.12 (manylinux x86_64): wgpu 0.32 and its needs,
#          jsonschema and its needs, onnx-ir 1.1 (the image has 1.0); onnxruntime 1.32 as a
#          trimmed archive .whl/onnxruntime-1.32.0-cp312-trimmed.tar.xz: the wheel is 28 MB,
#          and the upload limit (64 MiB with the working tree, which has 34 MB of sample
#          models) leaves no room for it. Trimmed: libonnxruntime.so (the C API library; the
#          Python module is self-contained) and the transformers/quantization/tools/datasets
#          subpackages are left out, the rest is xz-compressed (about 10 MB).
#   --webgpu adds onnxruntime-webgpu 1.27 the same way under .whl/ort-webgpu/ (gpu_run.sh
#          unpacks it into a folder of its own, as both have the import name onnxruntime,
#          and exports ORT_WEBGPU_DIR for bench_moe_kernels.py --ort-webgpu).
# Finally it prints what a run would upload against the limit.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
webgpu=0
[ "${1:-}" = "--webgpu" ] && webgpu=1

mkdir -p .gl .whl /tmp/amd64/partial
if ! compgen -G ".gl/libvulkan1_*.deb" >/dev/null; then
  o='-oAPT::Architecture=amd64 -oAPT::Architectures=amd64 -oDir::State::Lists=/tmp/amd64'
  # shellcheck disable=SC2086
  apt-get $o update >/dev/null
  # shellcheck disable=SC2086
  (cd .gl && apt-get $o download libvulkan1 libegl1 libglvnd0 libopengl0 libgl1 libglx0 libgles2)
fi

download() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$@"
}
download .whl wgpu==0.32.0 cffi pycparser rendercanvas jsonschema jsonschema-specifications \
  referencing rpds-py onnx-ir==1.1.0

# trim WHEEL ARCHIVE: the wheel's files without the C API library and the unused subpackages.
trim() {
  local wheel="$1" archive="$2" work
  work="$(mktemp -d)"
  (cd "$work" && unzip -q "$wheel" \
    && rm -rf onnxruntime/transformers onnxruntime/quantization onnxruntime/tools \
      onnxruntime/datasets onnxruntime/capi/libonnxruntime.so.* \
    && tar -cJf "$archive" --owner=0 --group=0 onnxruntime onnxruntime*.dist-info)
  rm -rf "$work"
}
tmp="$(mktemp -d)"
if ! compgen -G ".whl/onnxruntime-1.32.0-*.tar.xz" >/dev/null; then
  download "$tmp" onnxruntime==1.32.0
  trim "$(ls "$tmp"/onnxruntime-1.32.0-*.whl)" "$PWD/.whl/onnxruntime-1.32.0-cp312-trimmed.tar.xz"
fi
if [ "$webgpu" = 1 ] && ! compgen -G ".whl/ort-webgpu/*.tar.xz" >/dev/null; then
  mkdir -p .whl/ort-webgpu
  download "$tmp" onnxruntime-webgpu==1.27.0
  trim "$(ls "$tmp"/onnxruntime_webgpu-1.27.0-*.whl)" \
    "$PWD/.whl/ort-webgpu/onnxruntime-webgpu-1.27.0-cp312-trimmed.tar.xz"
fi
rm -rf "$tmp"
rm -f .whl/onnxruntime-1.32.0-*.whl  # never both the wheel and the archive

tree=$(git ls-files -z | xargs -0 cat 2>/dev/null | wc -c)
carried=$(find .gl .whl -type f -print0 | xargs -0 cat | wc -c)
echo "upload: working tree $((tree / 1048576)) MiB + .gl/.whl $((carried / 1048576)) MiB" \
  "= $(((tree + carried) / 1048576)) MiB of 64 MiB"
ls -la .gl .whl
