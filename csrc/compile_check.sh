#!/usr/bin/env bash
# Compile-only check of the CUDA half of csrc/ on a machine whose torch has no CUDA: nvcc and g++
# against the installed torch's headers, the CUDA toolkit's and NCCL's (NCCL_HOME: a directory
# with include/nccl.h, e.g. the unpacked nvidia-nccl-cu13 wheel's nvidia/nccl). Nothing is linked
# or run, so this catches type and API errors only. CPU builds of torch lack one generated
# header (c10/cuda/impl/cuda_cmake_macros.h); a stub of it is written to a scratch directory.
# Usage: NCCL_HOME=... PYTHON=.venv/bin/python csrc/compile_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
: "${NCCL_HOME:?set NCCL_HOME to a directory with include/nccl.h}"
if [ -z "${CUDA_HOME:-}" ]; then
  for d in /usr/local/cuda /usr/local/cuda-*; do
    if [ -f "$d/include/cuda_runtime_api.h" ]; then CUDA_HOME=$d; break; fi
  done
fi
: "${CUDA_HOME:?set CUDA_HOME to the CUDA toolkit}"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
mkdir -p "$out/stub/c10/cuda/impl"
printf '#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n' > "$out/stub/c10/cuda/impl/cuda_cmake_macros.h"
torch_inc=$("$PYTHON" -c "from torch.utils.cpp_extension import include_paths; print(' '.join('-I' + p for p in include_paths()))")
py_inc=$("$PYTHON" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
inc="-I$out/stub $torch_inc -I$py_inc -I$CUDA_HOME/include -I$NCCL_HOME/include"
def="-DDEAR_WITH_CUDA -DDEAR_WITH_NCCL -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_native"
for cu in csrc/cuda/pack_kernels.cu csrc/cuda/digest_kernels.cu csrc/cuda/quantize_kernels.cu; do
  "$CUDA_HOME/bin/nvcc" -c "$cu" -o "$out/$(basename "$cu").o" -std=c++17 $inc $def \
    -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ \
    -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ --expt-relaxed-constexpr \
    -Xcompiler -fPIC
  echo "ok: $cu"
done
for src in csrc/cuda/nccl_communicator.cpp csrc/module.cpp csrc/pack.cpp csrc/grad_ready.cpp \
    csrc/quantize.cpp; do
  g++ -c "$src" -o "$out/$(basename "$src").o" -std=c++17 -fPIC $inc $def
  echo "ok: $src"
done
