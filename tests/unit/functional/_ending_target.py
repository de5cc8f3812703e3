"""A recipe worker's stand-in for the tests of how a run ends (``main(argv)`` like a recipe
worker's; the recipe's arguments are ignored). ``$ENDING_TARGET_MODE``:

* ``wait`` (default): each rank starts a child process of its own, records its pid, its
  parent's, the child's and its torchinductor cache folder in ``$ENDING_TARGET_DIR/rank<N>``,
  then waits;
* ``fail``: every rank joins a gloo group; ranks 1 and 3 fail deep inside a call (an ENOSPC
  wrapped in a RuntimeError), the others print 60 lines and wait to be ended.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _record(folder: Path, rank: str) -> None:
    child = subprocess.Popen(["sleep", "600"])  # in this rank's process group
    record = folder / f"rank{rank}"
    part = record.with_suffix(".part")
    part.write_text(json.dumps({"pid": os.getpid(), "parent": os.getppid(), "child": child.pid,
                                "inductor": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}))
    part.rename(record)


def _deep(depth: int, rank: int) -> None:
    if depth == 0:
        raise OSError(errno.ENOSPC, "No space left on device", f"/full/rank{rank}.bin")
    _deep(depth - 1, rank)


def _fail() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")  # after this, torch prefixes a rank's traceback lines
    rank = dist.get_rank()
    dist.barrier()  # ranks 1 and 3 fail together, before the launcher ends the others
    if rank in (1, 3):
        try:
            _deep(30, rank)
        except OSError as err:
            raise RuntimeError(f"rank {rank} could not save") from err
    for i in range(60):
        print(f"rank {rank} noise line {i}", flush=True)


def main(argv: list[str]) -> int:
    if os.environ.get("ENDING_TARGET_MODE") == "fail":
        _fail()
    else:
        _record(Path(os.environ["ENDING_TARGET_DIR"]), os.environ["RANK"])
    print(f"rank {os.environ['RANK']} waiting", flush=True)
    time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
