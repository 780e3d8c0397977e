"""Nesterov SGD with the reduce-on-rise schedule (Shen et al. 2018, §4.3)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from nmtflow.config import TrainConfig
from nmtflow.train.optim import ReduceOnRise, build_optimizer, build_scheduler


def schedule() -> tuple[torch.optim.Optimizer, ReduceOnRise]:
    cfg = TrainConfig(optimizer="nesterov", lr=0.25, lr_scheduler="reduce_on_rise")
    optimizer = build_optimizer([nn.Parameter(torch.zeros(3))], cfg)
    scheduler = build_scheduler(optimizer, cfg)
    assert isinstance(scheduler, ReduceOnRise)
    return optimizer, scheduler


def test_nesterov_sgd() -> None:
    optimizer, _ = schedule()
    assert isinstance(optimizer, torch.optim.SGD)
    assert optimizer.defaults["nesterov"] and optimizer.defaults["momentum"] == 0.99


def test_lr_is_divided_by_ten_whenever_validation_loss_rises_and_training_stops_below_1e_4() -> None:
    optimizer, scheduler = schedule()
    lrs, stops = [], []
    for loss in [5.0, 4.0, 4.5, 4.4, 4.6, 4.7, 4.8]:
        for _ in range(3):  # updates between validations leave the rate alone
            optimizer.step()
            scheduler.step()
        stops.append(scheduler.validation_end(loss))
        lrs.append(optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx([0.25, 0.25, 0.025, 0.025, 0.0025, 2.5e-4, 2.5e-5])
    assert stops[:-1] == [None] * 6  # 2.5e-4 is still above 1e-4
    assert stops[-1] is not None and "min_lr" in stops[-1]


def test_schedule_state_survives_a_checkpoint() -> None:
    optimizer, scheduler = schedule()
    for loss in (3.0, 3.5):
        scheduler.validation_end(loss)
    opt2, sched2 = schedule()
    opt2.load_state_dict(optimizer.state_dict())
    sched2.load_state_dict(scheduler.state_dict())
    opt2.step()
    sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.025)
    sched2.validation_end(3.6)  # a rise relative to the restored previous loss (3.5)
    assert opt2.param_groups[0]["lr"] == pytest.approx(0.0025)
