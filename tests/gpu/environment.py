"""What the GPU check runs with: this interpreter, its torch, the GPUs, megatron-core,
Transformer Engine and which megatron_hcp. Installs nothing.

``python -m tests.gpu.environment`` prints one line each and ``gpus=<n>`` last; exits 2 when
torch, megatron-core or pytest does not import here (then the check cannot run in this
environment; the test extras of this package bring pytest: ``pip install -e .[test]``).
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys

__all__ = ["describe"]


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _nvidia_smi() -> str:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "nvidia-smi: not on PATH"
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30,
                             check=False)
    except (OSError, subprocess.SubprocessError) as err:
        return f"nvidia-smi: failed ({err})"
    listed = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return "nvidia-smi: " + ("; ".join(listed) if listed else
                             f"no GPU listed (exit {out.returncode}) {out.stderr.strip()}")


def describe() -> tuple[list[str], int]:
    """(lines, GPUs torch sees); raises ImportError when torch, megatron-core or pytest is
    missing."""
    lines = [f"python: {sys.executable} ({sys.version.split()[0]})"]
    import torch

    cuda = torch.version.cuda or "none (CPU build)"
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    names = sorted({torch.cuda.get_device_name(i) for i in range(gpus)})
    lines.append(f"torch: {torch.__version__} (CUDA {cuda}; {gpus} GPU(s) visible"
                 + (f": {', '.join(names)}" if names else "") + ")")
    lines.append(_nvidia_smi())
    import megatron.core

    lines.append(f"megatron-core: {_version('megatron-core') or '?'} "
                 f"({megatron.core.__path__[0]})")
    from megatron_hcp.attention.te import installed_te_version, te_unavailable_reason

    reason = te_unavailable_reason()
    lines.append("transformer-engine: " + (installed_te_version() or "?" if reason is None
                                           else f"not used ({reason})"))
    import megatron_hcp

    lines.append(f"megatron-hcp: {megatron_hcp.__path__[0]}")
    from megatron_hcp.attention.reference.gpu.fused import fused_mode, fuses

    fused = gpus and fuses(torch.device("cuda"))
    lines.append(f"CP attention merges and masks on CUDA: "
                 f"{'fused (Triton)' if fused else 'eager'} "
                 f"(MEGATRON_HCP_FUSED_OPS={fused_mode()})")
    import pytest

    lines.append(f"pytest: {pytest.__version__}")
    return lines, gpus


def main() -> int:
    try:
        lines, gpus = describe()
    except ImportError as err:
        print(f"gpu_check: {err.name or err} does not import in {sys.executable}: {err}; run "
              "from the environment that has torch, megatron-core and pytest (or set PYTHON=...)",
              file=sys.stderr)
        return 2
    print("\n".join(lines))
    print(f"gpus={gpus}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
