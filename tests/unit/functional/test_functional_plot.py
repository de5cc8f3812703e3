"""`functional run/compare --plot`: the PNG of a recipe check (synthetic curves, no ranks)."""

from __future__ import annotations

import pytest

from megatron_hcp.cli import main
from megatron_hcp.functional.harness import RecipeResult
from megatron_hcp.functional.plot import plot_result

PNG = b"\x89PNG\r\n\x1a\n"


def _result(**kw) -> RecipeResult:
    loss = {s: 4.8 - 0.1 * s for s in range(1, 11)}
    return RecipeResult("recipe_x", 10, True, loss=loss, golden_loss=dict(loss),
                        cp1_loss={s: v + 1e-6 for s, v in loss.items()}, **kw)


def test_plot_writes_a_png_per_recipe(tmp_path):
    plain = plot_result(_result(), tmp_path / "plots")
    assert plain == tmp_path / "plots" / "recipe_x.png"
    assert plain.read_bytes()[:8] == PNG and plain.stat().st_size > 5000
    size = plain.stat().st_size
    resumed = plot_result(_result(resume_step=5, resumed_loss={s: 4.8 - 0.1 * s
                                                               for s in range(6, 11)}), tmp_path)
    # the resumed curve and the resume-point line are drawn: a different, larger picture
    assert resumed.read_bytes()[:8] == PNG and resumed.stat().st_size != size


def test_plot_refuses_a_result_without_loss(tmp_path):
    with pytest.raises(ValueError, match="no lm loss values"):
        plot_result(RecipeResult("empty", 3, False), tmp_path)
    assert not (tmp_path / "empty.png").exists()


def test_plot_flag_is_parsed_before_anything_runs(capsys):
    # a bad recipe name is refused before any rank starts, with --plot accepted as an option
    assert main(["functional", "run", "no_such_recipe", "--plot", "/tmp/x"]) == 2
    assert "no_such_recipe" in capsys.readouterr().err
