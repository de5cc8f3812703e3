"""megatron-hcp: complete and trustworthy context parallelism for megatron-core."""

import shutil
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
# shipped as package data under megatron_hcp/_data/ (the source tree keeps megatron's layout)
DATA_DIRS = {"recipes": HERE / "tests" / "functional" / "test_cases", "patches": HERE / "patches"}


class BuildPyWithData(build_py):
    """build_py, plus the functional recipes and the fork-style diffs as package data."""

    def run(self):
        super().run()
        # an editable install reads them from the source tree
        if getattr(self, "editable_mode", False):
            return
        for name, src in DATA_DIRS.items():
            dst = Path(self.build_lib) / "megatron_hcp" / "_data" / name
            shutil.rmtree(dst, ignore_errors=True)
            shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.py", "__pycache__"))


setup(
    name="megatron-hcp",
    version="0.1.0",
    description=(
        "Hierarchical (a2a+p2p) and dynamic context parallelism for NVIDIA megatron-core, "
        "with a pure-PyTorch CP attention backend and CPU/gloo runtime"
    ),
    packages=find_packages(include=["megatron_hcp", "megatron_hcp.*"]),
    # the planner's published calibration set (megatron_hcp/planner/calibration/published.yaml)
    package_data={"megatron_hcp.planner.calibration": ["published.yaml"]},
    python_requires=">=3.11",
    install_requires=[
        "torch>=2.6",
        # Tested: 0.16.1 (the last release for Python 3.11) and 0.19.2 (Python 3.12); see README
        # "Supported versions". Patches refuse, at run time, versions they were not written for.
        "megatron-core>=0.16.1,<0.17; python_version < '3.12'",
        "megatron-core>=0.16.1,<0.20; python_version >= '3.12'",
        "packaging",
        "einops",
        "numpy",
        "pyyaml",
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "hypothesis", "ruff", "matplotlib"],
        # Transformer Engine needs CUDA; NVIDIA apex is detected at run time only and never listed
        # (the PyPI package named "apex" is an unrelated project).
        "te": ["transformer-engine[pytorch]>=1.12"],
        # Bridge 0.6 needs Python 3.12; its CUDA-only requirements (fast-hadamard-transform,
        # flashinfer, ...) do not build without CUDA: on CPU install it with --no-deps (see
        # scripts/setup_env.sh).
        "bridge": ["megatron-bridge>=0.6.2,<0.7; python_version >= '3.12'"],
    },
    cmdclass={"build_py": BuildPyWithData},
    entry_points={"console_scripts": ["megatron-hcp=megatron_hcp.cli:main"]},
)
