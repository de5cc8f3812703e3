"""How ``functional run`` starts the ranks: torchrun's node flags and the platform.

Defaults keep everything on one machine: one node, rendezvous on 127.0.0.1, a free port
chosen by torchrun. Several nodes use torchrun's static rendezvous (``--nnodes``,
``--node-rank``, ``--master-addr``, ``--master-port``); every node runs the same command, and
node 0 (which holds rank 0) checks the results.

The platform names the golden file (``golden_values_dev_<platform>.json``) and the backend:
``cpu_gloo`` (gloo, CPU) or ``gpu_nccl`` (NCCL, CUDA: each rank on GPU ``LOCAL_RANK``, TE
attention where TE imports). Only ``cpu_gloo`` has run here (no GPU): the ``gpu_nccl`` path is
written against torch's and megatron's APIs and not verified.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

__all__ = ["BACKENDS", "LAUNCHERS", "MAX_RANKS_PER_NODE", "Launch", "LaunchError", "PLATFORMS",
           "default_platform", "detect_platform", "init_rank_process_group", "require_runnable"]

BACKENDS = {"cpu_gloo": "gloo", "gpu_nccl": "nccl"}
MAX_RANKS_PER_NODE = 64  # processes torchrun starts on one node
PLATFORMS = tuple(BACKENDS)
# torchrun: fresh interpreters (any node layout, any platform); forkserver: ranks forked from
# a process that has imported torch and megatron-core (one CPU node; see functional.forked)
LAUNCHERS = ("torchrun", "forkserver")


class LaunchError(ValueError):
    """Launch settings that cannot work (one line: parameter, value, rule, fix)."""


def detect_platform() -> str:
    """``gpu_nccl`` when CUDA devices and NCCL are available, else ``cpu_gloo``."""
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available() and dist.is_nccl_available():
        return "gpu_nccl"
    return "cpu_gloo"


def default_platform() -> str:
    """The detected platform: ``gpu_nccl`` on a machine with CUDA devices and NCCL."""
    return detect_platform()


def require_runnable(platform: str) -> None:
    """Refuse, in one line, a platform this machine cannot run (before any rank starts)."""
    if platform not in BACKENDS:
        raise LaunchError(f"--platform {platform}: must be one of {', '.join(PLATFORMS)}; "
                          "pass one of them")
    if platform == "gpu_nccl" and detect_platform() != "gpu_nccl":
        raise LaunchError("--platform gpu_nccl: this machine has no CUDA device with NCCL "
                          "(torch.cuda.is_available() is False); pass --platform cpu_gloo")


_HOST_LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def init_rank_process_group(platform: str) -> None:
    """A recipe rank's default process group for ``platform`` (torchrun's environment); a gloo
    rank first makes its groups share one transport device
    (:mod:`megatron_hcp.harness.gloo_device`)."""
    import torch.distributed as dist

    if BACKENDS[platform] == "gloo":
        from ..harness.gloo_device import share_gloo_device

        share_gloo_device()
    dist.init_process_group(BACKENDS[platform])


def _valid_address(addr: str) -> bool:
    """An IP address, or a host name of ASCII labels (RFC 1123), at most 253 characters."""
    try:
        ipaddress.ip_address(addr)
        return True
    except ValueError:
        pass
    return 0 < len(addr) <= 253 and all(_HOST_LABEL.fullmatch(label)
                                        for label in addr.rstrip(".").split("."))


@dataclass(frozen=True)
class Launch:
    """Node layout and rendezvous of one recipe launch (``master_port=None``: a free port)."""

    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    platform: str = "cpu_gloo"
    launcher: str = "torchrun"

    @property
    def backend(self) -> str:
        return BACKENDS[self.platform]

    @property
    def checks_results(self) -> bool:
        """Only the node holding rank 0 gets the metrics."""
        return self.node_rank == 0

    def validate(self, nproc: int) -> None:
        """Raise :class:`LaunchError` for settings torchrun would refuse or hang on."""
        if self.platform not in BACKENDS:
            raise LaunchError(f"--platform {self.platform}: must be one of "
                              f"{', '.join(PLATFORMS)}; pass one of them")
        if self.launcher not in LAUNCHERS:
            raise LaunchError(f"--launcher {self.launcher}: must be one of "
                              f"{', '.join(LAUNCHERS)}; pass one of them")
        if self.launcher == "forkserver" and (self.platform != "cpu_gloo" or self.nnodes != 1
                                              or self.master_port is not None):
            raise LaunchError(
                f"--launcher forkserver with --platform {self.platform}, --nnodes "
                f"{self.nnodes}, --master-port {self.master_port}: forked ranks run on one "
                "CPU node (cpu_gloo, --nnodes 1, a port of their own; a forked process cannot "
                "initialize CUDA); use --launcher torchrun")
        if self.nnodes < 1 or nproc % self.nnodes:
            raise LaunchError(f"--nnodes {self.nnodes}: must divide the recipe's {nproc} ranks; "
                              f"use a divisor of {nproc}")
        if nproc // self.nnodes > MAX_RANKS_PER_NODE:
            raise LaunchError(f"the recipe's {nproc} ranks on --nnodes {self.nnodes} would "
                              f"start {nproc // self.nnodes} processes per node, over the limit "
                              f"of {MAX_RANKS_PER_NODE}; use more nodes or a smaller NPROC")
        if not 0 <= self.node_rank < self.nnodes:
            raise LaunchError(f"--node-rank {self.node_rank}: must be in 0..{self.nnodes - 1} "
                              f"(--nnodes {self.nnodes}); give this node's index")
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise LaunchError(f"--master-port {self.master_port}: must be in 1..65535; pick a "
                              "free port on the master node")
        if self.nnodes > 1 and self.master_port is None:
            raise LaunchError(f"--master-port: required with --nnodes {self.nnodes} (every node "
                              "must meet on the same port); pass e.g. --master-port 29500")
        if not _valid_address(self.master_addr):
            shown = self.master_addr if len(self.master_addr) <= 60 else (
                self.master_addr[:57] + "...")
            raise LaunchError(f"--master-addr {shown!r}: must be an IP address or a host name "
                              "(ASCII letters, digits, '-' and '.'); give node 0's address")
        if self.nnodes > 1 and self.master_addr in ("127.0.0.1", "localhost"):
            raise LaunchError(f"--master-addr {self.master_addr}: with --nnodes {self.nnodes} "
                              "the other nodes cannot reach a loopback address; pass node 0's "
                              "address")

    def torchrun_args(self, nproc: int) -> list[str]:
        """torchrun's flags for ``nproc`` ranks in all (validated first)."""
        self.validate(nproc)
        args = [f"--nnodes={self.nnodes}", f"--nproc-per-node={nproc // self.nnodes}"]
        if self.nnodes == 1 and self.master_port is None:
            return args + ["--rdzv-backend=c10d", f"--rdzv-endpoint={self.master_addr}:0"]
        return args + [f"--node-rank={self.node_rank}", f"--master-addr={self.master_addr}",
                       f"--master-port={self.master_port}"]
