#!/usr/bin/env bash
# Build Horovod 0.28.1 (CPU, Gloo, PyTorch) into the environment of $PYTHON, then prove that its
# torch extension loaded. pip caches the built wheel, so later installs take seconds.
# Usage: PYTHON=.venv/bin/python tools/install_horovod.sh
set -euo pipefail
PYTHON=${PYTHON:-python}
here=$(cd "$(dirname "$0")" && pwd)
if "$PYTHON" -c "import horovod.torch as h; h.init" 2>/dev/null; then
  echo "horovod: already installed with its torch extension"; exit 0
fi
# --no-build-isolation: Horovod must see the installed torch, or it silently builds no torch
# extension; so its build requirements go in first.
"$PYTHON" -m pip install -q "cmake<4" wheel "setuptools<81" cloudpickle psutil pyyaml packaging
env CXX="$here/cxx17" CMAKE_POLICY_VERSION_MINIMUM=3.5 \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 HOROVOD_CPU_OPERATIONS=gloo \
    MAKEFLAGS="${MAKEFLAGS:--j2}" \
    "$PYTHON" -m pip install -q --no-build-isolation "horovod[pytorch]==0.28.1"
"$PYTHON" - <<'PY'
import horovod.torch as hvd
assert hasattr(hvd, "init"), "horovod.torch has no init: the torch extension was not built"
print("horovod", __import__("horovod").__version__, "with its torch extension: ok")
PY
