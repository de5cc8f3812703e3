"""A broken Transformer Engine is reported (logged for auto, raised for backend="te"), and a
recipe's ENV_VARS cannot set loader variables unless explicitly allowed."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest

from megatron_hcp import cli
from megatron_hcp.attention.module import TEUnavailableError, core_attention_class, have_te
from megatron_hcp.config import CPConfigError
from megatron_hcp.functional.recipe import RECIPES_DIR, load_recipe


def test_backend_te_without_te_raises_the_reason():
    if have_te():
        pytest.skip("Transformer Engine is installed here")
    with pytest.raises(TEUnavailableError, match="not installed"):
        core_attention_class("te")


class _BrokenTE:
    """Import hook: megatron's TE extension fails to import as with a missing CUDA library."""

    NAME = "megatron.core.extensions.transformer_engine"

    def find_spec(self, name, path=None, target=None):
        if name == self.NAME:
            raise OSError("libcudart.so.12: cannot open shared object file")
        return None


@pytest.fixture
def broken_te(monkeypatch):
    import megatron.core.extensions as extensions

    monkeypatch.delitem(sys.modules, _BrokenTE.NAME, raising=False)
    monkeypatch.delattr(extensions, "transformer_engine", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenTE(), *sys.meta_path])


def test_a_broken_te_install_is_logged_and_raised(broken_te, caplog):
    from megatron_hcp.attention.module import ReferenceCPAttention

    with caplog.at_level(logging.WARNING, logger="megatron_hcp"):
        assert core_attention_class("auto") is ReferenceCPAttention
    assert "Transformer Engine is unusable" in caplog.text and "libcudart.so.12" in caplog.text
    with pytest.raises(TEUnavailableError, match="OSError: libcudart.so.12"):
        core_attention_class("te")


def recipe_with_env(tmp_path: Path, env_yaml: str) -> Path:
    text = (RECIPES_DIR / "gpt3_mcore_tp1_pp1_cp4_p2p" / "model_config.yaml").read_text()
    (tmp_path / "model_config.yaml").write_text(text.replace("ENV_VARS: {}", env_yaml))
    return tmp_path


@pytest.mark.parametrize("env_yaml, parameter", [
    ("ENV_VARS: {LD_PRELOAD: /tmp/evil.so}", "ENV_VARS.LD_PRELOAD"),
    ("ENV_VARS: {PYTHONPATH: /tmp/evil}", "ENV_VARS.PYTHONPATH"),
    ("ENV_VARS: {DYLD_INSERT_LIBRARIES: x}", "ENV_VARS.DYLD_INSERT_LIBRARIES"),
    ("ENV_VARS: {'BAD NAME': 1}", "ENV_VARS"),
    ("ENV_VARS: [1, 2]", "ENV_VARS"),
])
def test_loader_variables_are_refused(tmp_path, env_yaml, parameter):
    with pytest.raises(CPConfigError) as info:
        load_recipe(recipe_with_env(tmp_path, env_yaml))
    assert parameter in {v.parameter for v in info.value.violations}


def test_loader_variables_pass_when_allowed_and_plain_ones_always(tmp_path):
    path = recipe_with_env(tmp_path, "ENV_VARS: {LD_PRELOAD: /x.so, CUBLAS_WORKSPACE_CONFIG: "
                                     "':4096:8', NCCL_DEBUG: 'INFO'}")
    recipe = load_recipe(path, allow_env=["LD_PRELOAD"])
    assert recipe.env == {"LD_PRELOAD": "/x.so", "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
                          "NCCL_DEBUG": "INFO"}


def test_cli_refuses_before_starting_ranks(tmp_path, capsys):
    path = recipe_with_env(tmp_path, "ENV_VARS: {LD_PRELOAD: /tmp/evil.so}")
    assert cli.parse_and_check(["functional", "run", str(path)]) == 2
    err = capsys.readouterr().err
    assert "ENV_VARS.LD_PRELOAD" in err and "--allow-env LD_PRELOAD" in err
    args = cli.parse_and_check(["functional", "run", str(path), "--allow-env", "LD_PRELOAD"])
    assert args.checked[0].env["LD_PRELOAD"] == "/tmp/evil.so"
