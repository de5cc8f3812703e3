"""``megatron-hcp`` whose recipes train with the stand-in worker of ``_ending_target`` (each rank
records its processes and waits): ``python -m tests.unit.functional._ending_cli functional run
NAME ...`` runs the real command line, launchers and signal handling in a few seconds."""

from __future__ import annotations

import dataclasses
import sys

TARGET = "tests.unit.functional._ending_target"


def main(argv: list[str]) -> int:
    from megatron_hcp import cli
    from megatron_hcp.functional import recipe

    load = recipe.load_recipe

    def with_target(*args, **kwargs):
        return dataclasses.replace(load(*args, **kwargs), worker=TARGET)

    recipe.load_recipe = with_target
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
