"""``megatron-hcp plan``: arguments and the command (every input error: one line, exit 2)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

__all__ = ["add_arguments", "add_parsers", "check", "run"]


def _one_line_error(message: str) -> None:
    print(f"megatron-hcp plan: {message}", file=sys.stderr)
    sys.exit(2)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.error = _one_line_error  # type: ignore[method-assign]  # one line, exit 2, no usage dump
    parse_known = p.parse_known_args

    def strict(args=None, namespace=None):  # unknown options: our one line, not the usage
        namespace, extras = parse_known(args, namespace)
        if extras:
            _one_line_error(f"unrecognized arguments: {' '.join(extras)}")
        return namespace, extras

    p.parse_known_args = strict  # type: ignore[method-assign]
    from ..config import LIMITS, MAX_SEQ_LENGTH, argument_type
    from .inputs import PLAN_MAX_GPUS, PLAN_MAX_SEQUENCES

    def count(kind: str, flag: str, minimum: int = 1):
        return argument_type("int", flag, minimum=minimum, maximum=LIMITS[kind])

    def number(flag: str, **bounds):
        return argument_type("float", flag, **bounds)

    m = p.add_argument_group("model (flags override --model)")
    m.add_argument("--model", default=None,
                   help="recipe model_config.yaml (MODEL_ARGS), YAML of megatron flags, or a "
                        "text file of megatron flags")
    m.add_argument("--layers", type=count("layers", "--layers"), default=None)
    m.add_argument("--hidden", type=count("width", "--hidden"), default=None)
    m.add_argument("--ffn", type=count("width", "--ffn"), default=None,
                   help="FFN hidden size (default 4 x hidden)")
    m.add_argument("--gated-mlp", action="store_true", default=None, help="SwiGLU (3 matmuls)")
    m.add_argument("--heads", type=count("heads", "--heads"), default=None)
    m.add_argument("--kv-heads", type=count("heads", "--kv-heads"), default=None,
                   help="query groups (default: heads)")
    m.add_argument("--head-dim", type=count("width", "--head-dim"), default=None,
                   help="default hidden / heads")
    m.add_argument("--vocab", type=count("vocab", "--vocab"), default=None,
                   help="default 32000")
    m.add_argument("--tied-embeddings", action="store_true", default=None)
    m.add_argument("--window", type=count("seqlen", "--window"), default=None,
                   help="causal sliding window of this many tokens back (megatron's "
                   "--window-size W 0): attention FLOPs of a band; ring layouts are also "
                   "estimated in the contiguous CP layout (cp_partition_mode)")
    b = p.add_argument_group("batch (one of --seq-length, --lengths, --lognormal)")
    b.add_argument("--seq-length", type=argument_type("int", "--seq-length", minimum=2,
                                                      maximum=MAX_SEQ_LENGTH), default=None)
    b.add_argument("--lengths", default=None, help="JSON file: the lengths of one global batch")
    b.add_argument("--lognormal", default=None, metavar="MEDIAN,SIGMA,MIN,MAX",
                   help="lengths drawn from a clipped lognormal (seed --seed); MIN and MAX are "
                        "integers")
    b.add_argument("--global-batch", type=argument_type(
        "int", "--global-batch", minimum=1, maximum=PLAN_MAX_SEQUENCES), default=None,
        help=f"sequences per step (at most {PLAN_MAX_SEQUENCES})")
    b.add_argument("--seed", type=argument_type("int", "--seed", minimum=0,
                                                maximum=(1 << 32) - 1), default=0)
    c = p.add_argument_group("cluster (a --gpu preset; the flags below override its values; "
                             f"at most {PLAN_MAX_GPUS} GPUs)")
    c.add_argument("--gpu", default="h100", choices=["h100", "h200", "b200", "gb200"],
                   help="GPU preset: vendor peak, memory, NVLink and NIC bandwidth, calibrated "
                        "efficiencies (megatron_hcp/planner/gpus.py)")
    c.add_argument("--nodes", type=count("size", "--nodes"), default=1)
    c.add_argument("--gpus-per-node", type=count("size", "--gpus-per-node"), default=None,
                   help="GPUs per NVLink domain (default: the preset's, 8; gb200 72)")
    c.add_argument("--intra-gbps", type=number("--intra-gbps", above=0.0, maximum=1e6),
                   default=None, help="GB/s per GPU in a node")
    c.add_argument("--inter-gbps", type=number("--inter-gbps", above=0.0, maximum=1e6),
                   default=None, help="GB/s per GPU across nodes")
    c.add_argument("--intra-latency-us", type=number("--intra-latency-us", minimum=0.0,
                                                     maximum=1e6), default=5.0)
    c.add_argument("--inter-latency-us", type=number("--inter-latency-us", minimum=0.0,
                                                     maximum=1e6), default=10.0)
    c.add_argument("--tflops", type=number("--tflops", above=0.0, maximum=1e6), default=None,
                   help="achieved GEMM TFLOP/s per GPU (default: preset peak x calibrated "
                        "efficiency for --precision)")
    c.add_argument("--attention-tflops", type=number("--attention-tflops", above=0.0,
                                                     maximum=1e6), default=None,
                   help="achieved attention TFLOP/s per GPU (default: from the preset)")
    c.add_argument("--hbm-gbps", type=number("--hbm-gbps", above=0.0, maximum=1e7),
                   default=None, help="HBM GB/s per GPU")
    c.add_argument("--gpu-memory-gb", type=number("--gpu-memory-gb", above=0.0, maximum=1e6),
                   default=None)
    o = p.add_argument_group("options")
    o.add_argument("--recompute", default="auto", choices=["auto", "selective", "full"])
    o.add_argument("--precision", default="bf16", choices=["bf16", "fp8"],
                   help="fp8: Transformer Engine FP8 linear layers (attention stays BF16)")
    o.add_argument("--fsdp", action="store_true",
                   help="Megatron-FSDP (optim_grads_params) instead of the distributed optimizer")
    o.add_argument("--grad-reduce-in-bf16", action="store_true",
                   help="bf16 main gradients (megatron keeps them fp32 under --bf16)")
    o.add_argument("--no-distributed-optimizer", action="store_true")
    o.add_argument("--tp-comm-overlap", action="store_true")
    o.add_argument("--te-version", type=argument_type("version", "--te-version"), default="2.8")
    o.add_argument("--attention-backend", default="te", choices=["te", "reference"],
                   help="CP attention backend: te (zigzag layout only) or megatron-hcp's "
                   "reference backend (both layouts)")
    o.add_argument("--tie-tolerance", type=number("--tie-tolerance", minimum=0.0, maximum=0.99),
                   default=0.02)
    o.add_argument("--max-tp", type=count("size", "--max-tp"), default=None,
                   help="default: GPUs per node")
    o.add_argument("--top", type=argument_type("int", "--top", minimum=1, maximum=1000),
                   default=10, help="rows of the table / bars of the plot")
    o.add_argument("--json", action="store_true")
    o.add_argument("--plot", default=None, metavar="PATH", help="stacked step-time bars (PNG)")


def _build(args: argparse.Namespace):
    from .gpus import cluster_for
    from .inputs import (
        PLAN_MAX_GPUS,
        PLAN_MAX_VARLEN_GPUS,
        Batch,
        ModelSpec,
        Options,
        PlanInputError,
        lengths_file,
        load_model_file,
        lognormal,
        lognormal_spec,
    )

    base: dict = {}
    file_batch: dict = {}
    if args.model:
        spec, file_batch = load_model_file(args.model)
        base = vars(spec).copy()
    for arg, name in (("layers", "num_layers"), ("hidden", "hidden_size"),
                      ("ffn", "ffn_hidden_size"), ("heads", "num_attention_heads"),
                      ("kv_heads", "num_query_groups"), ("head_dim", "kv_channels"),
                      ("vocab", "vocab_size"), ("gated_mlp", "gated_mlp"),
                      ("window", "window")):
        if getattr(args, arg) is not None:
            base[name] = getattr(args, arg)
    if args.tied_embeddings:
        base["untie_embeddings"] = False
    missing = [f"--{a}" for a, n in (("layers", "num_layers"), ("hidden", "hidden_size"),
                                     ("heads", "num_attention_heads")) if n not in base]
    if missing:
        raise PlanInputError(f"the model needs {', '.join(missing)} (or --model FILE)")
    model = ModelSpec(**base)
    seq = args.seq_length if args.seq_length is not None else file_batch.get("seq_length")
    given = [x for x in (args.seq_length, args.lengths, args.lognormal) if x is not None]
    if len(given) > 1:
        raise PlanInputError("give one of --seq-length, --lengths, --lognormal")
    global_batch = (args.global_batch if args.global_batch is not None
                    else file_batch.get("global_batch"))
    if global_batch is not None and global_batch < 1:
        raise PlanInputError(f"--global-batch {global_batch} must be >= 1")
    if args.lengths:
        batch = lengths_file(args.lengths)
        _check_varlen_batch(len(batch.lengths), "--lengths")
    elif args.lognormal:
        median, sigma, lo, hi = lognormal_spec(args.lognormal)
        if global_batch is None:
            raise PlanInputError("--lognormal needs --global-batch (sequences per step)")
        _check_varlen_batch(global_batch, "--global-batch")
        batch = lognormal(global_batch, median, sigma, lo, hi, args.seed)
    elif seq is not None:
        if global_batch is None:
            raise PlanInputError("--seq-length needs --global-batch (sequences per step)")
        batch = Batch.fixed_length(seq, global_batch)
    else:
        raise PlanInputError("give the sequence length (--seq-length) or a length "
                             "distribution (--lengths FILE or --lognormal ...)")
    explicit = {field: getattr(args, flag) * scale for flag, field, scale in (
        ("tflops", "flops_per_second", 1e12),
        ("attention_tflops", "attention_flops_per_second", 1e12),
        ("intra_gbps", "intra_bytes_per_second", 1e9),
        ("inter_gbps", "inter_bytes_per_second", 1e9),
        ("hbm_gbps", "memory_bytes_per_second", 1e9),
        ("gpu_memory_gb", "memory_bytes", 1e9)) if getattr(args, flag) is not None}
    cluster = cluster_for(args.gpu, args.precision, args.nodes, args.gpus_per_node,
                          intra_latency_seconds=args.intra_latency_us * 1e-6,
                          inter_latency_seconds=args.inter_latency_us * 1e-6, **explicit)
    gpus = cluster.nodes * cluster.gpus_per_node
    if not batch.fixed and gpus > PLAN_MAX_VARLEN_GPUS:
        raise PlanInputError(
            f"--nodes {cluster.nodes} x --gpus-per-node {cluster.gpus_per_node} = {gpus} GPUs "
            f"with a batch of variable lengths is over the planner's limit of "
            f"{PLAN_MAX_VARLEN_GPUS} (each layout schedules the batch; beyond that it runs for "
            "minutes); plan a slice of the cluster, or a fixed --seq-length")
    if gpus > PLAN_MAX_GPUS:
        raise PlanInputError(
            f"--nodes {cluster.nodes} x --gpus-per-node {cluster.gpus_per_node} = {gpus} GPUs "
            f"is over the planner's limit of {PLAN_MAX_GPUS} (it estimates every layout; beyond "
            "that it runs for many minutes); plan a slice of the cluster (e.g. the GPUs of one "
            "data-parallel replica group)")
    options = Options(recompute=args.recompute, precision=args.precision, fsdp=args.fsdp,
                      grad_reduce_in_bf16=args.grad_reduce_in_bf16,
                      distributed_optimizer=not args.no_distributed_optimizer,
                      tp_comm_overlap=args.tp_comm_overlap, te_version=args.te_version,
                      attention_backend=args.attention_backend,
                      tie_tolerance=args.tie_tolerance, max_tp=args.max_tp)
    return model, batch, cluster, options


def _check_varlen_batch(count: int, flag: str) -> None:
    from .inputs import PLAN_MAX_VARLEN_SEQUENCES, PlanInputError

    if count > PLAN_MAX_VARLEN_SEQUENCES:
        raise PlanInputError(
            f"{flag}: {count} sequences of variable lengths is over the planner's limit of "
            f"{PLAN_MAX_VARLEN_SEQUENCES} (each layout schedules the batch); give a "
            "representative sample of at most that many")


def calibration_line() -> str:
    """How well the model matched the published runs (recomputed from the data each time)."""
    from .calibration import compare_all, load_published, summarize

    return summarize(compare_all(load_published(), with_best=False)).line()


def check(args: argparse.Namespace):
    """Every input of ``plan`` read and bounded, and the ``--plot`` path checked, before any
    layout is estimated: (model, batch, cluster, options). Raises ValueError (one line)."""
    from ..files.atomic_write import check_output_file

    args.plot_path = check_output_file(args.plot, "--plot") if args.plot is not None else None
    return _build(args)


def run(args: argparse.Namespace) -> int:
    from . import plan
    from .inputs import PlanInputError
    from .report import plot_breakdown, table

    try:
        result = plan(*args.checked)
    except (PlanInputError, ValueError) as err:  # e.g. no layout fits: one line
        print(f"megatron-hcp plan: {err}".splitlines()[0], file=sys.stderr)
        return 2
    if args.plot_path is not None:
        plot_breakdown(result.ranked, args.plot_path, args.top)
        print(f"plot: {args.plot_path}", file=sys.stderr if args.json else sys.stdout)
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    c = result.cluster
    print(f"{len(result.ranked)} layouts for {c.nodes} x {c.gpus_per_node} {args.gpu} GPUs, "
          f"{args.precision} ({len(result.rejected)} rejected by CPConfig or the batch size); "
          "projected, not measured")
    print(table(result.ranked, args.top))
    print(calibration_line())
    print()
    print(f"winner: {result.why(result.winner)}")
    for e in result.ranked[1:3]:
        print(f"runner-up: {result.why(e)}")
    print()
    print("megatron flags:   " + shlex.join(result.flags()))
    print("Bridge overrides: " + shlex.join(result.overrides()))
    for note in result.notes():
        print(f"note: {note}")
    return 0


def _checked(args: argparse.Namespace):
    """Every ``plan`` input read and bounded, the ``--plot`` path checked, before planning."""
    from ..command_line import UsageError, one_line

    try:
        return check(args)
    except ValueError as err:  # PlanInputError, OutputPathError
        raise UsageError(one_line(err)) from None


def add_parsers(sub) -> None:
    """Register plan."""
    p = sub.add_parser("plan", help="rank TP/CP/PP/DP, cp_comm_type, HCP sizes and dynamic-CP "
                                    "knobs for a model on a cluster (projected step time, memory)")
    add_arguments(p)
    p.set_defaults(func=run, check=_checked)
