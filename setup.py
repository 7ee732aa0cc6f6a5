"""drbalance: fair sharing of a multi-GPU server by adaptive mini-batch redistribution."""

from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent

setup(
    name="drbalance",
    version="0.1.0",
    description="Share one multi-GPU server fairly among training jobs by re-splitting their mini-batches",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["drbalance", "drbalance.*"]),
    package_data={"drbalance.sim": ["gavel_pairs.json", "gavel_rates.json"]},
    python_requires=">=3.10",
    install_requires=["torch", "posix-ipc>=1.1", "nvidia-ml-py", "prometheus-client>=0.17"],
    extras_require={
        "examples": ["torchvision", "tqdm", "matplotlib"],
        "test": ["pytest", "numpy", "pytest-timeout", "hypothesis", "torchvision", "tqdm", "matplotlib", "ruff"],
    },
    entry_points={
        "console_scripts": [
            "drbalance=drbalance.cli:main",
            "drbalance-manager=drbalance.manager.cli:main",
        ]
    },
    classifiers=["Operating System :: POSIX :: Linux", "Programming Language :: Python :: 3"],
)
