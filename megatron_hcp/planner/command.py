"""``megatron-hcp plan``: arguments and the command (every input error: one line, exit 2)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

__all__ = ["add_arguments", "run"]


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
    m = p.add_argument_group("model (flags override --model)")
    m.add_argument("--model", default=None,
                   help="recipe model_config.yaml (MODEL_ARGS), YAML of megatron flags, or a "
                        "text file of megatron flags")
    m.add_argument("--layers", type=int, default=None)
    m.add_argument("--hidden", type=int, default=None)
    m.add_argument("--ffn", type=int, default=None, help="FFN hidden size (default 4 x hidden)")
    m.add_argument("--gated-mlp", action="store_true", default=None, help="SwiGLU (3 matmuls)")
    m.add_argument("--heads", type=int, default=None)
    m.add_argument("--kv-heads", type=int, default=None, help="query groups (default: heads)")
    m.add_argument("--head-dim", type=int, default=None, help="default hidden / heads")
    m.add_argument("--vocab", type=int, default=None, help="default 32000")
    m.add_argument("--tied-embeddings", action="store_true", default=None)
    b = p.add_argument_group("batch (one of --seq-length, --lengths, --lognormal)")
    b.add_argument("--seq-length", type=int, default=None)
    b.add_argument("--lengths", default=None, help="JSON file: the lengths of one global batch")
    b.add_argument("--lognormal", default=None, metavar="MEDIAN,SIGMA,MIN,MAX",
                   help="lengths drawn from a clipped lognormal (seed --seed)")
    b.add_argument("--global-batch", type=int, default=None, help="sequences per step")
    b.add_argument("--seed", type=int, default=0)
    c = p.add_argument_group("cluster (defaults: H100 SXM nodes, see the module docstring)")
    c.add_argument("--nodes", type=int, default=1)
    c.add_argument("--gpus-per-node", type=int, default=8)
    c.add_argument("--intra-gbps", type=float, default=450.0, help="GB/s per GPU in a node")
    c.add_argument("--inter-gbps", type=float, default=50.0, help="GB/s per GPU across nodes")
    c.add_argument("--intra-latency-us", type=float, default=5.0)
    c.add_argument("--inter-latency-us", type=float, default=10.0)
    c.add_argument("--tflops", type=float, default=400.0, help="achieved TFLOP/s per GPU")
    c.add_argument("--gpu-memory-gb", type=float, default=80.0)
    o = p.add_argument_group("options")
    o.add_argument("--recompute", default="auto", choices=["auto", "selective", "full"])
    o.add_argument("--no-distributed-optimizer", action="store_true")
    o.add_argument("--tp-comm-overlap", action="store_true")
    o.add_argument("--te-version", default="2.8")
    o.add_argument("--tie-tolerance", type=float, default=0.02)
    o.add_argument("--max-tp", type=int, default=None, help="default: GPUs per node")
    o.add_argument("--top", type=int, default=10, help="rows of the table / bars of the plot")
    o.add_argument("--json", action="store_true")
    o.add_argument("--plot", default=None, metavar="PATH", help="stacked step-time bars (PNG)")


def _build(args: argparse.Namespace):
    from ..dynamic_cp.projection import Cluster
    from .inputs import (
        Batch,
        ModelSpec,
        Options,
        PlanInputError,
        lengths_file,
        load_model_file,
        lognormal,
    )

    base: dict = {}
    file_batch: dict = {}
    if args.model:
        spec, file_batch = load_model_file(args.model)
        base = vars(spec).copy()
    for arg, name in (("layers", "num_layers"), ("hidden", "hidden_size"),
                      ("ffn", "ffn_hidden_size"), ("heads", "num_attention_heads"),
                      ("kv_heads", "num_query_groups"), ("head_dim", "kv_channels"),
                      ("vocab", "vocab_size"), ("gated_mlp", "gated_mlp")):
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
    elif args.lognormal:
        try:
            median, sigma, lo, hi = (float(x) for x in args.lognormal.split(","))
        except ValueError:
            raise PlanInputError("--lognormal needs MEDIAN,SIGMA,MIN,MAX (four numbers)"
                                 ) from None
        if global_batch is None:
            raise PlanInputError("--lognormal needs --global-batch (sequences per step)")
        batch = lognormal(global_batch, median, sigma, int(lo), int(hi), args.seed)
    elif seq is not None:
        if global_batch is None:
            raise PlanInputError("--seq-length needs --global-batch (sequences per step)")
        batch = Batch.fixed_length(seq, global_batch)
    else:
        raise PlanInputError("give the sequence length (--seq-length) or a length "
                             "distribution (--lengths FILE or --lognormal ...)")
    for name in ("nodes", "gpus_per_node"):
        if getattr(args, name) < 1:
            raise PlanInputError(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("intra_gbps", "inter_gbps", "tflops", "gpu_memory_gb"):
        if not getattr(args, name) > 0:
            raise PlanInputError(f"--{name.replace('_', '-')} must be > 0")
    for name in ("intra_latency_us", "inter_latency_us"):
        if not getattr(args, name) >= 0:
            raise PlanInputError(f"--{name.replace('_', '-')} must be >= 0")
    for name in ("top", "max_tp"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise PlanInputError(f"--{name.replace('_', '-')} must be >= 1")
    if args.seed < 0:
        raise PlanInputError("--seed must be >= 0")
    cluster = Cluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                      flops_per_second=args.tflops * 1e12,
                      intra_bytes_per_second=args.intra_gbps * 1e9,
                      intra_latency_seconds=args.intra_latency_us * 1e-6,
                      inter_bytes_per_second=args.inter_gbps * 1e9,
                      inter_latency_seconds=args.inter_latency_us * 1e-6,
                      memory_bytes=args.gpu_memory_gb * 1e9)
    options = Options(recompute=args.recompute,
                      distributed_optimizer=not args.no_distributed_optimizer,
                      tp_comm_overlap=args.tp_comm_overlap, te_version=args.te_version,
                      tie_tolerance=args.tie_tolerance, max_tp=args.max_tp)
    return model, batch, cluster, options


def run(args: argparse.Namespace) -> int:
    from . import plan
    from .inputs import PlanInputError
    from .report import plot_breakdown, table

    try:
        result = plan(*_build(args))
    except (PlanInputError, ValueError, OverflowError) as err:  # input errors, one line
        print(f"megatron-hcp plan: {err}".splitlines()[0], file=sys.stderr)
        return 2
    if args.plot:
        try:
            plot_breakdown(result.ranked, args.plot, args.top)
        except OSError as err:
            print(f"megatron-hcp plan: cannot write --plot {args.plot}: {err}", file=sys.stderr)
            return 2
    if args.json:
        print(json.dumps(result.to_json()))
        return 0
    c = result.cluster
    print(f"{len(result.ranked)} layouts for {c.nodes} x {c.gpus_per_node} GPUs "
          f"({len(result.rejected)} rejected by CPConfig or the batch size); projected, "
          "not measured")
    print(table(result.ranked, args.top))
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
