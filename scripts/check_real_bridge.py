"""Check megatron_hcp's Bridge hook against the *real* Megatron-Bridge (not run in CI).

Needs a Python 3.12 environment with megatron-core 0.19.x and ``megatron-bridge`` installed
(``--no-deps`` plus what its training modules import: transformers, omegaconf, datasets,
megatron-energon), and this repository on PYTHONPATH. Transformer Engine cannot be installed on
CPU; Bridge's ``peft/lora_layers.py`` imports it unconditionally, so an import-only stand-in
module is put in place *after* megatron.core is imported (megatron itself keeps HAVE_TE=False).

On 4 gloo ranks (127.0.0.1) it checks, with Bridge's own code:
1. ``install()`` accepts the installed Bridge (signature check against the real functions);
2. without the hook, Bridge's ``_create_pg_collection`` raises NotImplementedError for HCP;
3. with it, the same call returns a collection whose every field (and ``hcp``) has the members
   of megatron-core's MPU path for TP1 x CP4 with hierarchical sizes [2, 2];
4. Bridge's ``install_pg_collection`` hands TE's attention (a recording stand-in class: without
   TE megatron defines it on a MagicMock) the flat CP group; the hook then gives it ``hcp``;
5. Bridge's ``load_megatron_model`` (its own ``load_model_config`` reading a run_config.yaml
   with HCP; only the final build replaced by a recorder): alone it drops the sizes for CP=4;
   hooked it restores them, keeps CP=1 without sizes and refuses CP=8 with a named error;
6. ``uninstall()`` restores Bridge's functions.

Environment used (2026-11-22, this CPU machine, ~6 GB, 10-15 min of downloads)::

    python3.12 -m venv /work/py312
    /work/py312/bin/pip install torch==2.13.0 einops megatron-core==0.19.2
    /work/py312/bin/pip install --no-deps megatron-bridge==0.6.2 nvidia-modelopt
    /work/py312/bin/pip install "transformers>=5.8,<=5.12.1" omegaconf datasets \
        megatron-energon requests pulp tensorboard

Run: ``PYTHONPATH=. /work/py312/bin/python scripts/check_real_bridge.py`` (about 4 min: each
rank imports Bridge). Result that day: PASS on all 4 ranks.
"""

from __future__ import annotations

import os
import sys
import types

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4
FIELDS = ("tp", "cp", "pp", "dp", "mp", "tp_cp", "tp_dp_cp", "dp_cp", "ep", "expt_tp",
          "tp_ep", "tp_ep_pp", "expt_dp")


def _te_import_stub() -> None:
    """``transformer_engine`` for imports only: any attribute chain resolves to a stand-in."""

    class _Meta(type):
        def __getattr__(cls, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Meta(name, (), {})

    class _Any(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            if name[:1].islower():
                sub = _Any(f"{self.__name__}.{name}")
                sub.__path__ = []
                setattr(self, name, sub)
                sys.modules.setdefault(sub.__name__, sub)
                return sub
            return _Meta(name, (), {})

    root = _Any("transformer_engine")
    root.__path__ = []
    root.__version__ = "0.0.0+stub"
    sys.modules.setdefault("transformer_engine", root)
    for name in ("pytorch", "common", "common.recipe"):
        module = root
        for part in name.split("."):
            module = getattr(module, part)


def _members(group):
    return dist.get_process_group_ranks(group) if group is not None else None


def rank_main(rank: int, port: int, out) -> None:
    try:
        _rank_main(rank, port, out)
    except BaseException:
        import traceback

        out.put((rank, {"error": traceback.format_exc()}))
        raise


def _rank_main(rank: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    # before the TE stand-in, so megatron (and its TE extension) keep HAVE_TE=False
    import megatron.core  # noqa: F401
    import megatron.core.extensions.transformer_engine  # noqa: F401
    from megatron.core import parallel_state as ps

    _te_import_stub()
    from megatron.bridge.models.gpt_provider import GPTModelProvider
    from megatron.bridge.training import eval_context_parallel_rebinding as rebinding
    from megatron.bridge.training import initialize

    from megatron_hcp.bridge.hook import install, installed, uninstall
    from megatron_hcp.parallel_state.mpu import mpu_groups_by_field

    report = {}
    cfg = GPTModelProvider(num_layers=2, hidden_size=64, num_attention_heads=4,
                           context_parallel_size=4, cp_comm_type="a2a+p2p",
                           hierarchical_context_parallel_sizes=[2, 2])
    original = initialize._create_pg_collection
    try:
        original(cfg, 1)
        report["bridge_alone"] = "no error"
    except NotImplementedError as err:
        report["bridge_alone"] = f"NotImplementedError: {str(err)[:60]}..."
    install()
    report["installed"] = installed()
    pgc = initialize._create_pg_collection(cfg, 1)
    ps.initialize_model_parallel(context_parallel_size=4,
                                 hierarchical_context_parallel_sizes=[2, 2])
    mpu = mpu_groups_by_field()
    diffs = [(f, _members(getattr(pgc, f)), _members(mpu[f])) for f in FIELDS
             if sorted(_members(getattr(pgc, f))) != sorted(_members(mpu[f]))]
    theirs = ps.get_hierarchical_context_parallel_groups()
    diffs += [(f"hcp{i}", _members(pgc.hcp[i]), _members(theirs[i])) for i in range(2)
              if _members(pgc.hcp[i]) != _members(theirs[i])]
    report["collection_diffs"] = diffs
    report["hcp"] = [_members(g) for g in pgc.hcp]
    report["flat"] = _members(pgc.cp)

    # megatron without TE defines TEDotProductAttention on a MagicMock (not a type), which
    # Bridge's install_pg_collection cannot isinstance-check: stand in TE's attention class only
    from megatron.core.extensions import transformer_engine as te_ext

    class Recording(torch.nn.Module):
        cp_stream = object()

        def __init__(self):
            super().__init__()
            self.cp_comm_type = "a2a+p2p"
            self.calls = []

        def set_context_parallel_group(self, group, ranks, stream, comm="p2p"):
            self.calls.append(([_members(g) for g in group] if isinstance(group, list)
                               else _members(group), ranks, comm))

    te_ext.TEDotProductAttention = Recording
    model = torch.nn.Sequential(Recording())
    rebinding.install_pg_collection(model, pgc)
    report["install_pg_collection_calls"] = model[0].calls
    report["load"] = _check_load(install, uninstall)  # collective: Bridge broadcasts the config
    uninstall()
    report["restored"] = initialize._create_pg_collection is original and not installed()
    out.put((rank, report))
    dist.barrier()
    dist.destroy_process_group()


def _check_load(install, uninstall) -> dict:
    """Bridge's real load_megatron_model + load_model_config on a run_config.yaml with HCP;
    the final build is replaced by a recorder of the config it would build from."""
    import tempfile
    from pathlib import Path

    import yaml
    from megatron.bridge.training import model_load_save as mls

    from megatron_hcp.config import CPConfigError

    out = {}
    with tempfile.TemporaryDirectory() as tmp:  # per rank; Bridge reads it on rank 0
        (Path(tmp) / "run_config.yaml").write_text(yaml.safe_dump({"model": {
            "_target_": "megatron.bridge.models.gpt_provider.GPTModelProvider",
            "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
            "context_parallel_size": 4, "cp_comm_type": "a2a+p2p",
            "hierarchical_context_parallel_sizes": [2, 2]}}))
        build = mls.build_and_load_model
        mls.build_and_load_model = lambda path, cfg, *a, **k: cfg
        try:
            def sizes(**overrides):
                try:
                    cfg = mls.load_megatron_model(tmp, mp_overrides=overrides or None)
                    return (cfg.context_parallel_size, cfg.hierarchical_context_parallel_sizes)
                except CPConfigError as err:
                    return f"CPConfigError: {str(err).splitlines()[0][:70]}"

            out["hooked_cp4"] = sizes(context_parallel_size=4)
            out["hooked_cp1"] = sizes()
            out["hooked_cp8"] = sizes(context_parallel_size=8)
            uninstall()
            out["bridge_alone_cp4"] = sizes(context_parallel_size=4)
            install()
        finally:
            mls.build_and_load_model = build
    return out


def main() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, port, out)) for r in range(WORLD)]
    for p in procs:
        p.start()
    reports = dict(out.get(timeout=900) for _ in procs)
    for p in procs:
        p.join()
    ok = True
    for rank in sorted(reports):
        r = reports[rank]
        print(f"rank {rank}: {r}")
        if "error" in r:
            ok = False
            continue
        ok &= (r["bridge_alone"].startswith("NotImplementedError") and r["installed"]
               and not r["collection_diffs"] and r["restored"]
               # Bridge's flat rebinding, then the hook's hierarchical groups
               and [c[0] for c in r["install_pg_collection_calls"]] == [r["flat"], r["hcp"]])
        load = r["load"]
        ok &= (load["hooked_cp4"] == (4, [2, 2]) and load["hooked_cp1"] == (1, None)
                   and str(load["hooked_cp8"]).startswith("CPConfigError")
                   and load["bridge_alone_cp4"] == (4, None))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
