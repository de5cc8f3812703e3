"""The training part of the tiny Bridge recipes (:mod:`.recipes`, :mod:`.family_recipes`):
optimizer, scheduler, DDP, checkpoint and logging as every one of them sets them."""

from __future__ import annotations

from typing import Any

__all__ = ["common_training"]


def common_training(cfg: Any, *, train_iters: int, global_batch_size: int,
                    micro_batch_size: int, lr: float, seed: int) -> Any:
    """``cfg`` (a Bridge ``ConfigContainer``) with the training the project's tiny recipes share:
    ``train_iters`` steps of ``global_batch_size`` in micro-batches of ``micro_batch_size``,
    Adam at a constant ``lr`` without weight decay or clipping, fp32 DDP without overlap and
    without the distributed optimizer, no checkpoint, logging every step, ``seed``."""
    from megatron.bridge.training.config import (
        CheckpointConfig,
        DistributedDataParallelConfig,
        DistributedInitConfig,
        OptimizerConfig,
        SchedulerConfig,
    )

    cfg.train.train_iters = train_iters
    cfg.train.global_batch_size = global_batch_size
    cfg.train.micro_batch_size = micro_batch_size
    cfg.train.manual_gc = False
    cfg.validation.eval_iters = 0
    cfg.optimizer = OptimizerConfig(optimizer="adam", lr=lr, min_lr=0.0, weight_decay=0.0,
                                    clip_grad=0.0, bf16=False, fp16=False,
                                    use_distributed_optimizer=False)
    cfg.scheduler = SchedulerConfig(lr_decay_style="constant", lr_warmup_iters=0,
                                    start_weight_decay=0.0, end_weight_decay=0.0,
                                    weight_decay_incr_style="constant")
    cfg.ddp = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                            overlap_param_gather=False,
                                            use_distributed_optimizer=False)
    cfg.mixed_precision = None
    cfg.comm_overlap = None
    cfg.logger.log_interval = 1
    cfg.logger.tensorboard_dir = None
    cfg.logger.log_timers_to_tensorboard = False
    cfg.checkpoint = CheckpointConfig(save=None, load=None, ckpt_format="torch_dist",
                                      async_save=False, fully_parallel_save=True)
    cfg.rng.seed = seed
    cfg.dist = DistributedInitConfig()  # Bridge's default backend (NCCL); a CPU run sets gloo
    return cfg
