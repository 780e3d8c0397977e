"""Where a comparison stands while it runs: ``nmtflow compare EXP --status`` (reads its files, trains nothing).

Per (run, direction, seed) of the experiment, from the run directory alone (``job.json``, ``log.jsonl``, the
markers :mod:`nmtflow.evaluate.compare_job` writes, the save dir's ``.lock``): its state (done, training,
interrupted, failed, not started), the updates done out of its budget's total, the epoch, the last logged speed,
the training time so far and the time left at that rate, and its last validation (greedy BLEU, the mean over the
trained directions for a multilingual run, whose per-direction scores, zero-shot ones marked, follow in a
second table). The total of an epoch budget is ``epochs × batches per epoch`` (the ``start`` entry the trainer
logs when it starts or resumes; the process output ``train.log`` for logs written before that entry existed);
the time left is ``updates left × training seconds per update`` since the run last started or resumed, the
median over the intervals between its log lines (so neither a validation nor a spell with the process stopped
skews it; the time between a stop and the resume is not counted at all).
"""
from __future__ import annotations

import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from nmtflow.evaluate.compare_job import FINISHED, TRAINED, lock_holder, read_json
from nmtflow.evaluate.experiment import ExperimentConfig
from nmtflow.train.trainer import read_log

_BATCHES_LINE = re.compile(r"(\d+) batches per epoch")


@dataclass
class RunStatus:
    """One run directory's progress, as :func:`run_status` reads it."""

    name: str
    dir: Path
    state: str = "not started"
    update: int = 0
    total: int | None = None  # updates the budget allows (None: a time budget, or unknown)
    epoch: int | None = None
    tokens_per_s: float | None = None
    elapsed: float | None = None  # training seconds so far (validation included)
    seconds_per_update: float | None = None  # the pace the time left is reckoned at
    valid_update: int | None = None
    valid_bleu: float | None = None  # the last validation's greedy BLEU (multilingual: supervised mean)
    best_bleu: float | None = None
    directions: dict[str, float] = field(default_factory=dict)  # the last validation, per direction
    zero_shot: list[str] = field(default_factory=list)

    @property
    def seconds_left(self) -> float | None:
        if self.state not in ("training", "interrupted"):
            return None
        if not self.total or not self.seconds_per_update:
            return None
        return max(self.total - self.update, 0) * self.seconds_per_update


def _zero_shot(run_dir: Path) -> list[str]:
    try:
        config = yaml.safe_load((run_dir / "run.yaml").read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError):
        return []
    multilingual = (config.get("data") or {}).get("multilingual") or {}
    return [str(d) for d in multilingual.get("zero_shot") or []]


def _pace(starts: list[dict[str, Any]], speeds: list[dict[str, Any]]) -> float | None:
    """Training seconds per update since the run last started: the median over the log lines' intervals (a
    validation, or a process stopped for a while, lengthens one interval, not the estimate); with fewer than three
    intervals, their mean."""
    first = int(starts[-1]["update"]) if starts else 0
    points = [(first, float(starts[-1]["elapsed"]))] if starts else [(0, 0.0)]
    points += [(int(e["update"]), float(e["elapsed"])) for e in speeds if "elapsed" in e and int(e["update"]) > first]
    paces = [(t1 - t0) / (u1 - u0) for (u0, t0), (u1, t1) in zip(points, points[1:]) if u1 > u0 and t1 >= t0]
    if not paces:
        return None
    if len(paces) < 3:
        return (points[-1][1] - points[0][1]) / (points[-1][0] - points[0][0])
    return statistics.median(paces)


def run_status(name: str, run_dir: Path) -> RunStatus:
    """The progress of the run in ``run_dir`` (a comparison's ``runs/NAME/[DIRECTION/]seed-S``)."""
    s = RunStatus(name=name, dir=run_dir)
    if not run_dir.is_dir():
        return s
    entries = read_log(run_dir)  # a torn last line (a write cut short) is left out
    job = read_json(run_dir / "job.json") or {}
    if (run_dir / FINISHED).is_file():
        s.state = "done"
    elif lock_holder(run_dir / ".lock") is not None:  # the trainer's: training now
        s.state = "training"
    elif (run_dir / TRAINED).is_file():
        s.state = "trained, not decoded"
    elif (run_dir / "error.log").is_file():
        s.state = "failed"
    elif entries or (run_dir / "checkpoint_last.pt").is_file():
        s.state = "interrupted"
    s.update = max((int(e.get("update", 0)) for e in entries), default=0)
    starts = [e for e in entries if e.get("kind") == "start"]
    batches = int(starts[-1]["batches_per_epoch"]) if starts else None
    if batches is None and (run_dir / "train.log").is_file():  # logs from before the start entry
        found = _BATCHES_LINE.findall((run_dir / "train.log").read_text(encoding="utf-8", errors="replace"))
        batches = int(found[-1]) if found else None
    budget = job.get("budget") or {}
    totals = [int(budget["updates"])] if budget.get("updates") else []
    if budget.get("epochs") and batches:
        totals.append(int(budget["epochs"]) * batches)
    s.total = min(totals) if totals else None
    if batches:
        s.epoch = s.update // batches + 1
        if budget.get("epochs"):
            s.epoch = min(s.epoch, int(budget["epochs"]))
    speeds = [e for e in entries if e.get("kind") == "speed"]
    if speeds:
        s.tokens_per_s = float(speeds[-1]["tgt_tokens_per_s"])
        if "elapsed" in speeds[-1]:
            s.elapsed = float(speeds[-1]["elapsed"])
            s.seconds_per_update = _pace(starts, speeds)
    valid = [e for e in entries if e.get("kind") == "valid" and "bleu" in e]
    if valid:
        s.valid_update, s.valid_bleu = int(valid[-1]["update"]), float(valid[-1]["bleu"])
        s.best_bleu = max(float(e["bleu"]) for e in valid)
    per = [e for e in entries if e.get("kind") == "valid_directions" and any(k.startswith("bleu.") for k in e)]
    if per:
        s.directions = {k[len("bleu."):]: float(v) for k, v in per[-1].items() if k.startswith("bleu.")}
        s.zero_shot = _zero_shot(run_dir)
    return s


def show_status(experiment: str | Path, out: str | Path | None = None, overrides: list[str] | None = None,
                only: list[str] | None = None) -> str:
    """``nmtflow compare EXP --status``: the table of :func:`status_table` for the comparison in ``out``."""
    from nmtflow.evaluate.compare import comparison_dir
    from nmtflow.evaluate.experiment import load_experiment

    exp = load_experiment(experiment, overrides)
    if only:
        exp.select(only)
    out = comparison_dir(exp, out)
    if not (out / "runs").is_dir():
        raise FileNotFoundError(f"{out}: no comparison has run there yet (nmtflow compare {experiment} --out {out} "
                                "starts one)")
    return status_table(comparison_status(exp, out))


def comparison_status(exp: ExperimentConfig, out: Path) -> list[RunStatus]:
    """Every (run, direction, seed) of ``exp`` (after ``--only``) in the comparison directory ``out``, in run
    order, a run not started yet as ``not started``."""
    from nmtflow.evaluate.compare import job_dir, load_run_config, model_directions

    statuses = []
    for index, run in enumerate(exp.runs):
        multilingual = bool(run.directions) and load_run_config(exp, index).data.multilingual is not None
        for direction in model_directions(run, multilingual):
            for seed in exp.seeds:
                label = f"{run.name}{f' {direction}' if direction else ''} (seed {seed})"
                statuses.append(run_status(label, job_dir(out, run.name, direction, seed)))
    return statuses


def _duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "?"
    minutes = int(round(seconds / 60))
    return f"{minutes // 60} h {minutes % 60:02d} min" if minutes >= 60 else f"{minutes} min"


def _number(x: float | None, fmt: str = "{:.2f}") -> str:
    return "" if x is None else fmt.format(x)


def status_table(statuses: list[RunStatus]) -> str:
    """A Markdown table of the runs, then one of the last validation's per-direction BLEU of each multilingual
    run (zero-shot directions marked ``*``)."""
    lines = ["| run | state | update | of | epoch | tok/s | trained | left (at that rate) | last valid BLEU (update) "
             "| best |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for s in statuses:
        done = f" ({100 * s.update / s.total:.1f}%)" if s.total else ""
        valid = f"{s.valid_bleu:.2f} ({s.valid_update:,})" if s.valid_bleu is not None else ""
        lines.append(f"| {s.name} | {s.state} | {s.update:,}{done} | {_number(s.total, '{:,}')} | "
                     f"{_number(s.epoch, '{}')} | {_number(s.tokens_per_s, '{:,.0f}')} | "
                     f"{_duration(s.elapsed) if s.elapsed is not None else ''} | "
                     f"{_duration(s.seconds_left) if s.seconds_left is not None else ''} | {valid} | "
                     f"{_number(s.best_bleu)} |")
    for s in statuses:
        if not s.directions:
            continue
        names = list(s.directions)
        lines += ["", f"{s.name}, greedy validation BLEU per direction at update {s.valid_update or s.update:,}"
                      + (" (* zero-shot)" if any(d in s.zero_shot for d in names) else "") + ":", "",
                  "| " + " | ".join(d + ("*" if d in s.zero_shot else "") for d in names) + " |",
                  "|" + " ---: |" * len(names),
                  "| " + " | ".join(f"{s.directions[d]:.2f}" for d in names) + " |"]
    return "\n".join(lines)
