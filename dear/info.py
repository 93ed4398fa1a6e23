"""`python -m dear.info`: what this installation of dear can use, for bug reports and set-up checks.

Prints dear's and torch's versions, whether the native extension (csrc/) was built and loads,
which parts it has (C++, CUDA kernels, NCCL communicator), and which communication backends
`dear.init(backend=...)` can start here.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from typing import Any

import torch
import torch.distributed as dist

from . import __version__, native
from .config import Config


def _module_version(name: str) -> str | None:
    if importlib.util.find_spec(name) is None:
        return None
    try:
        module = importlib.import_module(name)
    except Exception as exc:                 # installed but broken (missing CUDA libraries, ...)
        return f"installed, fails to import: {type(exc).__name__}: {exc}"
    return str(getattr(module, "__version__", "installed"))


def collect() -> dict[str, Any]:
    """Everything `python -m dear.info` prints, as a dict."""
    from .comm import nccl as nccl_backend

    cuda = torch.cuda.is_available()
    build = native.build_info()
    return {
        "dear": __version__,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cuda_available": cuda,
        "native": {**build, "enabled": build["available"] and Config.from_env().native},
        "backends": {
            "local": True,
            "torch": {"gloo": dist.is_available() and dist.is_gloo_available(),
                      "nccl": dist.is_available() and dist.is_nccl_available() and cuda},
            "horovod": _module_version("horovod"),
            "nccl": nccl_backend.availability(),
        },
        "nccl4py": _module_version("nccl"),
    }


def main() -> int:
    info = collect()
    if "--json" in sys.argv[1:]:
        print(json.dumps(info, indent=2))
        return 0
    nat = info["native"]
    if nat["available"]:
        parts = ["C++"] + [p for p in ("cuda", "nccl") if nat.get(p)]
        status = f"built ({', '.join(parts)})"
        if not nat["enabled"]:
            status += ", disabled by DEAR_NATIVE=0"
    else:
        status = f"not built, using the pure-Python path ({nat['error']})"
    backends = info["backends"]
    print(f"dear {info['dear']}  python {info['python']}  torch {info['torch']} "
          f"(CUDA {info['torch_cuda'] or 'none'}, GPU {'yes' if info['cuda_available'] else 'no'})")
    print(f"native extension: {status}")
    print("backends: local yes; "
          f"torch gloo {'yes' if backends['torch']['gloo'] else 'no'}, "
          f"nccl {'yes' if backends['torch']['nccl'] else 'no'}; "
          f"horovod {backends['horovod'] or 'no'}; nccl (direct) {backends['nccl']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
