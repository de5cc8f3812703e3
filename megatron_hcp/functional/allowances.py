"""What the caller of a recipe run explicitly allowed beyond a recipe's defaults.

A recipe is trusted like a script, with two doors shut unless the person starting the run opens
them on the command line (never the recipe itself): loader variables in ``ENV_VARS``
(``--allow-env NAME``) and a ``BRIDGE.recipe`` function outside Bridge's and the project's
recipe modules (``--allow-recipe-module MODULE``). The launcher hands the same allowances to
every rank, which loads the recipe again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Allowed", "add_arguments", "from_arguments"]


@dataclass(frozen=True)
class Allowed:
    """Loader variables and recipe-function modules a recipe may use (default: none)."""

    env: tuple[str, ...] = ()
    recipe_modules: tuple[str, ...] = ()

    @classmethod
    def of(cls, env: Iterable[str] = (), recipe_modules: Iterable[str] = ()) -> Allowed:
        return cls(tuple(env), tuple(recipe_modules))

    def worker_flags(self) -> list[str]:
        """The flags that hand these allowances to a rank's worker (:func:`add_arguments`)."""
        return ([arg for name in self.env for arg in ("--allow-env", name)]
                + [arg for name in self.recipe_modules
                   for arg in ("--allow-recipe-module", name)])


def add_arguments(parser) -> None:
    """``--allow-env NAME`` and ``--allow-recipe-module MODULE`` (repeatable) on ``parser``."""
    parser.add_argument("--allow-env", action="append", default=[], metavar="NAME",
                        help="let the recipe's ENV_VARS set this loader variable (e.g. "
                             "LD_PRELOAD)")
    parser.add_argument("--allow-recipe-module", action="append", default=[], metavar="MODULE",
                        help="let a BRIDGE recipe name a function of this module (by default "
                             "only megatron.bridge.recipes.*, megatron_hcp.bridge.recipes and "
                             "megatron_hcp.bridge.family_recipes)")


def from_arguments(args) -> Allowed:
    """The allowances an argparse namespace of :func:`add_arguments` holds."""
    return Allowed.of(args.allow_env, args.allow_recipe_module)
