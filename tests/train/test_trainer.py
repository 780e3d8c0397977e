"""Training: exact resume, checkpoints (atomic, safe, averaged), and a tiny task that must be learnt."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nmtflow.checkpoint import CheckpointError, average_checkpoints, load_checkpoint, save_atomic
from nmtflow.decode.translate import Translator
from nmtflow.evaluate.metrics import bleu
from nmtflow.train.trainer import Trainer, read_log

from tests.conftest import copy_sentences, tiny_config


def losses(save_dir: Path) -> list[tuple[int, float]]:
    return [(e["update"], e["loss"]) for e in read_log(save_dir) if e["kind"] == "train"]


def test_interrupted_then_resumed_run_reproduces_the_losses_exactly(copy_data: Path, tmp_path: Path) -> None:
    full = Trainer(tiny_config(copy_data, tmp_path / "full", max_updates=30, valid_bleu=False)).train()
    assert full.progress.update == 30
    # the same run, stopped at update 13 (a checkpoint is written when training stops) ...
    Trainer(tiny_config(copy_data, tmp_path / "cut", max_updates=13, valid_bleu=False)).train()
    # ... then resumed with the full budget: picks up model, optimiser, schedule, RNG and data position
    resumed = Trainer(tiny_config(copy_data, tmp_path / "cut", max_updates=30, valid_bleu=False))
    assert resumed.progress.update == 13
    resumed.train()
    assert losses(tmp_path / "cut") == losses(tmp_path / "full")
    a = load_checkpoint(tmp_path / "full" / "checkpoint_last.pt")["model"]
    b = load_checkpoint(tmp_path / "cut" / "checkpoint_last.pt")["model"]
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_copy_task_reaches_90_bleu(copy_data: Path, tmp_path: Path) -> None:
    config = tiny_config(copy_data, tmp_path / "copy", max_updates=800, validate_every=200, save_every=200,
                         log_every=50, lr=5e-3, warmup_updates=100)
    result = Trainer(config).train()
    valid = [e for e in result.history if e["kind"] == "valid"]
    assert valid and valid[-1]["nll"] < valid[0]["nll"]
    translator = Translator.from_checkpoint(tmp_path / "copy" / "checkpoint_best.pt")
    sources = copy_sentences(60, seed=99)  # unseen sentences
    # greedy, as validation BLEU chose the checkpoint (seeds 1-3: 95.1, 97.0, 94.7); beam 5 with the GNMT length
    # penalty lets this small model end some copies early (88.6, 93.3, 94.4)
    for greedy, threshold in ((True, 90.0), (False, 85.0)):
        translator.decode.greedy = greedy
        hyps = [nb[0][0] for nb in translator.translate(sources)]
        score = bleu(hyps, sources).score
        assert score >= threshold, (greedy, score, hyps[:3])


def test_checkpoints_are_atomic_safe_and_averageable(copy_data: Path, tmp_path: Path) -> None:
    save = tmp_path / "ckpt"
    Trainer(tiny_config(copy_data, save, max_updates=40, save_every=10, keep_checkpoints=3, valid_bleu=False)).train()
    periodic = sorted(p.name for p in save.glob("checkpoint_*.pt") if p.stem.split("_")[1].isdigit())
    assert periodic == ["checkpoint_20.pt", "checkpoint_30.pt", "checkpoint_40.pt"]
    assert not list(save.glob("*.tmp"))
    paths = [save / n for n in ("checkpoint_30.pt", "checkpoint_40.pt")]
    avg = average_checkpoints(paths)
    a, b = (load_checkpoint(p)["model"] for p in paths)
    key = "decoder.layers.0.ffn.fc1.weight"
    torch.testing.assert_close(avg["model"][key], (a[key] + b[key]) / 2)
    save_atomic(avg, tmp_path / "avg.pt")
    Translator.from_checkpoint(tmp_path / "avg.pt").translate(["alpha bravo"])

    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes((save / "checkpoint_last.pt").read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="truncated.pt"):
        load_checkpoint(truncated)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"\x00\xff not a checkpoint")
    with pytest.raises(CheckpointError, match="garbage.pt"):
        Translator.from_checkpoint(garbage)


def test_early_stopping_and_gradient_accumulation(copy_data: Path, tmp_path: Path) -> None:
    # a learning rate of ~0 cannot improve the validation loss: patience 2 stops after the third validation
    config = tiny_config(copy_data, tmp_path / "stop", max_updates=100, validate_every=3, valid_bleu=False,
                         lr=1e-12, lr_scheduler="constant", patience=2, early_stop_metric="loss", update_freq=2)
    trainer = Trainer(config)
    per_epoch = len(trainer.epoch_batches(1))
    result = trainer.train()
    assert result.progress.stopped.startswith("early stopping")
    assert result.progress.update == 9
    consumed = (result.progress.epoch - 1) * per_epoch + result.progress.position
    assert consumed == 2 * 9  # update_freq=2: two batches per update


def test_each_log_line_has_the_means_of_the_updates_since_the_last(copy_data: Path, tmp_path: Path) -> None:
    """``log.jsonl``'s train entries keep the logged update's own loss and add the token-weighted means since the
    previous entry (what the console line shows: one batch's loss swings with its direction or length)."""
    import itertools

    every = Trainer(tiny_config(copy_data, tmp_path / "every", max_updates=12, valid_bleu=False)).train()
    fours = Trainer(tiny_config(copy_data, tmp_path / "fours", max_updates=12, valid_bleu=False, log_every=4)).train()
    per_update = {e["update"]: e for e in every.history if e["kind"] == "train"}
    tokens = [b.num_tgt_tokens for _, _, b in itertools.islice(
        Trainer(tiny_config(copy_data, tmp_path / "batches", valid_bleu=False)).batches(), 12)]
    logged = [e for e in fours.history if e["kind"] == "train"]
    assert [e["update"] for e in logged] == [4, 8, 12] and all(e["mean_of_updates"] == 4 for e in logged)
    for entry in logged:
        window = range(entry["update"] - 3, entry["update"] + 1)
        weights = [tokens[u - 1] for u in window]
        for key in ("loss", "nll"):
            mean = sum(per_update[u][key] * w for u, w in zip(window, weights)) / sum(weights)
            assert entry[f"{key}_mean"] == pytest.approx(mean, rel=1e-6)
            assert entry[key] == per_update[entry["update"]][key]
    assert len({round(e["loss_mean"] - e["loss"], 9) for e in logged}) > 1  # the means are not the last losses


def test_time_the_process_stood_stopped_is_not_training_time(copy_data: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``train.max_minutes``, the reported training time and tokens/s run on ``RunningClock`` (which leaves out a
    ``kill -STOP``/Ctrl-Z pause: tests/test_runtime.py): a clock that stands still, as for a run stopped throughout,
    leaves even a tiny time budget unspent, where the wall clock spends it at the first update."""
    config = tiny_config(copy_data, tmp_path / "wall", max_updates=6, valid_bleu=False, max_minutes=1e-9)
    assert Trainer(config).train().progress.update == 1

    class StoodStopped:
        def __call__(self) -> float:
            return 0.0

        def close(self) -> None:
            pass

    monkeypatch.setattr("nmtflow.train.trainer.RunningClock", StoodStopped)
    config = tiny_config(copy_data, tmp_path / "stopped", max_updates=6, valid_bleu=False, max_minutes=1e-9)
    result = Trainer(config).train()
    assert result.progress.update == 6 and result.progress.elapsed == 0.0
