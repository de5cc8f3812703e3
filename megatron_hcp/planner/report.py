"""Ranking, the "why" sentences, megatron flags / Bridge overrides, table, JSON and plot."""

from __future__ import annotations

from pathlib import Path

from ..files.atomic_write import save_figure
from .estimate import Estimate, Layout

__all__ = ["bridge_overrides", "dominant", "flag_notes", "megatron_flags", "plot_breakdown",
           "rank", "table", "why"]

GB = 1e9
#: two layouts whose memory differs by less than this are "equal memory" in the tie rule
MEMORY_EQUAL_BYTES = 1e9
PARTS = ("compute", "cp", "tp", "pp_bubble", "dp")


def rank(estimates: list[Estimate], tie_tolerance: float) -> list[Estimate]:
    """Fitting layouts first, then those that do not fit (each group by the rule below).

    Repeatedly: of the layouts left, those within ``tie_tolerance`` of the fastest are a tie
    (below the projection's resolution); the one using the least memory per GPU wins it (more
    headroom: the Bridge page's reason to prefer TP2 CP4 a2a over TP1 CP16 a2a+p2p at equal
    throughput); at equal memory (within 1 GB) the faster. A layout promoted over a faster one
    records it in ``detail["tie_over"]``.
    """
    out: list[Estimate] = []
    for group in ([e for e in estimates if e.fits], [e for e in estimates if not e.fits]):
        left = sorted(group, key=lambda e: (e.step_seconds, e.layout.label))
        while left:
            fastest = left[0]
            window = [e for e in left
                      if e.step_seconds <= fastest.step_seconds * (1 + tie_tolerance)]
            least = min(e.memory["total"] for e in window)
            pick = next(e for e in window if e.memory["total"] <= least + MEMORY_EQUAL_BYTES)
            if pick is not fastest:
                pick.detail["tie_over"] = fastest
            out.append(pick)
            left.remove(pick)
    return out


def _where(crosses: bool) -> str:
    return "across nodes" if crosses else "inside a node"


def describe(part: str, e: Estimate) -> str:
    """What a breakdown entry is, for this layout (e.g. "a2a over 4 ranks inside a node")."""
    lay, d = e.layout, e.detail
    if part == "cp":
        if lay.dynamic:
            sizes = ", ".join(f"{k}x{v}" for k, v in d.get("group_sizes", {}).items())
            return f"dynamic-CP ring traffic (group size x sequences: {sizes})"
        if lay.cp_comm_type == "a2a+p2p":
            a, p = lay.hcp or (1, 1)
            return (f"a2a over {a} ranks {_where(d['a2a_crosses_nodes'])} plus the ring over "
                    f"{p} {_where(d['p2p_crosses_nodes'])}")
        kind = "the ring" if lay.cp_comm_type == "p2p" else lay.cp_comm_type
        return f"{kind} over {lay.cp} ranks {_where(d['cp_crosses_nodes'])}"
    if part == "tp":
        return f"TP{lay.tp} all-gathers/reduce-scatters {_where(d['tp_crosses_nodes'])}"
    if part == "dp":
        return f"the gradient reduction over DPxCP={d['dp_cp_size']} ranks"
    if part == "pp_bubble":
        return f"the PP{lay.pp} bubble over {e.micro_batches} micro-batches"
    return "compute"


def dominant(e: Estimate) -> str:
    """The largest cost other than compute (or compute when nothing else costs anything)."""
    part = max(PARTS[1:], key=lambda p: e.breakdown[p])
    return part if e.breakdown[part] > 0 else "compute"


def _share(e: Estimate, part: str) -> float:
    return 100 * e.breakdown[part] / e.step_seconds


def _kind(e: Estimate) -> str:
    lay = e.layout
    if lay.dynamic:
        return "dynamic-CP"
    return "no-CP" if lay.cp == 1 else str(lay.cp_comm_type)


def why(e: Estimate, winner: Estimate, usable: float,
        contrast: tuple[int, Estimate] | None = None) -> str:
    """One sentence on a layout's place in the ranking; for the winner, ``contrast`` (rank,
    layout) is the best layout of another CP kind, whose dominant cost is named."""
    lay = e.layout
    mem = e.memory["total"] / GB
    overheads = [p for p in PARTS[1:] if e.breakdown[p] > 0]
    costs = ", ".join(f"{describe(p, e)} costs {_share(e, p):.1f} %" for p in
                      sorted(overheads, key=lambda p: -e.breakdown[p])[:2]) or \
        "no exposed communication"
    fit = (f"{mem:.1f} of {usable / GB:.0f} GB usable per GPU"
           + ("" if e.fits else " - DOES NOT FIT"))
    recompute = "" if e.recompute == "selective" else " with full recompute"
    if e is winner:
        text = (f"{lay.label}{recompute}: {e.step_seconds:.3g} s/step; {costs} of the step; "
                f"{fit}")
        other = e.detail.get("tie_over")
        if other is not None:
            slower = 100 * (e.step_seconds / other.step_seconds - 1)
            text += (f"; it is {slower:.1f} % slower than the fastest ({other.layout.label}), "
                     f"inside the tie tolerance, and leaves "
                     f"{(other.memory['total'] - e.memory['total']) / GB:.1f} GB more free per GPU")
        if contrast is not None:
            pos, alt = contrast
            part = dominant(alt)
            text += (f"; the best {_kind(alt)} layout (#{pos}, {alt.layout.label}) is "
                     f"{100 * (alt.step_seconds / e.step_seconds - 1):.1f} % slower"
                     + (f", {describe(part, alt)} costing it {_share(alt, part):.1f} %"
                        if part != "compute" else ""))
        return text + "."
    delta = 100 * (e.step_seconds / winner.step_seconds - 1)
    part = dominant(e)
    verb = "slower" if delta >= 0 else "faster"
    text = (f"{lay.label}{recompute}: {abs(delta):.1f} % {verb} than the winner; {costs} of the "
            f"step; {fit}")
    if part != "compute" and e.breakdown[part] > winner.breakdown[part]:
        text += (f" (the winner's {part} share is {_share(winner, part):.1f} %)")
    if delta < 0 and e.fits:
        text += (f"; ranked below it because it needs "
                 f"{(e.memory['total'] - winner.memory['total']) / GB:.1f} GB more per GPU "
                 f"within the tie tolerance")
    other = e.detail.get("tie_over")
    if other is not None and other is not winner:
        text += (f"; ranked above the {100 * (e.step_seconds / other.step_seconds - 1):.1f} % "
                 f"faster {other.layout.label} (a tie) for "
                 f"{(other.memory['total'] - e.memory['total']) / GB:.1f} GB less per GPU")
    return text + "."


def flag_notes(e: Estimate) -> list[str]:
    """What the winner's flags need beyond themselves."""
    lay, notes = e.layout, []
    if lay.hcp:
        notes.append("a2a+p2p needs Transformer Engine >= 1.12; on Megatron-Bridge it runs on "
                     "the MPU path (dist.use_decentralized_pg=False), or decentralized with "
                     "megatron_hcp.bridge.install()")
    if lay.dynamic:
        notes.append("the flags are the recipes' (megatron_hcp's dynamic-CP runtime, "
                     "patching.apply_dynamic_cp()); released megatron-core (0.16.1, 0.19.2) and "
                     "Bridge name the switch hybrid_context_parallel and have no minimum group "
                     "size field (min_dynamic_context_parallel_size is megatron_hcp's)")
    return notes


def _batch_flags(lay: Layout, global_batch: int) -> list[str]:
    flags = ["--micro-batch-size", "1", "--global-batch-size", str(global_batch)]
    if lay.seq_length is not None:
        flags = ["--seq-length", str(lay.seq_length)] + flags
    return flags


def megatron_flags(e: Estimate, global_batch: int, distributed_optimizer: bool,
                   tp_comm_overlap: bool, precision: str = "bf16", fsdp: bool = False,
                   grad_reduce_in_bf16: bool = False) -> list[str]:
    lay = e.layout
    flags = ["--tensor-model-parallel-size", str(lay.tp),
             "--pipeline-model-parallel-size", str(lay.pp),
             "--context-parallel-size", str(lay.cp)]
    if lay.cp_comm_type is not None and lay.cp > 1 or lay.dynamic:
        flags += ["--cp-comm-type", str(lay.cp_comm_type)]
    if lay.hcp:
        flags += ["--hierarchical-context-parallel-sizes", str(lay.hcp[0]), str(lay.hcp[1])]
    if lay.dynamic:
        flags += ["--dynamic-context-parallel", "--min-dynamic-context-parallel-size",
                  str(lay.min_cp), "--max-seqlen-per-dp-cp-rank", str(lay.cap),
                  "--calculate-per-token-loss"]
    if lay.tp > 1:
        flags.append("--sequence-parallel")
        if tp_comm_overlap:
            flags.append("--tp-comm-overlap")
    if fsdp:  # the Megatron-FSDP README's required flags
        flags += ["--use-megatron-fsdp", "--data-parallel-sharding-strategy",
                  "optim_grads_params", "--no-gradient-accumulation-fusion",
                  "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor",
                  "--overlap-param-gather"]
    elif distributed_optimizer:
        flags += ["--use-distributed-optimizer", "--overlap-param-gather"]
    flags.append("--overlap-grad-reduce")
    if precision == "fp8":  # Bridge's FP8-CS recipe: per-tensor current scaling, FP8 params
        flags += ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--fp8-param-gather"]
    if grad_reduce_in_bf16:
        flags.append("--grad-reduce-in-bf16")
    if e.recompute == "full":
        flags += ["--recompute-granularity", "full", "--recompute-method", "uniform",
                  "--recompute-num-layers", "1"]
    else:
        flags += ["--recompute-granularity", "selective"]
    return flags + _batch_flags(lay, global_batch)


def bridge_overrides(e: Estimate, global_batch: int, distributed_optimizer: bool,
                     tp_comm_overlap: bool, precision: str = "bf16", fsdp: bool = False,
                     grad_reduce_in_bf16: bool = False) -> list[str]:
    lay = e.layout
    out = [f"model.tensor_model_parallel_size={lay.tp}",
           f"model.pipeline_model_parallel_size={lay.pp}",
           f"model.context_parallel_size={lay.cp}",
           f"model.sequence_parallel={lay.tp > 1}"]
    if lay.cp_comm_type is not None and (lay.cp > 1 or lay.dynamic):
        out.append(f"model.cp_comm_type={lay.cp_comm_type}")
    if lay.hcp:
        out.append(f"model.hierarchical_context_parallel_sizes=[{lay.hcp[0]},{lay.hcp[1]}]")
    if lay.dynamic:
        out += ["model.hybrid_context_parallel=True",  # the field of released megatron-core
                f"model.min_dynamic_context_parallel_size={lay.min_cp}",
                f"model.max_seqlen_per_dp_cp_rank={lay.cap}",
                "model.calculate_per_token_loss=True"]
    if lay.seq_length is not None:
        out += [f"model.seq_length={lay.seq_length}", f"dataset.sequence_length={lay.seq_length}"]
    out.append(f"model.recompute_granularity={e.recompute}")
    if e.recompute == "full":
        out += ["model.recompute_method=uniform", "model.recompute_num_layers=1"]
    if tp_comm_overlap and lay.tp > 1:
        out.append("comm_overlap.tp_comm_overlap=True")
    if precision == "fp8":  # the fields of Bridge's bf16_with_fp8_current_scaling_mixed
        out += ["mixed_precision.fp8=hybrid", "mixed_precision.fp8_recipe=tensorwise",
                "mixed_precision.fp8_param_gather=True"]
    if grad_reduce_in_bf16:
        out += ["mixed_precision.grad_reduce_in_fp32=False", "ddp.grad_reduce_in_fp32=False"]
    if fsdp:
        out += ["ddp.use_megatron_fsdp=True",
                "ddp.data_parallel_sharding_strategy=optim_grads_params"]
    out += [f"ddp.use_distributed_optimizer={distributed_optimizer}",
            f"optimizer.use_distributed_optimizer={distributed_optimizer}",
            "ddp.overlap_grad_reduce=True",
            f"ddp.overlap_param_gather={distributed_optimizer}",
            f"train.global_batch_size={global_batch}", "train.micro_batch_size=1"]
    return out


def table(ranked: list[Estimate], top: int) -> str:
    head = (f"{'#':>3}  {'layout':<36} {'recomp':<9} {'step s':>8} {'tok/s/GPU':>10} "
            f"{'GB/GPU':>7} {'fits':<4}  dominant cost")
    lines = [head, "-" * len(head)]
    for i, e in enumerate(ranked[:top], 1):
        part = dominant(e)
        dom = "compute only" if part == "compute" else f"{part} {_share(e, part):.1f} %"
        lines.append(
            f"{i:>3}  {e.layout.label:<36} {e.recompute:<9} {e.step_seconds:>8.3f} "
            f"{e.tokens_per_second_per_gpu:>10.0f} {e.memory['total'] / GB:>7.1f} "
            f"{'yes' if e.fits else 'NO':<4}  {dom}")
    return "\n".join(lines)


def plot_breakdown(ranked: list[Estimate], path: str, top: int) -> None:
    """Stacked horizontal bars: each top layout's step split into its cost terms (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = ranked[:top][::-1]
    fig, ax = plt.subplots(figsize=(10, max(3.0, 0.45 * len(shown) + 1.5)))
    left = [0.0] * len(shown)
    labels = [e.layout.label + ("" if e.fits else " (no fit)") for e in shown]
    colors = {"compute": "#4c72b0", "cp": "#dd8452", "tp": "#55a868", "pp_bubble": "#c44e52",
              "dp": "#8172b3"}
    for part in PARTS:
        widths = [e.breakdown[part] for e in shown]
        ax.barh(labels, widths, left=left, color=colors[part], label=part)
        left = [a + b for a, b in zip(left, widths)]
    for y, e in enumerate(shown):  # what is not compute, as a share of the step
        over = 100 * (1 - e.breakdown["compute"] / e.step_seconds)
        ax.text(e.step_seconds, y, f" {over:.1f} % comm/bubble", va="center", fontsize=8)
    ax.set_xlim(0, max(e.step_seconds for e in shown) * 1.25)
    ax.set_xlabel("projected seconds per step")
    ax.set_title("step-time breakdown of the top layouts (best at the top)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    fig.tight_layout()
    save_figure(fig, Path(path), dpi=100)
    plt.close(fig)
