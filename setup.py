"""megatron-hcp: complete and trustworthy context parallelism for megatron-core."""

from setuptools import find_packages, setup

setup(
    name="megatron-hcp",
    version="0.1.0",
    description=(
        "Hierarchical (a2a+p2p) and dynamic context parallelism for NVIDIA megatron-core, "
        "with a pure-PyTorch CP attention backend and CPU/gloo runtime"
    ),
    packages=find_packages(include=["megatron_hcp", "megatron_hcp.*"]),
    python_requires=">=3.11",
    install_requires=[
        "torch>=2.6",
        # Only 0.16.x is tested (the last release for Python 3.11); see README "Supported versions".
        "megatron-core>=0.16.1,<0.17",
        "einops",
        "numpy",
        "pyyaml",
    ],
    extras_require={
        "test": ["pytest", "pytest-xdist", "hypothesis", "ruff", "matplotlib"],
        # Transformer Engine needs CUDA; NVIDIA apex is detected at run time only and never listed
        # (the PyPI package named "apex" is an unrelated project).
        "te": ["transformer-engine[pytorch]>=1.12"],
        "bridge": ["megatron-bridge"],
    },
    entry_points={"console_scripts": ["megatron-hcp=megatron_hcp.cli:main"]},
)
