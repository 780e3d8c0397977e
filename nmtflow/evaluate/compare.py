"""``nmtflow compare EXPERIMENT.yaml``: train several configs under one budget and compare them side by side.

0. every run's config and device is checked first; ``OUT/comparison.json`` marks OUT as a comparison's (an
   existing OUT without it that holds what a comparison writes, e.g. ``results.md`` or ``runs/``, is refused);
1. the data is prepared once into ``OUT/data`` (cached; the built-in corpus is generated into ``OUT/corpus``);
2. every (run × seed) trains into ``OUT/runs/NAME/seed-S``, each in its own process by default
   (``isolate: true``: peak memory is per run and a crash fails only that run), ``parallel: N`` of them at
   once (taking ``devices`` in turn); a rerun skips runs with a matching ``finished.json``, resumes
   interrupted ones from ``checkpoint_last.pt`` and continues them under a raised budget (a run trained beyond
   a lowered budget, or on other data, is an error); changed decode settings only decode again;
3. each run's checkpoint (best, last or the average of the last N) decodes the test set(s); BLEU and chrF;
4. ``OUT/results.md`` (one table), ``OUT/results.json`` and PNG plots (``nmtflow.evaluate.compare_report``).

See ``nmtflow/evaluate/experiment.py`` for the experiment file and ``nmtflow/evaluate/compare_job.py`` for
what one run does.
"""
from __future__ import annotations

import codecs
import hashlib
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
import traceback
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml

from nmtflow.config import BLEU_TOKENIZER, Config, ConfigError, load_config, to_dict, yaml_dump
from nmtflow.train.trainer import on_signals
from nmtflow.evaluate.compare_job import (EXIT_BUSY, EXIT_INTERRUPTED, FINISHED, PARENT_ENV, TRAINED, Interrupted,
                                          beyond_budget, is_trained, read_json, run_job, training_pid,
                                          write_json)
from nmtflow.evaluate.experiment import (ExperimentConfig, RunSpec, load_experiment, parse_direction,
                                         resolve_config_path)

log = logging.getLogger("nmtflow.compare")
DATA_KEY = "experiment-data.json"
TRAINING_SPLITS = ("train", "valid")  # what the runs train and validate on; the other splits are test sets
DATA_IDENTITY = "data-identity.json"  # in OUT: the prepared data its runs were trained on
MARKER = "comparison.json"  # in OUT, written first: the directory is a comparison's (a rerun may continue it)
# config entries that may change without invalidating a trained run (the budget is checked separately): paths,
# budget, device, logging, and the decode section (test decoding is keyed by the job's eval_key instead)
LEGACY_VOLATILE = {("train", "save_dir"), ("train", "max_updates"), ("train", "max_epochs"),
                   ("train", "max_minutes"), ("train", "device"), ("train", "threads"), ("train", "progress"),
                   ("train", "keep_checkpoints"), ("data", "path")}
VOLATILE = LEGACY_VOLATILE | {("train", "log_every")}
VOLATILE_SECTIONS = {"decode"}
# settings added after comparisons were first run: at these defaults they are left out of the fingerprint, so that
# runs trained before the setting existed (their run.yaml and finished.json lack it) are still this config's runs
LATER_DEFAULTS = {("train", "valid_bleu_tokenize"): BLEU_TOKENIZER, ("train", "init_from"): None,
                  ("model", "decoder_init"): "projected", ("model", "encoder_output_dropout"): True,
                  ("train", "compile"): False}


@dataclass
class PreparedData:
    """The prepared directory and, per split and language, the raw text file (None: detokenise the split)."""

    dir: Path
    texts: dict[str, dict[str, str | None]] = field(default_factory=dict)


@dataclass
class ComparisonResult:
    out: Path
    files: list[Path]
    runs: list[dict[str, Any]]
    failed: list[str]
    table: str = ""  # per run and direction: BLEU, lowercased BLEU, chrF and the paper's figure (results.md has it)
    busy: list[str] = field(default_factory=list)  # runs not started: another process trains them (_busy)


# ---- output directory -----------------------------------------------------------------------------------
def check_out(out: Path) -> None:
    """``out`` is new, a comparison's (to continue), or holds none of the files a comparison writes."""
    from nmtflow.evaluate.compare_report import PLOTS

    if not out.exists():
        return
    if not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a directory")
    if any((out / name).is_file() for name in (MARKER, DATA_IDENTITY, "corpus/corpus.json", f"data/{DATA_KEY}")) \
            or any(out.glob("runs/*/seed-*/job.json")):  # comparisons from before MARKER
        return
    clash = [name for name in ("results.md", "results.json", *PLOTS, "runs", "data", "corpus") if (out / name).exists()]
    if clash:
        raise ConfigError(f"--out {out}: not a comparison's directory, and it holds {', '.join(clash)}, which a "
                          "comparison would overwrite or mix with; use another --out")


# ---- data -----------------------------------------------------------------------------------------------
def _split_part(key: dict[str, Any], split: str) -> tuple[Any, dict[str, Any]]:
    """A split's prefix and file sizes in an ``experiment-data.json`` key."""
    names = {f"{split}.{lang}" for lang in key.get("langs", [])}
    return key.get("splits", {}).get(split), {f: n for f, n in key.get("file_sizes", {}).items() if f in names}


def _training_part(key: dict[str, Any]) -> dict[str, Any]:
    """An ``experiment-data.json`` key without its test sets: what the runs train and validate on."""
    parts = {split: _split_part(key, split) for split in key.get("splits", {}) if split in TRAINING_SPLITS}
    return {**key, "splits": {s: prefix for s, (prefix, _) in parts.items()},
            "file_sizes": {f: n for _, sizes in parts.values() for f, n in sizes.items()}}


def _runs_started(out: Path) -> bool:
    """Whether a run of ``out`` has a checkpoint: ``runs/NAME/seed-S``, or a per-direction run's
    ``runs/NAME/DIRECTION/seed-S``."""
    runs = out / "runs"
    return any(runs.glob("*/seed-*/checkpoint_last.pt")) or any(runs.glob("*/*/seed-*/checkpoint_last.pt"))


def prepare_data(exp: ExperimentConfig, out: Path) -> PreparedData:
    """Generate / locate the raw text and prepare it once (reused while the data settings are unchanged)."""
    from nmtflow.data.corpus import CleanConfig
    from nmtflow.data.prepare import add_splits, load_meta, prepare

    d = exp.data
    if d.synthetic is not None:
        from nmtflow.data.synthetic import generate_corpus

        raw = out / "corpus"
        s = d.synthetic
        key = {**to_dict(s), "langs": list(s.langs or d.langs)}
        drawn = read_json(raw / "corpus.json")
        if drawn != key:
            if drawn is not None and (out / "data" / DATA_KEY).is_file() and _runs_started(out):
                # checked before the corpus is drawn again: a comparison still running decodes its test files
                raise ConfigError(f"{out}: its runs were trained on the built-in corpus drawn with other settings "
                                  f"({raw / 'corpus.json'}); use another --out, or delete {out}")
            log.info("generating the built-in corpus (%d training sentences) in %s", s.n_train, raw)
            generate_corpus(raw, langs=key["langs"], n_train=s.n_train, n_valid=s.n_valid, n_test=s.n_test,
                            seed=s.seed, force=True)  # OUT/corpus is the comparison's own (check_out)
            write_json(raw / "corpus.json", key)
    else:
        if not d.path:
            raise ConfigError(f"{exp.file}: data.path: not set; pass --set data.path=DIR (raw PREFIX.LANG files, "
                              "or a directory written by nmtflow prepare)")
        raw = Path(d.path)
        if not raw.is_dir():
            raise ConfigError(f"{exp.file}: data.path: {raw} is not a directory")
        if (raw / "meta.json").is_file():  # already prepared: use it as it is
            meta = load_meta(raw)
            for split in d.splits:
                if split not in meta["splits"]:
                    raise ConfigError(f"{exp.file}: data.splits: {split!r} is not prepared in {raw} "
                                      f"({', '.join(meta['splits'])})")
            for lang in d.langs:
                if lang not in meta["langs"]:
                    raise ConfigError(f"{exp.file}: data.langs: {lang!r} is not prepared in {raw}")
            files = meta.get("source_files", {})
            texts = {split: {lang: f if (f := files.get(split, {}).get(lang)) and Path(f).is_file() else None
                             for lang in d.langs} for split in d.splits}
            return PreparedData(raw.resolve(), texts)
    files = {split: {lang: raw / f"{prefix}.{lang}" for lang in d.langs} for split, prefix in d.splits.items()}
    for per_lang in files.values():
        for path in per_lang.values():
            if not path.is_file():
                raise ConfigError(f"{exp.file}: data: {path} not found (data.splits maps split names to file "
                                  "prefixes PREFIX.LANG in data.path)")
    key = {"langs": d.langs, "splits": d.splits, "vocab_size": d.vocab_size, "joint": d.joint,
           "lang_tags": d.lang_tags, "max_len": d.max_len, "max_ratio": d.max_ratio,
           "file_sizes": {f"{s}.{lang}": p.stat().st_size for s, per in files.items() for lang, p in per.items()}}
    if not d.byte_fallback:  # only off: data prepared before the setting existed stays this config's
        key["byte_fallback"] = False
    data_dir = out / "data"
    previous = read_json(data_dir / DATA_KEY) if (data_dir / "meta.json").is_file() else None
    if previous is not None and previous != key and _training_part(previous) == _training_part(key):
        # only test sets were added or changed: binarize them with the prepared tokenizers; the runs stand
        changed = {split: str(raw / prefix) for split, prefix in d.splits.items()
                   if split not in TRAINING_SPLITS and _split_part(previous, split) != _split_part(key, split)}
        if changed:
            log.info("adding test set(s) %s to %s", ", ".join(changed), data_dir)
            add_splits(data_dir, changed)
        write_json(data_dir / DATA_KEY, key)
        previous = key
    if previous != key:
        if (data_dir / DATA_KEY).is_file() and _runs_started(out):
            raise ConfigError(f"{out}: its runs were trained on data prepared with other settings "
                              f"({data_dir / DATA_KEY}); use another --out, or delete {out}")
        log.info("preparing %s (%s) into %s", raw, ", ".join(d.langs), data_dir)
        prepare({split: str(raw / prefix) for split, prefix in d.splits.items()}, d.langs, data_dir,
                vocab_size=d.vocab_size, joint=d.joint, clean=CleanConfig(max_len=d.max_len, max_ratio=d.max_ratio),
                lang_tags=d.lang_tags, byte_fallback=d.byte_fallback)
        write_json(data_dir / DATA_KEY, key)
    texts = {split: {lang: str(p.resolve()) for lang, p in per.items()} for split, per in files.items()}
    return PreparedData(data_dir.resolve(), texts)


def data_identity(data_dir: Path, legacy: bool = False) -> str:
    """A hash of what runs on a prepared directory train on: meta.json without source paths and test sets, the
    tokenizer models (without file names) and the sizes of the binarized training and validation splits (the
    same for the same data prepared again, anywhere). ``legacy``: the hash of earlier versions, over every split."""
    from nmtflow.data.tokenizer import canonical_model

    meta = json.loads((data_dir / "meta.json").read_text(encoding="utf-8"))
    meta.pop("source_files", None)
    if not legacy:
        meta["splits"] = {s: v for s, v in meta.get("splits", {}).items() if s in TRAINING_SPLITS}
    h = hashlib.sha1(json.dumps(meta, sort_keys=True).encode())
    for name in sorted(set(meta.get("tokenizers", {}).values())):
        h.update(name.encode() + b"\0" + canonical_model((data_dir / name).read_bytes()))
    for split in sorted(meta.get("splits", {})):
        for lang in meta.get("langs", []):
            for ext in ("bin", "idx"):
                f = data_dir / f"{split}.{lang}.{ext}"
                h.update(f"{f.name}={f.stat().st_size if f.is_file() else -1};".encode())
    return h.hexdigest()[:16]


def _previous_data(out: Path) -> dict[str, Any] | None:
    """``{"identity", "dir"}`` of the data the runs in ``out`` were trained on, where known."""
    state = read_json(out / DATA_IDENTITY)
    if state or not _runs_started(out):
        return state
    for run_yaml in sorted((out / "runs").glob("*/seed-*/run.yaml")):  # runs from before DATA_IDENTITY
        try:
            path = ((yaml.safe_load(run_yaml.read_text(encoding="utf-8")) or {}).get("data") or {}).get("path")
            return {"identity": data_identity(Path(path)), "dir": path} if path else None
        except Exception:  # best effort: no run.yaml to read, or its data is gone or unreadable
            return None
    return None


def check_data_identity(out: Path, data: PreparedData) -> None:
    """Runs already trained in ``out`` must have been trained on this prepared data; records it otherwise."""
    identity = data_identity(data.dir)
    previous = _previous_data(out)
    if previous and previous.get("identity") == data_identity(data.dir, legacy=True):
        previous = {**previous, "identity": identity}  # recorded by an earlier version, over every split
    if previous and previous.get("identity") != identity and _runs_started(out):
        raise ConfigError(f"{out}: its runs were trained on data prepared with other settings (in "
                          f"{previous.get('dir', '?')}, not {data.dir}); use another --out, or delete {out}")
    if read_json(out / DATA_IDENTITY) != {"identity": identity, "dir": str(data.dir)}:
        write_json(out / DATA_IDENTITY, {"identity": identity, "dir": str(data.dir)})


# ---- planning -------------------------------------------------------------------------------------------
def _volatile(key: tuple[str, ...], legacy: bool = False) -> bool:
    return key[:2] in LEGACY_VOLATILE if legacy else key[:2] in VOLATILE or key[0] in VOLATILE_SECTIONS


_ANY = object()  # no recorded default: never equal to a value


def fingerprint(config: dict[str, Any], legacy: bool = False) -> str:
    """A hash of what defines a trained run: the resolved config without paths, budget, device, logging and
    decode settings (``legacy``: the hash of earlier versions, which kept the decode section and log_every)."""
    kept = {section: {k: v for k, v in values.items()
                      if not _volatile((section, k), legacy) and LATER_DEFAULTS.get((section, k), _ANY) != v}
            if isinstance(values, dict) else values for section, values in config.items()
            if legacy or section not in VOLATILE_SECTIONS}
    return hashlib.sha1(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16]


def _flat(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def load_run_config(exp: ExperimentConfig, index: int) -> Config:
    """Run ``index``'s config file with the experiment's and the run's overrides (errors name the run)."""
    run = exp.runs[index]
    path = resolve_config_path(run.config, exp.file)
    try:
        return load_config(path, [*exp.overrides, *run.overrides])
    except ConfigError as exc:
        raise ConfigError(f"{exp.file}: runs[{index}] ({run.name}): {exc}") from None


def check_runs(exp: ExperimentConfig) -> None:
    """Every run's config loads and every device exists, before any data is prepared or run trained."""
    import torch

    for index, run in enumerate(exp.runs):
        multilingual = load_run_config(exp, index).data.multilingual is not None and not run.per_direction
        if run.zero_shot and not multilingual:
            raise ConfigError(f"{exp.file}: runs[{index}] ({run.name}): zero_shot: a bilingual run translates only "
                              "the directions it is trained on")
        if multilingual:
            continue
        for direction in bilingual_directions(exp, run):
            src, tgt = parse_direction(direction, f"{exp.file}: data.directions")
            if src == tgt:
                where = f"runs[{index}] ({run.name}).directions" if run.directions else "data.directions"
                raise ConfigError(f"{exp.file}: {where}: the bilingual run {run.name!r} trains {direction}: source "
                                  "and target are the same language")
    for key, name in [("device", exp.device)] + [(f"devices[{i}]", d) for i, d in enumerate(exp.devices)]:
        if name.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"{exp.file}: {key}: {name}, but CUDA is not available on this machine")
        if name.startswith("cuda:") and int(name[5:]) >= torch.cuda.device_count():
            raise ConfigError(f"{exp.file}: {key}: {name}, but this machine has {torch.cuda.device_count()} "
                              "CUDA device(s)")


def bilingual_directions(exp: ExperimentConfig, run: RunSpec) -> list[str]:
    """The directions a bilingual run trains one model each for: its own, else the experiment's first."""
    return list(run.directions) or exp.data.directions[:1]


def run_config(exp: ExperimentConfig, index: int, seed: int, data: PreparedData, run_dir: Path,
               direction: str | None = None) -> Config:
    """The training config of run ``index`` with ``seed``: its file + overrides, then the experiment's settings.
    ``direction``: a bilingual run's direction (default: the experiment's first)."""
    run = exp.runs[index]
    config = load_run_config(exp, index)
    dc, tc = config.data, config.train
    dc.path, dc.train_split, dc.valid_split = str(data.dir), "train", "valid"
    dc.src_lang, dc.tgt_lang = parse_direction(direction or exp.data.directions[0], "data.directions")
    if dc.multilingual is not None and direction:  # a multilingual model type trained on one direction
        dc.multilingual.pairs, dc.multilingual.zero_shot = [direction], []
        dc.multilingual.langs = dc.multilingual.langs or list(dict.fromkeys(parse_direction(direction, "directions")))
    elif dc.multilingual is not None:  # the run's directions (else the experiment's), unless its config names its own
        mc = dc.multilingual
        mc.pairs = mc.pairs or exp.run_directions(run)
        mc.zero_shot = mc.zero_shot or list(run.zero_shot if run.directions else exp.data.zero_shot)
        mc.langs = mc.langs or list(exp.data.langs)
    b = exp.budget
    tc.save_dir, tc.seed, tc.device = str(run_dir), seed, exp.device
    if exp.devices:  # parallel runs share out the devices: job n takes devices[n % len(devices)]
        tc.device = exp.devices[(index * len(exp.seeds) + exp.seeds.index(seed)) % len(exp.devices)]
    tc.max_updates = b.updates if b.updates is not None else 10**9
    tc.max_epochs, tc.max_minutes = b.epochs, b.minutes
    if exp.threads:
        tc.threads = exp.threads
    if exp.bleu_tokenize != BLEU_TOKENIZER and tc.valid_bleu_tokenize == BLEU_TOKENIZER:  # validation BLEU as test BLEU
        tc.valid_bleu_tokenize = exp.bleu_tokenize
    if exp.average_last:
        tc.keep_checkpoints = max(tc.keep_checkpoints, exp.average_last)
    return config


def _check_previous(run_dir: Path, config_dict: dict[str, Any], fp: str) -> None:
    """A run directory that already holds a (partly) trained run must hold this config's."""
    old = run_dir / "run.yaml"
    if not (old.is_file() and (run_dir / "checkpoint_last.pt").is_file()):
        return
    previous = yaml.safe_load(old.read_text(encoding="utf-8")) or {}
    if fingerprint(previous) != fp:
        later = {".".join(key): default for key, default in LATER_DEFAULTS.items()}  # what a run.yaml may lack
        a, b = {**later, **_flat(previous)}, {**later, **_flat(config_dict)}
        changed = sorted(k for k in a.keys() | b.keys()
                         if a.get(k, _ANY) != b.get(k, _ANY) and not _volatile(tuple(k.split("."))))
        raise ConfigError(f"{run_dir} holds a run trained with another config (changed: "
                          f"{', '.join(changed[:5]) or '?'}); use another --out or delete that directory")


def trained_progress(run_dir: Path) -> dict[str, Any] | None:
    """Update and epoch of the run's ``checkpoint_last.pt`` (memory-mapped: no tensor is read), else of its
    ``trained.json``; None for a run not started."""
    import torch

    last = run_dir / "checkpoint_last.pt"
    if last.is_file():
        try:
            progress = torch.load(last, map_location="cpu", weights_only=True, mmap=True).get("progress")
            if isinstance(progress, dict):
                return progress
        except Exception:  # unreadable: training reports it with the file's name
            pass
    return read_json(run_dir / TRAINED)


def _check_budget(run_dir: Path, budget: dict[str, Any]) -> None:
    """A run trained past the (lowered) budget cannot be reported under it."""
    progress = trained_progress(run_dir)
    beyond = beyond_budget(progress, budget) if progress else None
    if beyond:
        raise ConfigError(f"{run_dir}: the run trained beyond the budget ({beyond}); use another --out, or "
                          "delete that run's directory to train it again")


def decode_items(exp: ExperimentConfig, data: PreparedData, directions: list[str]) -> list[dict[str, Any]]:
    """What a run decodes: every test set × ``directions`` (a bilingual model's one, a multilingual model's trained
    and zero-shot ones; copy directions A-A are left out)."""
    items = []
    for test_set in exp.test_sets:
        texts = data.texts.get(test_set, {})
        for direction in directions:
            src, tgt = parse_direction(direction, "data.directions")
            if src != tgt:
                items.append({"key": f"{test_set} {direction}", "test_set": test_set, "direction": direction,
                              "src": src, "tgt": tgt, "src_file": texts.get(src), "ref_file": texts.get(tgt),
                              "data_dir": str(data.dir), "split": test_set})
    return items


def _test_digest(item: dict[str, Any]) -> str:
    """A hash of what a test item decodes and is scored against: its text files, else its binarized split."""
    files = [item["src_file"], item["ref_file"]]
    if not all(files):
        files = [f"{item['data_dir']}/{item['split']}.{lang}.bin" for lang in (item["src"], item["tgt"])]
    h = hashlib.sha1()
    for f in files:
        h.update(hashlib.sha1(Path(f).read_bytes()).digest())
    return h.hexdigest()[:16]


def _eval_key(ev: dict[str, Any]) -> str:
    """A hash of what a run's test decoding depends on (the test items by name, their contents' digests)."""
    key = {**ev, "items": [i["key"] for i in ev["items"]]}
    return hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def model_directions(run: RunSpec, multilingual: bool) -> list[str | None]:
    """The directions ``run`` trains one model each for: a bilingual run with its own directions (or a
    ``per_direction`` one) trains one per direction, each in its own directory; otherwise ``[None]``, one model."""
    return list(run.directions) if run.directions and (run.per_direction or not multilingual) else [None]


def job_dir(out: Path, name: str, direction: str | None, seed: int) -> Path:
    """``OUT/runs/NAME/[DIRECTION/]seed-S``: where one job trains."""
    return out / "runs" / name / (direction or "") / f"seed-{seed}"


def plan_jobs(exp: ExperimentConfig, out: Path, data: PreparedData,
              plugins: list[str] | None = None) -> list[dict[str, Any]]:
    """One job per (run, seed), in run order; fails early if a run directory holds another config's run."""
    jobs = []
    for index, run in enumerate(exp.runs):
        multilingual = load_run_config(exp, index).data.multilingual is not None
        for direction, seed in ((d, seed) for d in model_directions(run, multilingual) for seed in exp.seeds):
            run_dir = job_dir(out, run.name, direction, seed).resolve()
            config = run_config(exp, index, seed, data, run_dir, direction)
            config_dict = to_dict(config)
            fp = fingerprint(config_dict)
            _check_previous(run_dir, config_dict, fp)
            _check_budget(run_dir, to_dict(exp.budget))
            if multilingual:
                mc = config.data.multilingual
                decoded = [*mc.pairs, *mc.zero_shot]
            else:
                decoded = [direction or exp.data.directions[0]]
            items = decode_items(exp, data, decoded)
            ev = {"checkpoint": exp.checkpoint, "average_last": exp.average_last,
                  "search": exp.decode.search_overrides(), "max_sentences": exp.decode.max_sentences, "items": items}
            if exp.bleu_tokenize != BLEU_TOKENIZER:  # in the key only where set: the others keep earlier keys
                ev["bleu_tokenize"] = exp.bleu_tokenize
            # earlier versions decoded with the checkpoint's decode section, which their fingerprint pinned
            legacy = {"fingerprint": fingerprint(config_dict, legacy=True), "eval_key": _eval_key(ev)}
            ev["decode"] = config_dict.get("decode")  # the run's decode section: it may change after training
            # the previous version's keys: the test sets' contents were not in them
            previous = {"fingerprint": fp, "eval_key": _eval_key(ev)}
            ev["test_data"] = {item["key"]: _test_digest(item) for item in items}  # an edited test set: decode again
            jobs.append({"run": run.name, "direction": direction, "seed": seed, "dir": str(run_dir),
                         "config": str(run_dir / "run.yaml"),
                         "config_source": str(resolve_config_path(run.config, exp.file)),
                         "fingerprint": fp, "budget": to_dict(exp.budget), "eval": ev, "eval_key": _eval_key(ev),
                         "legacy": legacy, "previous": previous, "multilingual": multilingual,
                         "device": config.train.device, "threads": exp.threads, "plugins": list(plugins or []),
                         "_config": config_dict})
    return jobs


def finished_result(job: dict[str, Any]) -> dict[str, Any] | None:
    """The run's ``finished.json`` if it belongs to this config, budget and evaluation."""
    done = read_json(Path(job["dir"]) / FINISHED)
    if not done or done.get("budget") != job["budget"]:
        return None
    for keys in (job, job.get("previous") or {}, job.get("legacy") or {}):
        if keys and all(done.get(k) == keys.get(k) for k in ("fingerprint", "eval_key")):
            if keys is job.get("previous"):  # recorded before test-set digests: recorded with them from now on
                done["eval_key"] = job["eval_key"]
                write_json(Path(job["dir"]) / FINISHED, done)
            return done
    return None


# ---- running --------------------------------------------------------------------------------------------
@contextmanager
def _forward_signals(proc: subprocess.Popen) -> Iterator[Callable[[], bool]]:
    """SIGINT/SIGTERM to the comparison go to the run's process (which saves and exits) and stop the loop."""
    hit = {"flag": False}

    def handler(signum: int, frame: Any) -> None:
        hit["flag"] = True
        proc.send_signal(signum)

    with on_signals(handler):
        yield lambda: hit["flag"]


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    """``signum`` to the process group that a run's process leads (its session: ``start_new_session``)."""
    try:
        os.killpg(proc.pid, signum)
    except (ProcessLookupError, PermissionError):  # it has just exited
        pass


@contextmanager
def _pause_with(children: Callable[[], list[subprocess.Popen]]) -> Iterator[None]:
    """A terminal's Ctrl-Z (SIGTSTP) to the comparison pauses its running runs too; ``fg`` (SIGCONT) resumes them.

    Each run has a session of its own (so that Ctrl-C reaches it once, forwarded), which the terminal's SIGTSTP does
    not reach: the comparison stops every run's process group, then itself, and continues them when it continues.
    ``kill -STOP`` cannot be caught, so it stops the comparison alone. Outside the main thread this does nothing.
    """
    def handler(signum: int, frame: Any) -> None:
        procs = [proc for proc in children() if proc.poll() is None]
        for proc in procs:
            _signal_group(proc, signal.SIGSTOP)
        os.kill(os.getpid(), signal.SIGSTOP)  # returns once something continues the comparison
        for proc in procs:
            _signal_group(proc, signal.SIGCONT)

    try:
        previous = signal.signal(signal.SIGTSTP, handler)
    except (ValueError, AttributeError):  # not the main thread, or no SIGTSTP on this system
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTSTP, previous)


def _run_isolated(job_file: Path, run_dir: Path) -> tuple[int, bool]:
    """Run one job in a child process, echoing its output and appending it to ``train.log``."""
    cmd = [sys.executable, "-m", "nmtflow.evaluate.compare_job", str(job_file)]
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    with open(run_dir / "train.log", "ab") as logf:
        # a session of its own: a terminal's Ctrl-C reaches only the comparison, which forwards it once
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                                env=_job_env())
        assert proc.stdout is not None
        with _forward_signals(proc) as stopped, _pause_with(lambda: [proc]):
            while chunk := proc.stdout.read1(1 << 16):
                logf.write(chunk)
                logf.flush()  # train.log as current as the terminal (a buffer held ~40 minutes of a long run's log)
                sys.stderr.write(decoder.decode(chunk))
                sys.stderr.flush()
            rc = proc.wait()
    return rc, stopped()


def _job_env() -> dict[str, str]:
    """A run's environment: this one, with the comparison's pid (compare_job's ``stop_with_parent``)."""
    return {**os.environ, PARENT_ENV: str(os.getpid())}


def _log_tail(run_dir: Path) -> str:
    """The last line of the run's output (the error, for a failed run) and where the rest is."""
    try:
        text = (run_dir / "train.log").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return "no output"
    tail = [ln.strip() for ln in text.replace("\r", "\n").splitlines() if ln.strip()]
    return f"{tail[-1] if tail else 'no output'} (see {run_dir / 'train.log'})"


def _write_job(job: dict[str, Any]) -> Path:
    """Write the run's ``run.yaml`` and ``job.json``; returns the job file."""
    run_dir = Path(job["dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "run.yaml").write_text(yaml_dump(job["_config"]), encoding="utf-8")  # load_config reads it back
    job_file = run_dir / "job.json"
    write_json(job_file, {k: v for k, v in job.items() if k != "_config"})
    return job_file


def _outcome(run_dir: Path, rc: int, stopped: bool) -> tuple[str, dict[str, Any] | None, str]:
    """(status, finished.json, error) of a run whose process exited with ``rc``."""
    if rc == EXIT_INTERRUPTED or stopped:
        return "interrupted", None, "interrupted"
    if rc == EXIT_BUSY:
        return "busy", None, _busy(run_dir) or f"another training held {run_dir}"
    if rc < 0:  # killed: the last line of its output is not the reason
        name = signal.Signals(-rc).name if -rc in signal.valid_signals() else f"signal {-rc}"
        why = " (out of memory?)" if -rc == signal.SIGKILL else ""
        return "failed", None, f"killed by {name}{why}; its output is in {run_dir / 'train.log'}"
    if rc != 0:
        return "failed", None, f"exit status {rc}: {_log_tail(run_dir)}"
    done = read_json(run_dir / FINISHED)
    return ("done", done, "") if done else ("failed", None, f"no {FINISHED} written: {_log_tail(run_dir)}")


def _busy(run_dir: Path) -> str | None:
    """Why the run in ``run_dir`` is not started: another process trains there (an earlier comparison of this
    --out, still at work in another shell); None if none does."""
    pid = training_pid(run_dir)
    return None if pid is None else (f"another training is running in {run_dir} (pid {pid}: another nmtflow compare "
                                     "of this --out?); not started twice: run the command again when it has ended")


def execute(job: dict[str, Any], isolate: bool) -> tuple[str, dict[str, Any] | None, str]:
    """(status: done | failed | interrupted | busy, finished.json, error message) of one job; a run another process
    trains (:func:`_busy`) is not started: busy, with why."""
    run_dir = Path(job["dir"])
    if (busy := _busy(run_dir)) is not None:
        return "busy", None, busy
    job_file = _write_job(job)
    if not isolate:
        try:
            return "done", run_job(job), ""
        except Interrupted as exc:
            return "interrupted", None, str(exc)
        except Exception as exc:  # one failed run must not end the comparison
            (run_dir / "error.log").write_text(traceback.format_exc(), encoding="utf-8")
            return "failed", None, f"{type(exc).__name__}: {exc}"
    rc, stopped = _run_isolated(job_file, run_dir)
    return _outcome(run_dir, rc, stopped)


def execute_parallel(jobs: list[tuple[str, dict[str, Any]]], parallel: int,
                     report: Callable[[str, dict[str, Any], str, dict[str, Any] | None, str], None]
                     ) -> dict[str, tuple[str, dict[str, Any] | None, str]]:
    """Run ``(label, job)`` pairs ``parallel`` at a time, each in its own process writing to its ``train.log``.

    SIGINT/SIGTERM go to every running run (each saves a checkpoint and exits) and no new run starts; SIGTSTP
    (Ctrl-Z) pauses every running run with the comparison (:func:`_pause_with`).
    ``report(label, job, status, result, error)`` is called as each run ends; returns outcomes by run dir.
    """
    pending, running, outcomes = list(jobs), {}, {}
    hit = {"flag": False}

    def handler(signum: int, frame: Any) -> None:
        hit["flag"] = True
        for proc, _, _, _ in running.values():
            proc.send_signal(signum)

    with on_signals(handler), _pause_with(lambda: [proc for proc, _, _, _ in running.values()]):
        while running or (pending and not hit["flag"]):
            while pending and len(running) < parallel and not hit["flag"]:
                label, job = pending.pop(0)
                if (busy := _busy(Path(job["dir"]))) is not None:
                    outcomes[job["dir"]] = ("busy", None, busy)
                    report(label, job, *outcomes[job["dir"]])
                    continue
                job_file = _write_job(job)
                log.info("%s: started on %s (log: %s)", label, job["device"], Path(job["dir"]) / "train.log")
                logf = open(Path(job["dir"]) / "train.log", "ab")
                proc = subprocess.Popen([sys.executable, "-m", "nmtflow.evaluate.compare_job", str(job_file)],
                                        stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
                                        env=_job_env())
                running[job["dir"]] = (proc, logf, label, job)
            time.sleep(0.2)
            for key, (proc, logf, label, job) in list(running.items()):
                rc = proc.poll()
                if rc is None:
                    continue
                logf.close()
                del running[key]
                outcomes[key] = _outcome(Path(key), rc, hit["flag"])
                report(label, job, *outcomes[key])
    return outcomes


def decode_ensembles(exp: ExperimentConfig, out: Path, outcomes: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per run whose seeds all finished: its seeds decoded as one ensemble (``OUT/runs/NAME/ensemble``); a
    failure is reported, not raised. Runs with an unfinished seed are left out."""
    import torch

    from nmtflow.evaluate.compare_job import evaluate_ensemble

    if exp.threads:
        torch.set_num_threads(exp.threads)
    ensembles: dict[str, dict[str, Any]] = {}
    for run in exp.runs:
        for direction in dict.fromkeys(o.get("direction") for o in outcomes if o["run"] == run.name):
            mine = [o for o in outcomes if o["run"] == run.name and o.get("direction") == direction]
            if len(mine) < 2 or any(o["status"] != "done" or not o["result"] for o in mine):
                continue
            label = run.name + (f" {direction}" if direction else "")
            ensemble_dir = out / "runs" / run.name / (direction or "") / "ensemble"
            log.info("%s: decoding the ensemble of seeds %s", label, ", ".join(str(o["seed"]) for o in mine))
            try:
                result = evaluate_ensemble(mine, ensemble_dir, exp.device)
            except Exception as exc:  # one failed ensemble must not end the comparison
                (ensemble_dir / "error.log").parent.mkdir(parents=True, exist_ok=True)
                (ensemble_dir / "error.log").write_text(traceback.format_exc(), encoding="utf-8")
                log.error("%s: the ensemble of its seeds failed: %s: %s", label, type(exc).__name__, exc)
                result = {"error": f"{type(exc).__name__}: {exc}"}
            if run.name not in ensembles:
                ensembles[run.name] = result
            else:  # a bilingual run's other direction: its scores join the run's
                merged = ensembles[run.name]
                merged.setdefault("scores", {}).update(result.get("scores", {}))
                if "error" in result:
                    merged["error"] = "; ".join(filter(None, [merged.get("error"), result["error"]]))
    return ensembles


def comparison_dir(exp: ExperimentConfig, out: str | Path | None) -> Path:
    """``--out``, by default ``runs/compare-NAME``."""
    return Path(out) if out else Path("runs") / f"compare-{exp.name}"


def run_comparison(experiment: str | Path, out: str | Path | None = None, overrides: list[str] | None = None,
                   plugins: list[str] | None = None, only: list[str] | None = None) -> ComparisonResult:
    """Run (or continue) a comparison and write its report; raises KeyboardInterrupt if it was interrupted.

    ``only``: the names of the runs to train and report (default: all of the experiment's runs).
    """
    from nmtflow.evaluate.compare_report import direction_table, write_report

    overrides, plugins = list(overrides or []), list(plugins or [])
    exp = load_experiment(experiment, overrides)
    if only:
        exp.select(only)
    out = comparison_dir(exp, out)
    command = shlex.join(["nmtflow", *[a for p in plugins for a in ("--plugin", p)], "compare", str(experiment),
                          "--out", str(out), *[a for o in overrides for a in ("--set", o)],
                          *(["--only", ",".join(only)] if only else [])])
    check_runs(exp)
    check_out(out)
    out.mkdir(parents=True, exist_ok=True)
    if not (out / MARKER).is_file():
        write_json(out / MARKER, {"experiment": exp.name, "file": str(experiment)})
    data = prepare_data(exp, out)
    check_data_identity(out, data)
    jobs = plan_jobs(exp, out, data, plugins)
    log.info("comparing %d runs × %d seeds (%d trainings; %s) in %s; where they stand, from another shell: %s "
             "--status", len(exp.runs), len(exp.seeds), len(jobs), exp.budget.describe(), out, command)
    interrupted = False
    status_of: dict[str, tuple[str, dict[str, Any] | None, str]] = {}

    def outcomes_so_far(pending: str) -> list[dict[str, Any]]:
        return [{**job, "status": status, "result": result, "error": error}
                for job in jobs for status, result, error in [status_of.get(job["dir"], ("not run", None, pending))]]

    def report(label: str, job: dict[str, Any], status: str, result: dict[str, Any] | None, error: str) -> None:
        status_of[job["dir"]] = (status, result, error)
        if status == "failed":
            log.error("%s failed: %s", label, error)
        elif status == "busy":
            log.warning("%s: not started: %s", label, error)
        elif status == "interrupted":
            log.warning("%s interrupted; rerun the same command to continue", label)
            return
        else:
            scores = next(iter(result["scores"].values()), {})
            log.info("%s: BLEU %.2f, chrF %.2f", label, scores.get("bleu", float("nan")),
                     scores.get("chrf", float("nan")))
        # the report so far after each run, the others "not run": a long comparison's finished runs are in
        # results.json (and the plots) while the rest train, not only when the last one ends
        if any(j["dir"] not in status_of for j in jobs):
            write_report(exp, out, outcomes_so_far("not run yet (the comparison is still running)"), command=command)

    todo: list[tuple[str, dict[str, Any]]] = []
    for n, job in enumerate(jobs, 1):
        label = f"[{n}/{len(jobs)}] {job['run']}" + (f" {job['direction']}" if job["direction"] else "") + \
            f" (seed {job['seed']})"
        done = finished_result(job)
        if done is not None:
            log.info("%s: finished earlier, skipped (%s)", label, Path(job["dir"]) / FINISHED)
            status_of[job["dir"]] = ("done", done, "")
        else:
            todo.append((label, job))
    # runs trained per direction: every run's first direction before any run's second, so that a comparison stopped
    # part-way has the same directions of every run (the order within a position is the experiment's)
    seen: Counter[str] = Counter()
    position = {}
    for job in jobs:
        position[job["dir"]], seen[job["run"]] = seen[job["run"]], seen[job["run"]] + 1
    todo.sort(key=lambda item: position[item[1]["dir"]])
    if exp.parallel > 1:
        log.info("training %d runs, %d at a time", len(todo), exp.parallel)
        status_of.update(execute_parallel(todo, exp.parallel, report))
        interrupted = any(s == "interrupted" for s, _, _ in status_of.values())
    else:
        for label, job in todo:
            trained = is_trained(job, read_json(Path(job["dir"]) / TRAINED))
            log.info("%s: %s in %s", label, "trained earlier; decoding" if trained else "training and decoding",
                     job["dir"])
            report(label, job, *execute(job, exp.isolate))
            if status_of[job["dir"]][0] == "interrupted":
                interrupted = True
                break
    outcomes = outcomes_so_far("not run yet (interrupted)")
    ensembles = decode_ensembles(exp, out, outcomes) if exp.ensemble and not interrupted else {}
    files, runs = write_report(exp, out, outcomes, command=command, ensembles=ensembles)
    def named(status: str) -> list[str]:
        return [f"{o['run']}" + (f" {o['direction']}" if o["direction"] else "") + f" seed {o['seed']}"
                for o in outcomes if o["status"] == status]

    failed = named("failed")
    log.info("wrote %s", ", ".join(str(f) for f in files))
    if interrupted:
        raise KeyboardInterrupt
    return ComparisonResult(out, files, runs, failed, direction_table(exp, runs), busy=named("busy"))
