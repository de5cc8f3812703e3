"""Dynamic CP data path: one global batch -> this rank's packed THD micro-batches.

Per training step, on every rank of a DPxCP group (and its TP peers):

1. each DP replica reports the lengths of the samples it loaded (replicas may load different
   numbers); all-gathers over the DP group give every rank the global batch's lengths and the
   replica that loaded each sample (TP rank 0 gathers, then broadcasts over TP);
2. every rank runs the scheduler on them, and the plan's digest is checked to be identical on
   all DPxCP ranks (one all-reduce) before any data moves;
3. samples travel point-to-point to the ranks of the group that runs them: the sender of sample
   ``s`` to position ``q`` is the rank of ``s``'s DP replica with ``q``'s CP rank, so the
   traffic is spread over the replica and ranks of the owning replica need nothing;
4. every scheduled micro-batch becomes one packed THD micro-batch for this rank, cut for its
   position in its CP group, with ``PackedSeqParams.local_cp_size``/``cp_group`` set; a rank the
   plan leaves idle runs a two-token dummy with loss mask 0 (so every rank runs the same number
   of micro-batches through megatron's schedule and the gradient stays exact);
5. TP ranks other than 0 receive their micro-batches by broadcast from TP rank 0.

Every step is the same on all ranks, so a rank that fails raises before any collective that the
others would wait for, apart from the collectives listed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..parallel_state.dynamic import DynamicCPGroups
from ..parallel_state.groups import collective_device
from ..sharding import DEFAULT_CP_PARTITION_MODE, MicroBatch, check_partition_mode
from .packing import pack_thd
from .projection import Cluster, Hardware
from .scheduler import Plan, schedule
from .workload import GPTWorkload

__all__ = ["DynamicCPDataPath", "PlanMismatchError"]


_DEFAULT_HARDWARE = Hardware()


class PlanMismatchError(RuntimeError):
    """Ranks of one DPxCP group computed different plans (they would deadlock)."""


def _plan_digest(plan: Plan, ids: Sequence[int]) -> int:
    body = json.dumps([plan.to_json()["micro_batches"], list(ids)], sort_keys=True)
    return int.from_bytes(hashlib.sha256(body.encode()).digest()[:7], "little")


class DynamicCPDataPath:
    """Turns a global batch into this rank's dynamic-CP micro-batches (module docstring).

    ``groups`` are this rank's dynamic CP groups; ``dp_group``/``cp_group``/``tp_group`` the
    static megatron groups (they say which samples this rank loaded and who its TP peers are).
    ``micro_batch_multiple`` makes the micro-batch count a multiple of it (the pipeline size
    with interleaved VPP). ``hardware``: plans are ranked by projected step time, compute plus
    exposed CP ring traffic (default: :class:`~.projection.Hardware`'s assumed H100-class
    numbers), because under FLOPs alone splitting a short sequence over many ranks looks free;
    ``None`` ranks them by FLOPs makespan. With dynamic hierarchical CP (``groups.a2a_size``)
    the default becomes a two-link :class:`~.projection.Cluster` (nodes of 8 GPUs, i.e.
    ``8 // TP`` DPxCP positions) and plans are ranked with each group's a2a and p2p levels; a
    given Cluster is used with the levels too, a given single-link ``Hardware`` prices flat rings.
    ``sequence_parallel``: sequences are padded so that every rank's packed tokens split evenly
    over the TP ranks. ``cp_partition_mode``: the layout every micro-batch is cut in (its
    group's zigzag chunks or contiguous slices); the scheduler plans in it (the workload is
    given that layout): its padding for the token cap, and its slowest rank's causal share
    for the balance.
    """

    def __init__(
        self,
        groups: DynamicCPGroups,
        *,
        dp_group: Any,
        cp_group: Any,
        tp_group: Any,
        max_seqlen_per_dp_cp_rank: int,
        min_cp_size: int | None = None,
        workload: GPTWorkload | None = None,
        micro_batch_multiple: int = 1,
        hardware: Hardware | Cluster | None = _DEFAULT_HARDWARE,
        sequence_parallel: bool = False,
        cp_partition_mode: str = DEFAULT_CP_PARTITION_MODE,
    ):
        self.groups = groups
        self.mode = check_partition_mode(cp_partition_mode)
        self.dp_group, self.cp_group, self.tp_group = dp_group, cp_group, tp_group
        self.cap = int(max_seqlen_per_dp_cp_rank)
        self.min_cp_size = groups.min_size if min_cp_size is None else int(min_cp_size)
        self.workload = dataclasses.replace(workload or GPTWorkload(),
                                            cp_partition_mode=self.mode)
        self.multiple = int(micro_batch_multiple)
        a2a_size = getattr(groups, "a2a_size", None)
        if a2a_size is not None and hardware is _DEFAULT_HARDWARE:
            hardware = Cluster(gpus_per_node=max(1, 8 // dist.get_world_size(tp_group)))
        self.hardware = hardware
        self.hcp_a2a_size = a2a_size if isinstance(hardware, Cluster) else None
        # sequence parallelism splits each rank's packed tokens over the TP ranks
        self.pad_multiple = dist.get_world_size(tp_group) if sequence_parallel else 1
        self.position = groups.position
        self.tp_src = dist.get_process_group_ranks(tp_group)[0]
        self.is_tp_src = dist.get_rank() == self.tp_src
        # (dp rank, cp rank) of every DPxCP position, from one all-gather over DPxCP
        dp_cp = groups.by_size[groups.size]
        self.device = collective_device(dp_cp)  # CPU on gloo, this rank's GPU on NCCL
        mine = torch.tensor([dist.get_rank(dp_group), dist.get_rank(cp_group)],
                            device=self.device)
        table = [torch.zeros(2, dtype=torch.int64, device=self.device)
                 for _ in range(groups.size)]
        dist.all_gather(table, mine, group=dp_cp)
        self.dp_of = [int(t[0]) for t in table]
        self.cp_of = [int(t[1]) for t in table]
        self.position_of = {(d, c): p for p, (d, c) in enumerate(zip(self.dp_of, self.cp_of))}

    # ------------------------------------------------------------------ steps 1-2
    def _global_lengths(self, ids: Sequence[int], lengths: Sequence[int]
                        ) -> tuple[list[int], list[int], list[int]]:
        """Every DP replica's sample ids and lengths, replica by replica, and the replica that
        loaded each (replicas may load different numbers of samples, e.g. packed rows)."""
        dp = dist.get_world_size(self.dp_group)
        payload = torch.zeros(1, dtype=torch.int64, device=self.device)
        if self.is_tp_src:
            counts = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(dp)]
            dist.all_gather(counts, torch.tensor([len(ids)], device=self.device),
                            group=self.dp_group)
            counts = [int(c) for c in counts]
            width = max(counts)
            mine = torch.zeros(2, width, dtype=torch.int64, device=self.device)
            mine[0, :len(ids)] = torch.tensor(list(ids), dtype=torch.int64)
            mine[1, :len(ids)] = torch.tensor(list(lengths), dtype=torch.int64)
            parts = [torch.zeros_like(mine) for _ in range(dp)]
            dist.all_gather(parts, mine, group=self.dp_group)
            owners = torch.cat([torch.full((1, c), r, dtype=torch.int64, device=self.device)
                                for r, c in enumerate(counts)], dim=1)
            payload = torch.cat([torch.cat([p[:, :c] for p, c in zip(parts, counts)], dim=1),
                                 owners])
        if dist.get_world_size(self.tp_group) > 1:
            size = torch.tensor([payload.shape[-1] if self.is_tp_src else 0], device=self.device)
            dist.broadcast(size, src=self.tp_src, group=self.tp_group)
            if not self.is_tp_src:
                payload = torch.zeros(3, int(size), dtype=torch.int64, device=self.device)
            dist.broadcast(payload, src=self.tp_src, group=self.tp_group)
        return ([int(x) for x in payload[0]], [int(x) for x in payload[1]],
                [int(x) for x in payload[2]])

    def _check_same_plan(self, plan: Plan, ids: Sequence[int]) -> None:
        digest = _plan_digest(plan, ids)
        probe = torch.tensor([digest, -digest], dtype=torch.int64, device=self.device)
        dist.all_reduce(probe, op=dist.ReduceOp.MAX, group=self.groups.by_size[self.groups.size])
        if int(probe[0]) != digest or int(-probe[1]) != digest:
            raise PlanMismatchError(
                "the dynamic-CP plan differs between ranks of the DPxCP group "
                f"{self.groups.dp_cp_ranks}: the scheduler inputs (lengths, cap, min size, "
                "workload, hardware) must be the same on every rank"
            )

    # ------------------------------------------------------------------ step 3
    def _route(self, plan: Plan, local: dict[int, torch.Tensor], lengths: list[int],
               owners: list[int]) -> dict[int, torch.Tensor]:
        me = self.position
        ranks = self.groups.dp_cp_ranks
        have = dict(local)
        ops, inbox = [], {}
        for mb in plan.micro_batches:
            for g in mb.groups:
                for s in g.samples:
                    owner = owners[s]  # the DP replica that loaded it
                    for q in g.ranks:
                        if self.dp_of[q] == owner:
                            continue  # q's replica loaded it
                        sender = self.position_of[(owner, self.cp_of[q])]
                        if sender == me:
                            have[s] = have[s].to(self.device)
                            ops.append(dist.isend(have[s].contiguous(), ranks[q], tag=s))
                        elif q == me:
                            inbox[s] = torch.empty(3, lengths[s], dtype=torch.int64,
                                                   device=self.device)
                            ops.append(dist.irecv(inbox[s], ranks[sender], tag=s))
        for work in ops:  # matched by (peer, tag); posted in the same order everywhere
            work.wait()
        have.update(inbox)
        return {s: x.cpu() for s, x in have.items()}  # packing runs on the CPU

    # ------------------------------------------------------------------ steps 4-5
    def step(self, ids: Sequence[int], load: Callable[[int], torch.Tensor]
             ) -> tuple[Plan, list[MicroBatch]]:
        """This rank's micro-batches for a global batch.

        ``ids`` are the ids of the samples this rank's DP replica loaded, unique over the DP
        group (replicas may load different numbers of samples); ``load(i)`` returns sample
        ``i`` as an int64 ``[3, L]`` tensor (called on TP rank 0 only, for ``ids`` only).
        """
        ids = [int(i) for i in ids]
        local = {}
        if self.is_tp_src:
            local = {i: load(i) for i in ids}
        all_ids, lengths, owners = self._global_lengths(
            ids, [int(local[i].shape[1]) if local else 0 for i in ids])
        plan = schedule(lengths, self.groups.size, self.cap, workload=self.workload,
                        hardware=self.hardware, hcp_a2a_size=self.hcp_a2a_size,
                        min_cp_size=self.min_cp_size, vpp=self.multiple)
        self._check_same_plan(plan, all_ids)
        index_of = {sid: k for k, sid in enumerate(all_ids)}
        have: dict[int, torch.Tensor] = {}
        if self.is_tp_src:
            mine = {index_of[i]: local[i] for i in ids}
            have = self._route(plan, mine, lengths, owners)
        out = []
        for mb in plan.micro_batches:
            group = next((g for g in mb.groups if self.position in g.ranks), None)
            if group is None:  # idle in this micro-batch
                out.append(pack_thd([torch.zeros(3, 2, dtype=torch.int64)], 1, 0, dynamic=True,
                                    pad_multiple=self.pad_multiple, cp_partition_mode=self.mode))
                continue
            size = len(group.ranks)
            samples = [have[s] if self.is_tp_src else torch.zeros(3, lengths[s], dtype=torch.int64)
                       for s in group.samples]
            out.append(pack_thd(samples, size, self.position - group.ranks[0],
                                self.groups.group(size), dynamic=True,
                                levels=self.groups.levels(size),
                                pad_multiple=self.pad_multiple, cp_partition_mode=self.mode))
        if dist.get_world_size(self.tp_group) > 1:
            for mb in out:
                payload = torch.stack([mb.tokens[0], mb.labels[0],
                                       mb.loss_mask[0].long()]).to(self.device)
                dist.broadcast(payload, src=self.tp_src, group=self.tp_group)
                mb.tokens, mb.labels = payload[0:1].clone(), payload[1:2].clone()
                mb.loss_mask = payload[2:3].float()
        return plan, out
