"""The report of ``nmtflow compare``: ``results.md`` (the main table, then significance against the first run and
seed ensembles where they apply), ``results.json`` and PNG plots.

Per run, over its seeds: BLEU and chrF as mean ± sample standard deviation, the other columns as means
(peak memory: the maximum). Train tokens/s is the mean of the speeds the trainer logged (target tokens per
second, one value per ``train.log_every`` updates); decode sentences/s is test sentences over decoding
time; wall time is the training loop's wall-clock time (validation included, resumed sessions summed).
"""
from __future__ import annotations

import datetime
import logging
import os
import platform
from pathlib import Path
from statistics import mean, stdev
from typing import Any

from nmtflow.config import to_dict
from nmtflow.evaluate.compare_job import write_json
from nmtflow.evaluate.metrics import json_safe
from nmtflow.evaluate.experiment import ExperimentConfig

log = logging.getLogger("nmtflow.compare")
PLOTS = ("valid_bleu.png", "valid_loss.png", "train_loss.png", "bleu_vs_parameters.png")


def machine_info(device: str, threads: int | None) -> dict[str, Any]:
    """What the comparison ran on (:func:`nmtflow.runtime.machine_info`: CPU model and flags included)."""
    import torch

    from nmtflow.runtime import machine_info as describe
    from nmtflow.train.trainer import resolve_device

    return describe(resolve_device(device), threads=threads or torch.get_num_threads())


def _stats(values: list[float]) -> dict[str, Any] | None:
    if not values:
        return None
    return {"mean": mean(values), "std": stdev(values) if len(values) > 1 else 0.0, "n": len(values),
            "values": values}


def _mean(values: list[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return mean(values) if values else None


def summarize(exp: ExperimentConfig, outcomes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per run: aggregated metrics over its finished seeds, plus every seed's details."""
    runs = []
    for spec in exp.runs:
        mine = [o for o in outcomes if o["run"] == spec.name]
        done = [o["result"] for o in mine if o["status"] == "done" and o["result"]]
        keys = list(dict.fromkeys(k for r in done for k in r["scores"]))
        # bleu_lc: results recorded before it was scored lack it
        scores = {k: {m: _stats([r["scores"][k][m] for r in done if m in r["scores"].get(k, {})])
                      for m in ("bleu", "bleu_lc", "chrf")} for k in keys}
        cuda = [r["cuda_peak_mb"] for r in done if r.get("cuda_peak_mb") is not None]
        runs.append({
            "name": spec.name, "config": spec.config, "overrides": spec.overrides,
            "status": "done" if done and len(done) == len(mine) else ("partial" if done else mine[0]["status"]),
            "parameters": done[0]["parameters"] if done else None,
            "scores": scores,
            "train_tokens_per_s": _mean([r.get("train_tokens_per_s") for r in done]),
            "decode_sentences_per_s": _mean([r.get("decode_sentences_per_s") for r in done]),
            "peak_memory_mb": max(cuda) if cuda else max((r["peak_rss_mb"] for r in done), default=None),
            "peak_memory_kind": "cuda" if cuda else "rss",
            "train_seconds": _mean([r.get("train_seconds") for r in done]),
            "updates": _mean([r.get("update") for r in done]),
            "seeds": [{"seed": o["seed"], "direction": o.get("direction"), "status": o["status"], "dir": o["dir"],
                       "error": o["error"], "result": o["result"]} for o in mine],
        })
    return runs


def direction_rows(exp: ExperimentConfig, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (run, test set, direction) scored: mean BLEU, lowercased BLEU and chrF over the seeds, with the
    experiment's ``paper`` figure for the run and direction where it has one."""
    rows = []
    for r in runs:
        for key, s in r["scores"].items():
            test_set, _, direction = key.partition(" ")
            mean = {m: (s.get(m) or {}).get("mean") for m in ("bleu", "bleu_lc", "chrf")}
            rows.append({"run": r["name"], "test_set": test_set, "direction": direction, **mean,
                         "seeds": max(((s.get(m) or {}).get("n", 0) for m in ("bleu", "chrf")), default=0),
                         "paper": exp.paper.get(r["name"], {}).get(direction)})
    return rows


def direction_table(exp: ExperimentConfig, runs: list[dict[str, Any]]) -> str:
    """Per run and direction: BLEU, BLEU lowercased, chrF (means over seeds) and the paper's figure beside them."""
    rows = direction_rows(exp, runs)
    with_paper = bool(exp.paper)
    several = len({row["test_set"] for row in rows}) > 1
    head = ["run", *(["test set"] if several else []), "direction", "BLEU", "BLEU (lc)", "chrF",
            *([f"paper ({exp.paper_note})" if exp.paper_note else "paper"] if with_paper else [])]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + (" --- |" if several else "") + " --- |"
             + " ---: |" * (len(head) - 2 - several)]
    for row in rows:
        cells = [row["run"], *([row["test_set"]] if several else []), row["direction"],
                 _fmt(row["bleu"], ".2f"), _fmt(row["bleu_lc"], ".2f"), _fmt(row["chrf"], ".2f"),
                 *([_fmt(row["paper"], ".2f")] if with_paper else [])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def runs_by_name(exp: ExperimentConfig, runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """results.json's ``runs``: by run name, its summary plus, for the first test set scored, one entry per direction
    (``runs.NAME.DIRECTION`` = ``{"bleu", "bleu_lc", "chrf", "paper"}``, means over the seeds)."""
    by_name = {}
    for r in runs:
        entry = dict(r)
        first = next(iter(r["scores"]), "").partition(" ")[0]
        for row in direction_rows(exp, [r]):
            if row["test_set"] == first:
                entry[row["direction"]] = {m: row[m] for m in ("bleu", "bleu_lc", "chrf", "paper", "seeds")}
        by_name[r["name"]] = entry
    return by_name


def _fmt_score(s: dict[str, Any] | None, runs_seeds: int, with_std: bool = True) -> str:
    if not s:
        return "–"
    text = f"{s['mean']:.2f}" + (f" ± {s['std']:.2f}" if with_std and s["n"] > 1 else "")
    return text + (f" (n={s['n']})" if s["n"] < runs_seeds else "")


def _fmt_time(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def _fmt(value: float | None, spec: str, unit: str = "") -> str:
    return "–" if value is None else f"{value:{spec}}{unit}"


def averaging_note(exp: ExperimentConfig, runs: list[dict[str, Any]]) -> str:
    """What was averaged: ``average_last``, or the numbers of checkpoints the runs had where they had fewer."""
    n = exp.average_last
    counts = sorted({len(s["result"].get("averaged_from") or []) for r in runs for s in r["seeds"] if s["result"]})
    if not counts or counts == [n]:
        return f" (average of the last {n})"
    if counts == [0]:
        return f" (average_last {n}, but no periodic checkpoints were saved: `checkpoint_last.pt` decoded)"
    if len(counts) == 1:
        return f" (average_last {n}, but only {counts[0]} periodic checkpoints were kept: the average of those)"
    return (f" (average_last {n}; runs averaged {', '.join(map(str, counts))} checkpoints: see averaged_from in "
            "results.json)")


def markdown_table(exp: ExperimentConfig, runs: list[dict[str, Any]]) -> str:
    keys = list(dict.fromkeys(k for r in runs for k in r["scores"]))
    multi = len(keys) > 1
    n = len(exp.seeds)
    bleu_head = "BLEU (mean ± std)" if n > 1 else "BLEU"
    head = ["run"] + [c for k in keys for c in ((f"{bleu_head} {k}", f"chrF {k}") if multi else (bleu_head, "chrF"))]
    if not keys:
        head += [bleu_head, "chrF"]
    head += ["parameters", "train tok/s", "decode sent/s", "peak memory", "wall time"]
    lines = ["| " + " | ".join(head) + " |", "| --- |" + " ---: |" * (len(head) - 1)]
    for r in runs:
        if r["status"] not in ("done", "partial"):
            cells = [f"{r['status']}"] + ["–"] * (len(head) - 2)
        else:
            cells = []
            for k in keys or [None]:
                s = r["scores"].get(k, {}) if k else {}
                cells += [_fmt_score(s.get("bleu"), n), _fmt_score(s.get("chrf"), n, with_std=False)]
            mem_unit = " MB" + (" (CUDA)" if r["peak_memory_kind"] == "cuda" else "")
            cells += [_fmt(r["parameters"], ","), _fmt(r["train_tokens_per_s"], ",.0f"),
                      _fmt(r["decode_sentences_per_s"], ",.1f"), _fmt(r["peak_memory_mb"], ",.0f", mem_unit),
                      _fmt_time(r["train_seconds"])]
        lines.append("| " + " | ".join([r["name"], *cells]) + " |")
    return "\n".join(lines)


def ensemble_table(runs: list[dict[str, Any]]) -> str:
    """One row per run and test item: the seeds' ensemble against the mean of the seeds alone."""
    lines = ["| run | test set | BLEU ensemble | BLEU seeds (mean) | Δ BLEU | chrF ensemble | chrF seeds (mean) |",
             "| --- | --- |" + " ---: |" * 5]
    for r in runs:
        ens = r.get("ensemble")
        if not ens:
            continue
        if "error" in ens:
            lines.append(f"| {r['name']} | failed: {ens['error']} |" + " – |" * 5)
            continue
        for key, s in ens["scores"].items():
            alone = r["scores"].get(key, {})
            b, c = (alone.get(m) or {} for m in ("bleu", "chrf"))
            gain = f"{s['bleu'] - b['mean']:+.2f}" if b else "–"
            lines.append(f"| {r['name']} | {key} | {s['bleu']:.2f} | {_fmt(b.get('mean'), '.2f')} | {gain} | "
                         f"{s['chrf']:.2f} | {_fmt(c.get('mean'), '.2f')} |")
    return "\n".join(lines)


def significance_table(runs: list[dict[str, Any]]) -> str:
    """One row per run after the first, test item and seed: BLEU against the first run's, Δ and p."""
    lines = ["| run | test set | seed | BLEU | baseline BLEU | Δ BLEU | p |", "| --- | --- | ---: |" + " ---: |" * 4]
    for r in runs:
        for key, seeds in (r.get("significance") or {}).items():
            for seed, t in seeds.items():
                p = f"{t['p_value']:.4f}" + (" *" if t["p_value"] < 0.05 else "")
                lines.append(f"| {r['name']} | {key} | {seed} | {t['bleu']:.2f} | {t['baseline_bleu']:.2f} | "
                             f"{t['delta']:+.2f} | {p} |")
    return "\n".join(lines)


def add_significance(exp: ExperimentConfig, runs: list[dict[str, Any]], outcomes: list[dict[str, Any]]) -> None:
    """``significance`` of every run after the first: paired bootstrap against the first, per test set and seed
    (:mod:`nmtflow.evaluate.significance`); a failure (e.g. deleted hypothesis files) is logged, not raised."""
    from nmtflow.evaluate.compare_job import load_texts
    from nmtflow.evaluate.significance import compare_to_baseline

    try:
        tested = compare_to_baseline(outcomes, [r["name"] for r in runs], exp.bootstrap_samples,
                                     lambda item: load_texts(item, exp.decode.max_sentences)[1])
    except (OSError, ValueError) as exc:
        log.warning("no significance test: %s", exc)
        return
    for r in runs:
        if r["name"] in tested:
            r["significance"] = tested[r["name"]]


def write_report(exp: ExperimentConfig, out: Path, outcomes: list[dict[str, Any]], *, command: str,
                 ensembles: dict[str, dict[str, Any]] | None = None) -> tuple[list[Path], list[dict[str, Any]]]:
    """Write results.md, results.json and the plots; returns (files, per-run summaries). ``ensembles``: by run
    name, the result of decoding its seeds as one ensemble (``ensemble`` in results.json, a second table)."""
    runs = summarize(exp, outcomes)
    for r in runs:
        if ensembles and r["name"] in ensembles:
            r["ensemble"] = ensembles[r["name"]]
    add_significance(exp, runs, outcomes)
    machine = machine_info(exp.device, exp.threads)
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    d = exp.data
    source = "the built-in synthetic corpus" if d.synthetic else f"`{d.path}`"
    evals = ", ".join(f"`{t}`" + (f" (`{d.splits[t]}`)" if not d.synthetic else "") for t in exp.test_sets)
    search = exp.decode.search_overrides()
    memory = ("peak memory: each run's own process (ru_maxrss; CUDA: torch's peak allocation)" if exp.isolate else
              "peak memory: process-wide ru_maxrss of one process shared by all runs (isolate: false), "
              "so later runs include earlier ones")
    header = [
        f"# Comparison: {exp.name}", "",
        *([f"{exp.file or 'The experiment file'} says: {exp.description.strip()} (what ran is below: `--set` and "
           "`--only` may have changed it)", ""] if exp.description else []),
        f"- command: `{command}`",
        f"- date: {date}",
        f"- machine: {machine['system']} {machine['arch']}, {machine['cpus']} CPUs, torch {machine['torch']}, "
        f"device {machine['device']}" + (f" ({machine['gpu']})" if "gpu" in machine else "")
        + f", torch threads {machine['threads']}",
        f"- budget: {exp.budget.describe()}; seeds: {', '.join(map(str, exp.seeds))}",
        f"- data: {source}, {', '.join(d.directions)}"
        + (f" (zero-shot {', '.join(d.zero_shot)})" if d.zero_shot else "") + f"; test set(s): {evals}",
        f"- decoding: checkpoint `{exp.checkpoint}`" + (averaging_note(exp, runs) if exp.checkpoint == "averaged"
                                                        else "")
        + (", " + ", ".join(f"{k} {v}" for k, v in search.items()) if search else ", each run's decode settings")
        + (f", first {exp.decode.max_sentences} sentences" if exp.decode.max_sentences else ""),
        f"- scores: sacreBLEU BLEU (tokenizer {exp.bleu_tokenize}, cased; and lowercased, case.lc, in the table per "
        "direction) and chrF2; signatures in results.json",
        f"- {memory}; wall time: training loop (validation included)", "",
    ]
    failures = [f"- {r['name']}" + (f" {s['direction']}" if s.get("direction") else "") + f" seed {s['seed']}: "
                f"{s['status']}: {s['error']}" for r in runs for s in r["seeds"] if s["status"] != "done"]
    body = [markdown_table(exp, runs), "", "Per direction" + (f" (paper: {exp.paper_note})" if exp.paper_note else "")
            + ":", "", direction_table(exp, runs), ""] + (["Not finished:", "", *failures, ""] if failures else [])
    if any(r.get("significance") for r in runs):
        body += [f"Significance against {runs[0]['name']}: paired bootstrap resampling of the test sentences "
                 f"(sacreBLEU, {exp.bootstrap_samples} resamples), each seed against the same seed of "
                 f"{runs[0]['name']}; * p < 0.05:", "", significance_table(runs), ""]
    if any(r.get("ensemble") for r in runs):
        body += ["Seed ensembles: each run's seeds decoded as one model (the mean of their probabilities; "
                 "the checkpoints decoded alone above, the first seed's decode settings):", "",
                 ensemble_table(runs), ""]
    files = [out / "results.md", out / "results.json"]
    files[0].write_text("\n".join(header + body), encoding="utf-8")
    write_json(files[1], json_safe({"experiment": exp.name, "file": exp.file, "command": command, "date": date,
                                  "machine": machine, "settings": to_dict(exp), "runs": runs_by_name(exp, runs)}))
    files += plot_comparison(out, runs)
    return files, runs


def validation_curves(run: dict[str, Any], metric: str | tuple[str, ...], kind: str = "valid",
                      direction: str | None = None) -> tuple[list[int], list[float]]:
    """``metric`` of the log entries of ``kind`` (valid: validation, train: training) per update, averaged over
    the run's seeds (of one ``direction`` of a bilingual run trained per direction). Several metrics: the first an
    entry has (the training loss: its mean since the previous entry, or the update's own in older logs)."""
    from nmtflow.train.trainer import read_log

    names = (metric,) if isinstance(metric, str) else metric
    by_update: dict[int, list[float]] = {}
    for s in run["seeds"]:
        if s.get("direction") != direction:
            continue
        for e in read_log(s["dir"]):
            name = next((n for n in names if n in e), None) if e.get("kind") == kind else None
            if name is not None:
                by_update.setdefault(e["update"], []).append(e[name])
    updates = sorted(by_update)
    return updates, [mean(by_update[u]) for u in updates]


def plot_comparison(out: Path, runs: list[dict[str, Any]]) -> list[Path]:
    """valid_bleu.png, valid_loss.png and train_loss.png (one line per run) and bleu_vs_parameters.png."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    def _save(fig: Figure, path: Path) -> None:
        FigureCanvasAgg(fig)
        fig.savefig(path, dpi=120)

    paths = []
    for name, kind, metric, ylabel in (("valid_bleu.png", "valid", "bleu", "validation BLEU"),
                                       ("valid_loss.png", "valid", "nll", "validation loss (NLL per token)"),
                                       ("train_loss.png", "train", ("loss_mean", "loss"),
                                        "training loss (per token)")):
        fig = Figure(figsize=(6.5, 4), layout="constrained")
        ax = fig.subplots()
        for r in runs:
            for direction in dict.fromkeys(s.get("direction") for s in r["seeds"]):
                xs, ys = validation_curves(r, metric, kind, direction)
                if xs:
                    ax.plot(xs, ys, marker="o" if kind == "valid" else None, markersize=3,
                            label=r["name"] + (f" {direction}" if direction else ""))
        ax.set(xlabel="update", ylabel=ylabel, title=f"{ylabel} (mean over seeds)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
        _save(fig, out / name)
        paths.append(out / name)
    fig = Figure(figsize=(6.5, 4), layout="constrained")
    ax = fig.subplots()
    for i, r in enumerate(runs):
        s = next(iter(r["scores"].values()), {}).get("bleu")
        if s and r["parameters"]:
            ax.errorbar([r["parameters"]], [s["mean"]], yerr=[s["std"]], fmt="o", capsize=3, color=f"C{i % 10}")
            ax.annotate(r["name"], (r["parameters"], s["mean"]), textcoords="offset points", xytext=(4, 4),
                        fontsize="small")
    key = next((k for r in runs for k in r["scores"]), "")
    ax.set(xlabel="parameters", ylabel=f"BLEU {key}".strip(), title="BLEU vs parameters")
    ax.grid(alpha=0.3)
    _save(fig, out / "bleu_vs_parameters.png")
    paths.append(out / "bleu_vs_parameters.png")
    return paths
