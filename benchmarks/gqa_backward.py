"""Half-precision GQA block backward on the CPU flash kernel: what summing dK/dV in fp32 costs.

One causal block (``kernels.block_backward``, the CPU flash kernel, K/V with fewer heads than
q; bf16 or ``--dtype fp16``) three ways, interleaved in one run:

* ``grouped`` - the kernel in the block's dtype on K/V as they are (commits f8ba725 until the
  fix): it adds each query block's and query head's share of dK/dV into its half-precision
  gradient in place;
* ``grouped fp32`` - the fix
  (:func:`~megatron_hcp.attention.reference.kernels.backward_dtype`): the kernel in fp32 on
  K/V as they are, the shares summed in fp32;
* ``expanded`` - commit 947f668's path, for comparison: K/V expanded to q's heads, the kernel
  in half precision per query head, the heads' dK/dV converted to fp32 and summed per group.

Per row: the median wall time of the block's backward (``--repeats`` interleaved rounds, torch's
threads as set), the same for a whole causal ``local_attention`` forward + backward (bshd, one
sequence of the block's rows: its blocks and merges), the bytes of the extra tensors each path
allocates beyond ``grouped``'s (inputs converted or expanded, wider or per-head gradients;
counted from the shapes; none outlives the block's backward), and the error of the block's dV
(and dK) against an fp64 backward of the same half-precision inputs, as a fraction of
Transformer Engine's tolerance (atol = rtol = 3.5e-2 for bf16 GQA, 5e-3 for fp16: <= 1 passes).

``.venv/bin/python benchmarks/gqa_backward.py [--seq 512 1024] [--repeats 5] [--dtype fp16]``
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Iterator

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_hcp.attention.reference import kernels, local_attention  # noqa: E402
from megatron_hcp.attention.reference.kernel_support import CPU_FLASH  # noqa: E402
from megatron_hcp.attention.reference.kernels import (  # noqa: E402
    KernelChoice,
    block_backward,
    block_forward,
)

# Transformer Engine's tolerances (atol = rtol) of its CP tests: bf16 GQA, fp16
TE_TOL = {torch.bfloat16: 3.5e-2, torch.float16: 5e-3}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# (name, q heads, KV heads, head dim): Transformer Engine's CP test configurations' heads
PROBLEMS = [("32/4 d128", 32, 4, 128), ("64/8 d64", 64, 8, 64), ("12/2 d128", 12, 2, 128)]
PATHS = ("grouped", "grouped fp32", "expanded")


@contextlib.contextmanager
def path(name: str) -> Iterator[None]:
    """The block backward of ``name`` (:data:`PATHS`) inside the block."""
    saved = kernels.backward_dtype, kernels.cpu_flash_takes_grouped_kv
    if name == "grouped":
        kernels.backward_dtype = lambda kernel, dtype, grouped: dtype
    elif name == "expanded":
        kernels.cpu_flash_takes_grouped_kv = lambda: False
    try:
        yield
    finally:
        kernels.backward_dtype, kernels.cpu_flash_takes_grouped_kv = saved


def extra_bytes(name: str, b: int, h: int, hkv: int, s: int, d: int) -> int:
    """Bytes of the tensors ``name`` allocates beyond ``grouped``'s, for a half-precision
    block of ``s`` query and ``s`` key rows (none outlives the block's backward)."""
    q_rows, kv_rows = b * h * s * d, b * hkv * s * d  # elements of q (dout, out) and of k (v)
    if name == "grouped fp32":  # q, dout, out, k, v in fp32; dq, dk, dv 4 bytes, not 2
        return 4 * (3 * q_rows + 2 * kv_rows) + 2 * (q_rows + 2 * kv_rows)
    if name == "expanded":  # K/V and dK/dV per query head (2 bytes), dK/dV per head in
        # fp32, their group sums in fp32 (4 bytes, not 2)
        per_head = b * h * s * d
        return 2 * 2 * per_head + 2 * 2 * per_head + 2 * 4 * per_head + 2 * 2 * kv_rows
    return 0


def inputs(b: int, h: int, hkv: int, s: int, d: int, dtype: torch.dtype, seed: int = 0
           ) -> tuple[torch.Tensor, ...]:
    """q, k, v, dout of one block ([B, heads, S, D]) in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(b, h, s, d, generator=gen).to(dtype) for _ in range(2))
    k, v = (torch.randn(b, hkv, s, d, generator=gen).to(dtype) for _ in range(2))
    return q, k, v, dout


def fp64_grads(q, k, v, dout, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """dK, dV of the block in fp64 (the same half-precision inputs)."""
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=True,
                                                           scale=scale, enable_gqa=True)
    out.backward(dout.double())
    return kd.grad, vd.grad


def te_ratio(got: torch.Tensor, want: torch.Tensor, tol: float) -> float:
    """max |got - want| / (atol + rtol |want|) at Transformer Engine's tolerance ``tol``."""
    return ((got.double() - want).abs() / (tol + tol * want.abs())).max().item()


def attention_step(q, k, v, dout) -> float:
    """Seconds of one causal ``local_attention`` forward + backward on these [B,H,S,D] tensors
    (as bshd)."""
    leaves = [x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v)]
    start = time.perf_counter()
    local_attention(*leaves, causal=True, qkv_format="bshd").backward(dout.transpose(1, 2))
    return time.perf_counter() - start


def measure(b: int, h: int, hkv: int, s: int, d: int, dtype: torch.dtype, repeats: int
            ) -> dict[str, dict]:
    """Per path: median block backward and attention step seconds, extra bytes and the
    block's dK / dV TE ratios."""
    q, k, v, dout = inputs(b, h, hkv, s, d, dtype)
    tol = TE_TOL[dtype]
    scale, kernel = d ** -0.5, KernelChoice(CPU_FLASH)
    out, lse = block_forward(q, k, v, scale=scale, causal=True, kernel=kernel)
    want_k, want_v = fp64_grads(q, k, v, dout, scale)
    times: dict[str, list[float]] = {name: [] for name in PATHS}
    steps: dict[str, list[float]] = {name: [] for name in PATHS}
    rows = {}
    for round_ in range(repeats + 1):  # the first round warms up, untimed
        for name in PATHS:
            with path(name):
                start = time.perf_counter()
                _, dk, dv = block_backward(dout, q, k, v, out, lse, scale=scale, causal=True,
                                           kernel=kernel)
                elapsed = time.perf_counter() - start
                step = attention_step(q, k, v, dout)
            if round_:
                times[name].append(elapsed)
                steps[name].append(step)
            else:
                rows[name] = dict(dk=te_ratio(dk, want_k, tol), dv=te_ratio(dv, want_v, tol),
                                  dv_abs=(dv.double() - want_v).abs().max().item())
    for name in PATHS:
        rows[name].update(seconds=statistics.median(times[name]),
                          step=statistics.median(steps[name]),
                          extra=extra_bytes(name, b, h, hkv, s, d))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 1024],
                        help="query (= key) rows of the block")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    args = parser.parse_args()
    dtype = DTYPES[args.dtype]
    print(f"causal {args.dtype} GQA block backward, CPU flash kernel, batch {args.batch}, "
          f"{torch.get_num_threads()} threads; torch {torch.__version__}")
    print(f"{'problem':<10} {'S':>5} {'path':<13} {'bwd ms':>7} {'x':>5} {'step ms':>8} "
          f"{'x':>5} {'extra MiB':>9} {'|dV err|':>8} {'dK/TE':>5} {'dV/TE':>5}")
    print("-" * 88)
    for label, h, hkv, d in PROBLEMS:
        for s in args.seq:
            rows = measure(args.batch, h, hkv, s, d, dtype, args.repeats)
            base = rows["grouped"]
            for name in PATHS:
                row = rows[name]
                print(f"{label:<10} {s:>5} {name:<13} {1e3 * row['seconds']:>7.1f} "
                      f"{row['seconds'] / base['seconds']:>5.2f} {1e3 * row['step']:>8.1f} "
                      f"{row['step'] / base['step']:>5.2f} {row['extra'] / 2**20:>9.1f} "
                      f"{row['dv_abs']:>8.3f} {row['dk']:>5.2f} {row['dv']:>5.2f}", flush=True)


if __name__ == "__main__":
    main()
