from setuptools import find_packages, setup

setup(
    name="dear",
    version="0.1.0",
    description="Decoupled all-reduce for data-parallel PyTorch training (DeAR, ICDCS 2023)",
    packages=find_packages(include=["dear", "dear.*"]),
    package_data={"dear": ["py.typed"]},
    python_requires=">=3.10",
    install_requires=["torch>=2.2", "numpy"],
    extras_require={
        "dev": ["pytest>=7", "pytest-timeout", "matplotlib", "tqdm"],
        "bench": ["matplotlib", "tqdm"],
    },
)
