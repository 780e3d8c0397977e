"""``nmtflow compare EXP --status``: where each run of a comparison stands, read from its files alone."""
from __future__ import annotations

import json
import logging
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from nmtflow.checkpoint import lock_save_dir, unlock_save_dir
from nmtflow.cli import main
from nmtflow.evaluate.compare import run_comparison
from nmtflow.evaluate.compare_status import run_status, show_status, status_table
from nmtflow.train.trainer import Trainer, read_log
from tests.conftest import tiny_config

TINY = """\
name: tiny-status
data:
  synthetic: {n_train: 200, n_valid: 10, n_test: 10, langs: [en, de]}
  directions: [en-de]
  vocab_size: 200
  byte_fallback: false
overrides: [model.d_model=32, model.ffn_dim=64, model.heads=2, model.encoder_layers=1, model.decoder_layers=1,
            data.max_tokens=1500, train.warmup_updates=5, train.validate_every=4, train.save_every=4,
            train.log_every=2, train.progress=false, train.valid_bleu_max_sentences=10]
runs:
  - {name: first, config: transformer-small}
  - {name: second, config: transformer-small, overrides: [model.dropout=0.2]}
budget: {epochs: 2}
seeds: [1]
decode: {beam_size: 1}
test_sets: [valid]
threads: 1
"""


def rows(table: str) -> dict[str, list[str]]:
    """The first table's rows by run label."""
    first = table.split("\n\n")[0]
    return {cells[0]: cells[1:] for line in first.splitlines()[2:]
            for cells in [[c.strip() for c in line.strip().strip("|").split("|")]]}


def test_a_finished_run_and_one_not_started(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            caplog: pytest.LogCaptureFixture) -> None:
    exp = tmp_path / "tiny.yaml"
    exp.write_text(TINY, encoding="utf-8")
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO, logger="nmtflow.compare"):
        run_comparison(exp, out=out, only=["first"])
    hint = caplog.text.split("where they stand, from another shell: ")[1].splitlines()[0]
    assert shlex.split(hint)[:2] == ["nmtflow", "compare"] and hint.endswith(" --only first --status")
    log = read_log(out / "runs" / "first" / "seed-1")
    start = [e for e in log if e["kind"] == "start"]
    assert len(start) == 1 and start[0]["update"] == 0 and start[0]["elapsed"] == 0
    batches = start[0]["batches_per_epoch"]
    valid = [e for e in log if e["kind"] == "valid"]
    table = rows(show_status(exp, out=out))
    state, update, total, epoch, tok_s, trained, left, last_valid, best = table["first (seed 1)"]
    assert (state, update, total, epoch) == ("done", f"{2 * batches:,} (100.0%)", f"{2 * batches:,}", "2")
    assert last_valid == f"{valid[-1]['bleu']:.2f} ({valid[-1]['update']:,})" and left == ""
    assert best == f"{max(e['bleu'] for e in valid):.2f}" and float(tok_s.replace(",", "")) > 0
    assert table["second (seed 1)"][:2] == ["not started", "0"]
    # the same from the command line, one run only
    assert main(["compare", str(exp), "--out", str(out), "--status", "--only", "second"]) == 0
    printed = capsys.readouterr().out
    assert "second (seed 1) | not started" in printed and "first" not in printed
    assert not (out / "runs" / "second").exists()  # --status trains nothing
    assert main(shlex.split(hint)[1:]) == 0  # the command the comparison logged
    assert "first (seed 1) | done" in capsys.readouterr().out


def test_status_of_a_directory_without_a_comparison_is_a_clear_error(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    exp = tmp_path / "tiny.yaml"
    exp.write_text(TINY, encoding="utf-8")
    assert main(["compare", str(exp), "--out", str(tmp_path / "nothing"), "--status"]) == 2
    err = capsys.readouterr().err
    assert "nothing: no comparison has run there yet" in err and "Traceback" not in err


def write_run(run_dir: Path, entries: list[dict], *, locked: bool, epochs: int = 3) -> None:
    """A save dir with these log entries; ``locked``: this process holds its lock, as a training does."""
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "job.json").write_text(json.dumps({"budget": {"updates": None, "epochs": epochs, "minutes": None}}),
                                      encoding="utf-8")
    (run_dir / "run.yaml").write_text(yaml.safe_dump({"data": {"multilingual": {"zero_shot": ["de-fr"]}}}),
                                      encoding="utf-8")
    lines = [json.dumps(e) for e in entries] + ['{"kind": "spe']  # a torn last line is left out
    (run_dir / "log.jsonl").write_text("\n".join(lines), encoding="utf-8")
    if locked:
        lock_save_dir(run_dir)


PROGRESS = [
    {"kind": "train", "update": 50, "loss": 5.0},
    {"kind": "speed", "update": 50, "tgt_tokens_per_s": 900.0, "elapsed": 100.0},
    {"kind": "valid_directions", "update": 100, "bleu.de-en": 20.0, "bleu.de-fr": 1.0},
    {"kind": "valid", "update": 100, "nll": 3.0, "bleu": 20.0},
    {"kind": "valid_directions", "update": 150, "bleu.de-en": 18.5, "bleu.de-fr": 2.25},
    {"kind": "valid", "update": 150, "nll": 3.1, "bleu": 18.5},
    {"kind": "speed", "update": 150, "tgt_tokens_per_s": 850.0, "elapsed": 300.0},
]


def test_a_run_in_progress_its_time_left_and_its_directions(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_run(run, [{"kind": "start", "update": 0, "batches_per_epoch": 100, "elapsed": 0.0}, *PROGRESS],
              locked=True)
    s = run_status("multi (seed 1)", run)
    assert (s.state, s.update, s.total, s.epoch, s.tokens_per_s) == ("training", 150, 300, 2, 850.0)
    assert s.seconds_left == pytest.approx(150 * 300 / 150)  # updates left × training seconds per update
    assert (s.valid_update, s.valid_bleu, s.best_bleu) == (150, 18.5, 20.0)
    assert s.directions == {"de-en": 18.5, "de-fr": 2.25} and s.zero_shot == ["de-fr"]
    table = status_table([s])
    assert "| multi (seed 1) | training | 150 (50.0%) | 300 | 2 | 850 | 5 min | 5 min | 18.50 (150) | 20.00 |" in table
    assert "| de-en | de-fr* |" in table and "| 18.50 | 2.25 |" in table

    # resumed at update 100 after a stop: the time left at the pace since then (not over the whole run)
    write_run(run, [{"kind": "start", "update": 0, "batches_per_epoch": 100, "elapsed": 0.0}, *PROGRESS[:2],
                    {"kind": "start", "update": 100, "batches_per_epoch": 100, "elapsed": 240.0}, *PROGRESS[2:]],
              locked=True)
    assert run_status("multi", run).seconds_left == pytest.approx(150 * (300 - 240) / (150 - 100))
    # with more log lines, the median interval: one line after a long pause does not skew it
    steady = [{"kind": "speed", "update": u, "tgt_tokens_per_s": 900.0, "elapsed": 2.0 * u} for u in (10, 20, 30)]
    paused = {"kind": "speed", "update": 40, "tgt_tokens_per_s": 90.0, "elapsed": 60.0 + 2000.0}
    write_run(run, [{"kind": "start", "update": 0, "batches_per_epoch": 100, "elapsed": 0.0}, *steady, paused],
              locked=True)
    assert run_status("multi", run).seconds_left == pytest.approx((300 - 40) * 2.0)
    # the lock names a live process that does not hold it (a reused pid): not training
    unlock_save_dir(run)
    (run / ".lock").write_text(f"{os.getppid()}\n", encoding="ascii")
    if Path("/proc/self/fd").is_dir():  # elsewhere a live pid is all --status can know
        assert run_status("multi", run).state == "interrupted"
    # the process that held the lock is gone: interrupted (it resumes), time left still shown
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run / ".lock").write_text(f"{dead.pid}\n", encoding="ascii")
    assert run_status("multi", run).state == "interrupted"
    (run / "finished.json").write_text("{}", encoding="utf-8")
    done = run_status("multi", run)
    assert done.state == "done" and done.seconds_left is None


def test_a_log_from_before_the_start_entry_takes_the_epoch_size_from_train_log(tmp_path: Path) -> None:
    run = tmp_path / "run"
    write_run(run, [{k: v for k, v in e.items() if k != "elapsed"} for e in PROGRESS], locked=False, epochs=12)
    (run / "train.log").write_text("12:00:00 INFO nmtflow.train: model bridge: 59,882,506 parameters; 289820 "
                                   "training pairs, 4530 batches per epoch\n", encoding="utf-8")
    s = run_status("old", run)
    assert (s.state, s.total, s.epoch, s.elapsed, s.seconds_left) == ("interrupted", 12 * 4530, 1, None, None)


def test_the_trainer_logs_a_start_entry_at_each_start_and_the_training_time(copy_data: Path,
                                                                             tmp_path: Path) -> None:
    Trainer(tiny_config(copy_data, tmp_path, max_updates=4, validate_every=0, save_every=0)).train()
    trainer = Trainer(tiny_config(copy_data, tmp_path, max_updates=7, validate_every=0, save_every=0))
    batches = len(trainer.epoch_batches(trainer.progress.epoch))
    trainer.train()
    log = read_log(tmp_path)
    starts = [e for e in log if e["kind"] == "start"]
    assert [e["update"] for e in starts] == [0, 4] and {e["batches_per_epoch"] for e in starts} == {batches}
    assert starts[0]["elapsed"] == 0 and starts[1]["elapsed"] > 0
    elapsed = [e["elapsed"] for e in log if e["kind"] == "speed"]
    assert len(elapsed) == 7 and elapsed == sorted(elapsed) and elapsed[3] <= starts[1]["elapsed"] <= elapsed[4]
    Trainer(tiny_config(copy_data, tmp_path, max_updates=7, validate_every=0, save_every=0)).train()
    assert read_log(tmp_path) == log  # a finished run, run again, logs nothing
