"""Optimisers and learning-rate schedules, selected by name in :class:`nmtflow.config.TrainConfig`."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from nmtflow.config import ConfigError, TrainConfig


def build_optimizer(params: list[nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, betas=cfg.adam_betas, eps=cfg.adam_eps,
                                weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.adam_betas, eps=cfg.adam_eps,
                                 weight_decay=cfg.weight_decay)
    if cfg.optimizer == "nesterov":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.99, nesterov=True, weight_decay=cfg.weight_decay)
    raise ConfigError(f"train.optimizer: unknown optimizer {cfg.optimizer!r} (known: adam, adamw, nesterov)")


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Multiplier of ``cfg.lr`` at update ``step`` (1-based after the first update).

    inverse_sqrt (Vaswani et al. 2017, Eq. 3, peak ``lr`` at ``warmup_updates``): linear warm-up from
    ``warmup_init_lr`` to ``lr``, then ``lr · sqrt(warmup / step)``.
    """
    if cfg.lr_scheduler == "constant":
        return lambda step: 1.0
    if cfg.lr_scheduler != "inverse_sqrt":
        raise ConfigError(f"train.lr_scheduler: unknown schedule {cfg.lr_scheduler!r} (known: inverse_sqrt, constant)")
    warmup = max(1, cfg.warmup_updates)
    init = cfg.warmup_init_lr / cfg.lr

    def schedule(step: int) -> float:
        step = max(step, 1)
        if step < warmup:
            return init + (1.0 - init) * step / warmup
        return (warmup / step) ** 0.5

    return schedule


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
