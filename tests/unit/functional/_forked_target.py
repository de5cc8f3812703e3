"""A worker module for the forkserver launcher's tests: ``main(argv)`` like a recipe worker's."""

from __future__ import annotations

import os
import sys
import time


def prefork(argv: list[str]) -> None:
    """Runs once, in the process the ranks are forked from."""
    os.environ["PREFORK_PID"] = str(os.getpid())
    if argv[0] == "fail-prefork":
        raise RuntimeError("prefork planted")


def main(argv: list[str]) -> int:
    import torch
    import torch.distributed as dist

    action = argv[0]
    if action == "sleep":
        print(f"pid={os.getpid()}", flush=True)
        time.sleep(float(argv[1]))
        return 0
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    print(f"rank={rank} world={dist.get_world_size()} local={os.environ['LOCAL_RANK']} "
          f"addr={os.environ['MASTER_ADDR']} cuda={os.environ.get('CUDA_VISIBLE_DEVICES')!r} "
          f"threads={torch.get_num_threads()} argv={sys.argv[1:]}", flush=True)
    print(f"prefork={os.environ['PREFORK_PID']} pid={os.getpid()}", flush=True)
    if action == "fail-on" and rank == int(argv[1]):
        raise ValueError(f"rank {rank} planted")
    dist.barrier()  # a failed rank never joins: the others wait until the launcher stops them
    total = torch.tensor([float(rank)])
    dist.all_reduce(total)
    print(f"sum={total.item():g}", flush=True)
    dist.destroy_process_group()
    return 3 if action == "exit-3" else 0
