"""Optimisers and learning-rate schedules, selected by name in :class:`nmtflow.config.TrainConfig`."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from nmtflow.config import ConfigError, TrainConfig


FUSED_DEVICES = ("cpu", "cuda")  # devices with a fused Adam/AdamW kernel in PyTorch


def build_optimizer(params: list[nn.Parameter], cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimizer ``cfg.optimizer`` names over ``params`` (already on their device).

    Adam and AdamW (Kingma & Ba 2015, Alg. 1; Loshchilov & Hutter 2019) take PyTorch's fused implementation
    when ``cfg.fused_optimizer`` is on and every parameter is a floating-point tensor on a device that has the
    kernel: the same update in one pass over the parameters, instead of a chain of element-wise operators per
    tensor (``benchmarks/optimizer_step.py``). Otherwise, and with ``fused_optimizer: false``, PyTorch's
    default (foreach on CUDA, one tensor at a time on the CPU).
    """
    if cfg.optimizer in ("adam", "adamw"):
        fused = cfg.fused_optimizer and bool(params) and all(
            p.is_floating_point() and p.device.type in FUSED_DEVICES for p in params)
        adam = torch.optim.Adam if cfg.optimizer == "adam" else torch.optim.AdamW
        return adam(params, lr=cfg.lr, betas=cfg.adam_betas, eps=cfg.adam_eps, weight_decay=cfg.weight_decay,
                    **({"fused": True} if fused else {}))
    if cfg.optimizer == "nesterov":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.99, nesterov=True, weight_decay=cfg.weight_decay)
    raise ConfigError(f"train.optimizer: unknown optimizer {cfg.optimizer!r} (known: adam, adamw, nesterov)")


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Multiplier of ``cfg.lr`` for the update after ``step`` updates (``LambdaLR`` counts from 0).

    inverse_sqrt (Vaswani et al. 2017, Eq. 3, peak ``lr`` at update ``warmup_updates``): update ``s``
    (1-based) takes ``warmup_init_lr + (lr − warmup_init_lr) · s / warmup`` while ``s < warmup``, then
    ``lr · sqrt(warmup / s)``.
    """
    if cfg.lr_scheduler == "constant":
        return lambda step: 1.0
    if cfg.lr_scheduler != "inverse_sqrt":
        raise ConfigError(f"train.lr_scheduler: unknown schedule {cfg.lr_scheduler!r} (known: inverse_sqrt, constant, "
                          "reduce_on_rise)")
    warmup = max(1, cfg.warmup_updates)
    init = cfg.warmup_init_lr / cfg.lr

    def schedule(done: int) -> float:
        step = done + 1  # the update this rate is for
        if step < warmup:
            return init + (1.0 - init) * step / warmup
        return (warmup / step) ** 0.5

    return schedule


class ReduceOnRise(torch.optim.lr_scheduler.LRScheduler):
    """``lr_scheduler: reduce_on_rise`` (Shen et al. 2018, §4.3, after Gehring et al. 2017): the learning rate
    stays at ``lr`` and is divided by ``factor`` whenever the validation loss rises above the previous
    validation's; training stops once it falls below ``min_lr``. Meant for ``optimizer: nesterov``, ``lr: 0.25``.

    ``step()`` (every update) keeps the current rate; the Trainer calls :meth:`validation_end` after each
    validation. The state (current scale, previous loss) is in ``state_dict()``, so a resumed run continues it.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, factor: float = 10.0, min_lr: float = 1e-4) -> None:
        self.factor, self.min_lr = factor, min_lr
        self.scale = 1.0
        self.previous_loss: float | None = None
        super().__init__(optimizer)

    def get_lr(self) -> list[float]:
        return [base * self.scale for base in self.base_lrs]

    def validation_end(self, loss: float) -> str | None:
        """Record a validation loss; divide the rate if it rose. Returns why to stop training, or None."""
        if self.previous_loss is not None and loss > self.previous_loss:
            self.scale /= self.factor
            for group, lr in zip(self.optimizer.param_groups, self.get_lr()):
                group["lr"] = lr
            self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        self.previous_loss = loss
        lr = max(group["lr"] for group in self.optimizer.param_groups)
        return f"learning rate {lr:.3g} fell below min_lr={self.min_lr:g}" if lr < self.min_lr else None


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> torch.optim.lr_scheduler.LRScheduler:
    if cfg.lr_scheduler == "reduce_on_rise":
        return ReduceOnRise(optimizer)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
