"""drbalance: fair sharing of a multi-GPU server by adaptive mini-batch redistribution."""

import re
from pathlib import Path

from setuptools import find_packages, setup

ROOT = Path(__file__).parent
# The one place for the version is drbalance/__init__.py; read it as text (importing the package
# at build time would need its dependencies installed first).
VERSION = re.search(r'^__version__ = "([^"]+)"$', (ROOT / "drbalance" / "__init__.py").read_text(encoding="utf-8"),
                    re.MULTILINE).group(1)

LIGHTNING = "lightning>=2.6"  # drbalance.integrations.lightning
ACCELERATE = "accelerate>=1.16"  # drbalance.integrations.accelerate

setup(
    name="drbalance",
    version=VERSION,
    description="Share one multi-GPU server fairly among training jobs by re-splitting their mini-batches",
    long_description=(ROOT / "README.md").read_text(encoding="utf-8"),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["drbalance", "drbalance.*"]),
    package_data={"drbalance.sim": ["gavel_pairs.json", "gavel_rates.json"]},
    python_requires=">=3.10",
    install_requires=["torch", "posix-ipc>=1.1", "nvidia-ml-py", "prometheus-client>=0.17", "tqdm", "numpy", "scipy"],
    # lightning and accelerate: the versions the integrations were built and tested with (docs/integrations.md)
    extras_require={
        "examples": ["torchvision", "matplotlib"],
        "lightning": [LIGHTNING],
        "accelerate": [ACCELERATE],
        "test": ["pytest", "pytest-xdist", "numpy", "pytest-timeout", "hypothesis", "torchvision", "matplotlib",
                 "ruff", LIGHTNING, ACCELERATE],
    },
    entry_points={
        "console_scripts": [
            "drbalance=drbalance.cli:main",
            "drbalance-manager=drbalance.manager.cli:main",
        ]
    },
    classifiers=["Operating System :: POSIX :: Linux", "Programming Language :: Python :: 3"],
)
