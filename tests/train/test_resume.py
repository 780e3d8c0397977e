"""Resuming and restarting: the run's own settings, finished runs, budget cuts, fresh starts, the log, the
checkpoint files (permissions, failed writes, averaging) and the learning-rate schedule."""
from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from nmtflow import checkpoint as checkpoint_module
from nmtflow.checkpoint import CheckpointError, FORMAT, average_checkpoints, load_checkpoint, save_atomic
from nmtflow.cli import main
from nmtflow.config import ConfigError, TrainConfig
from nmtflow.train.optim import build_optimizer, build_scheduler
from nmtflow.train.trainer import Trainer, changed_settings, read_log

from tests.conftest import tiny_config
from tests.train.test_robustness import losses, train_in_process


def small_config(data: Path, save_dir: Path, **train: object):
    """tests.train.test_robustness's tiny run, any of whose training settings may be given."""
    config = tiny_config(data, save_dir, **{"valid_bleu": False, "validate_every": 0, "save_every": 0, "threads": 1,
                                            **train})
    config.model.d_model, config.model.ffn_dim = 32, 64
    config.data.max_tokens = 300
    return config


def valid_entries(save_dir: Path) -> list[tuple[int, float]]:
    return [(e["update"], e["nll"]) for e in read_log(save_dir) if e["kind"] == "valid"]


def test_resuming_with_other_settings_is_refused_naming_them(copy_data: Path, tmp_path: Path) -> None:
    config = small_config(copy_data, tmp_path / "run", max_updates=3)
    train_in_process(config)
    changed = small_config(copy_data, tmp_path / "run", max_updates=6, lr=1e-4)
    changed.data.max_tokens = 200
    with pytest.raises(ConfigError, match=r"checkpoint_last\.pt: this run was trained with other settings "
                                          r"\(data\.max_tokens: 300 → 200; train\.lr: 0\.003 → 0\.0001\)"):
        Trainer(changed)
    # budgets, validation, logging, device and decoding may change: the run continues
    more = small_config(copy_data, tmp_path / "run", max_updates=5, log_every=2, validate_every=4)
    more.decode.beam_size = 1
    train_in_process(more)
    assert load_checkpoint(tmp_path / "run" / "checkpoint_last.pt")["progress"]["update"] == 5


def test_changed_settings_compares_only_what_both_sides_have() -> None:
    saved = {"model": {"d_model": 32, "heads": 4}, "train": {"lr": 1.0, "max_updates": 5, "betas": [0.9, 0.98]},
             "decode": {"beam_size": 4}}
    current = {"model": {"d_model": 32, "heads": 2, "new_option": True},
               "train": {"lr": 1.0, "max_updates": 9, "betas": (0.9, 0.98)}, "decode": {"beam_size": 1}}
    assert changed_settings(saved, current) == [("model.heads", 4, 2)]


def test_a_finished_run_stays_finished(copy_data: Path, tmp_path: Path) -> None:
    config = small_config(copy_data, tmp_path / "run", max_updates=10_000, max_epochs=1)
    train_in_process(config)
    done = load_checkpoint(tmp_path / "run" / "checkpoint_last.pt")["progress"]
    assert done["stopped"] == "reached max_epochs=1" and done["epoch"] == 2
    log_before = (tmp_path / "run" / "log.jsonl").read_text(encoding="utf-8")
    trainer = train_in_process(small_config(copy_data, tmp_path / "run", max_updates=10_000, max_epochs=1))
    assert trainer.progress.update == done["update"] and trainer.progress.stopped == "reached max_epochs=1"
    assert (tmp_path / "run" / "log.jsonl").read_text(encoding="utf-8") == log_before
    # a raised budget continues it
    trainer = train_in_process(small_config(copy_data, tmp_path / "run", max_updates=done["update"] + 2, max_epochs=2))
    assert trainer.progress.update == done["update"] + 2


def test_a_budget_cut_then_continued_trains_as_one_never_cut(copy_data: Path, tmp_path: Path) -> None:
    # the cut at update 7 validates off schedule; that must not count for patience (or reduce_on_rise)
    def config(name: str, updates: int):
        return small_config(copy_data, tmp_path / name, max_updates=updates, validate_every=3, patience=100)

    full = train_in_process(config("full", 16))
    train_in_process(config("cut", 7))
    assert valid_entries(tmp_path / "cut")[-1][0] == 7  # the budget's final validation
    cut = train_in_process(config("cut", 16))
    assert losses(tmp_path / "cut") == losses(tmp_path / "full")
    scheduled = [entry for entry in valid_entries(tmp_path / "cut") if entry[0] != 7]
    assert scheduled == valid_entries(tmp_path / "full")
    assert (cut.progress.best, cut.progress.bad_validations) == (full.progress.best, full.progress.bad_validations)


def test_a_resume_where_the_budget_ends_gets_the_validation_its_checkpoint_missed(copy_data: Path,
                                                                                  tmp_path: Path) -> None:
    run = tmp_path / "run"
    train_in_process(small_config(copy_data, run, max_updates=4, save_every=2))  # validates only at its end (4)
    assert [u for u, _ in valid_entries(run)] == [4]
    finished = load_checkpoint(run / "checkpoint_last.pt")

    def resume_from(progress: dict, max_updates: int) -> Trainer:
        ckpt = load_checkpoint(run / "checkpoint_2.pt")
        ckpt["progress"] = progress
        save_atomic(ckpt, run / "checkpoint_last.pt")
        return train_in_process(small_config(copy_data, run, max_updates=max_updates))

    # a periodic checkpoint under a budget lowered to where it stands: the run ends there, validated
    trainer = resume_from(load_checkpoint(run / "checkpoint_2.pt")["progress"], max_updates=2)
    assert [u for u, _ in valid_entries(run)] == [2] and trainer.progress.validated_at == 2
    ended = load_checkpoint(run / "checkpoint_last.pt")["progress"]
    assert (ended["stopped"], ended["validated_at"]) == ("reached max_updates=2", 2)
    log = (run / "log.jsonl").read_text(encoding="utf-8")
    train_in_process(small_config(copy_data, run, max_updates=2))  # once ended, the same command does nothing
    assert (run / "log.jsonl").read_text(encoding="utf-8") == log
    # checkpoints written before validated_at existed: interrupted during the last update, it validates ...
    old = {k: v for k, v in ended.items() if k != "validated_at"}
    (run / "log.jsonl").write_text("", encoding="utf-8")
    resume_from({**old, "stopped": "interrupted (resume with the same command)"}, max_updates=2)
    assert [u for u, _ in valid_entries(run)] == [2]
    # ... ended by its budget, it had the validation and stays finished
    (run / "log.jsonl").write_text("", encoding="utf-8")
    resume_from({**old, "stopped": "reached max_updates=2"}, max_updates=2)
    assert valid_entries(run) == []
    assert finished["progress"]["validated_at"] == 4


def test_a_fresh_start_removes_the_earlier_runs_checkpoints(copy_data: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    train_in_process(small_config(copy_data, run, max_updates=6, save_every=2, validate_every=2))
    assert {p.name for p in run.glob("checkpoint_*.pt")} >= {"checkpoint_6.pt", "checkpoint_best.pt"}
    restarted = small_config(copy_data, run, max_updates=3, save_every=3)
    threads = torch.get_num_threads()
    try:
        Trainer(restarted, resume=False).train()
    finally:
        torch.set_num_threads(threads)
    names = sorted(p.name for p in run.glob("checkpoint_*.pt"))
    assert names == ["checkpoint_3.pt", "checkpoint_best.pt", "checkpoint_last.pt"]
    assert all(load_checkpoint(run / name)["progress"]["update"] == 3 for name in names)  # all of the new run
    assert max(e["update"] for e in read_log(run)) == 3


def test_a_torn_last_log_line_does_not_block_resuming(copy_data: Path, tmp_path: Path) -> None:
    train_in_process(small_config(copy_data, tmp_path / "run", max_updates=3))
    with open(tmp_path / "run" / "log.jsonl", "a", encoding="utf-8") as log:
        log.write('{"kind": "train", "update": 4, "lo')  # a kill in the middle of a write
    trainer = train_in_process(small_config(copy_data, tmp_path / "run", max_updates=5))
    assert trainer.progress.update == 5 and [u for u, _ in losses(tmp_path / "run")] == [1, 2, 3, 4, 5]


def test_checkpoints_get_ordinary_file_permissions(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        save_atomic({"format": FORMAT}, tmp_path / "a.pt")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "a.pt").stat().st_mode) == 0o644


def test_a_failed_checkpoint_write_names_the_file_and_keeps_the_old_one(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "checkpoint_last.pt"
    save_atomic({"format": FORMAT, "step": 1}, path)

    def full_disk(obj: object, handle: object) -> None:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(checkpoint_module.torch, "save", full_disk)
    with pytest.raises(OSError, match=rf"^{path}: could not write the checkpoint \(\[enforce fail"):
        save_atomic({"format": FORMAT, "step": 2}, path)
    monkeypatch.undo()
    assert load_checkpoint(path)["step"] == 1 and not list(tmp_path.glob(".*.tmp"))


def test_only_checkpoints_of_one_model_are_averaged(copy_data: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    for name, heads in (("a", 4), ("b", 2)):
        config = small_config(copy_data, tmp_path / name, max_updates=1)
        config.model.heads = heads
        train_in_process(config)
    a, b = (str(tmp_path / n / "checkpoint_last.pt") for n in "ab")
    with pytest.raises(CheckpointError, match=r"b/checkpoint_last\.pt: the model differs \(model\.heads: 2, not 4\) "
                                              r"from .*a/checkpoint_last\.pt"):
        average_checkpoints([Path(a), Path(b)])
    tuned = load_checkpoint(a)  # as a fine-tuning run that raised the dropout: the same model, averaged
    tuned["config"]["model"]["dropout"] = 0.3
    save_atomic(tuned, tmp_path / "tuned.pt")
    assert average_checkpoints([Path(a), tmp_path / "tuned.pt"])["config"]["model"]["dropout"] == 0.3
    assert main(["average", str(tmp_path / "nowhere"), "--last", "2", "-o", str(tmp_path / "avg.pt")]) == 2
    assert f"{tmp_path / 'nowhere'}: no such checkpoint or save dir" in capsys.readouterr().err
    wide = load_checkpoint(a)
    wide["model"] = {k: torch.cat([v, v]) if v.dim() else v for k, v in wide["model"].items()}
    save_atomic(wide, tmp_path / "wide.pt")
    assert main(["average", a, str(tmp_path / "wide.pt"), "-o", str(tmp_path / "avg.pt")]) == 2
    assert "has shape" in capsys.readouterr().err
    assert main(["average", str(tmp_path / "a"), "--last", "0", "-o", str(tmp_path / "avg.pt")]) == 2
    assert "--last: must be >= 1" in capsys.readouterr().err
    assert main(["average", a, a, "--last", "1", "-o", str(tmp_path / "avg.pt")]) == 2  # was silently ignored
    assert "with checkpoint files given, every one is averaged" in capsys.readouterr().err
    assert not (tmp_path / "avg.pt").exists()


@pytest.mark.parametrize("warmup", [1, 4, 10])
def test_inverse_sqrt_peaks_at_the_warmup_update(warmup: int) -> None:
    """Vaswani et al. 2017, Eq. 3: update s (1-based) takes lr·s/warmup up to s = warmup, then lr·sqrt(warmup/s)."""
    cfg = TrainConfig(lr=3e-3, warmup_updates=warmup, warmup_init_lr=0.0, fused_optimizer=False)
    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = build_optimizer([weight], cfg)
    scheduler = build_scheduler(optimizer, cfg)
    used = []
    for _ in range(2 * warmup + 3):
        used.append(optimizer.param_groups[0]["lr"])  # the rate of this update
        weight.grad = torch.ones(2)
        optimizer.step()
        scheduler.step()
    expected = [3e-3 * min(s / warmup, (warmup / s) ** 0.5) for s in range(1, 2 * warmup + 4)]
    assert used == pytest.approx(expected, rel=1e-9)
    assert max(used) == pytest.approx(3e-3) and used.index(max(used)) == warmup - 1


def test_more_processes_than_batches_is_an_error_not_a_hang(copy_data: Path, tmp_path: Path) -> None:
    from nmtflow.data.batching import TokenBatchSampler

    trainer = Trainer(small_config(copy_data, tmp_path / "run", max_updates=1))
    data = trainer.train_data
    trainer.sampler = TokenBatchSampler(data.src.sizes, data.tgt.sizes, 300, shuffle=True, num_shards=100_000)
    with pytest.raises(ConfigError, match=r"fewer batches of data\.max_tokens=300 than the 1 processes"):
        next(trainer.batches())
