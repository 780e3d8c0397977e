"""One (run, seed) of ``nmtflow compare``: train (resuming), average, decode the test sets, score.

The comparison runs each job in its own process (``python -m nmtflow.evaluate.compare_job JOB.json``), so
peak memory is the run's own and a crash cannot take the comparison down; with ``isolate: false`` the same
:func:`run_job` runs in the comparison's process. Files in the run directory:

* ``run.yaml``: the resolved training config (``nmtflow train run.yaml`` trains the same run);
* ``job.json``: what to do, written by the comparison;
* ``trained.json``: training reached this budget (a rerun does not train again, it only decodes);
* ``finished.json``: the marker of a finished run, with its training and test results (a rerun skips it);
* ``hyp.TEST.SRC-TGT.txt``: the test translations; ``train.log``: the process's output.
"""
from __future__ import annotations

import ctypes
import dataclasses
import importlib
import json
import logging
import os
import resource
import signal
import sys
import time
from pathlib import Path
from statistics import mean
from typing import Any, Callable

import torch

from nmtflow.checkpoint import SaveDirBusy
from nmtflow.config import BLEU_TOKENIZER
from nmtflow.data.corpus import read_lines
from nmtflow.data.locks import LockHeld, lock_file
from nmtflow.runtime import keep_freed_memory, new_file_mode

TRAINED, FINISHED = "trained.json", "finished.json"
EXIT_INTERRUPTED = 3
EXIT_BUSY = 4  # another process holds the run's save dir
PARENT_ENV = "NMTFLOW_COMPARE_PID"  # the comparison's pid, which stop_with_parent checks
PR_SET_PDEATHSIG = 1
log = logging.getLogger("nmtflow.compare")


class Interrupted(Exception):
    """Training was stopped by a signal (it saved a checkpoint; the next run of the comparison resumes it)."""


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def peak_rss_mb() -> float:
    """Peak resident memory of this process (``ru_maxrss``) in MiB."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1 << 20) if sys.platform == "darwin" else rss / 1024


def train_tokens_per_s(save_dir: str | Path) -> float | None:
    """Mean of the run's logged training speeds (target tokens/s, one value per ``log_every`` window)."""
    from nmtflow.train.trainer import read_log

    speeds = [e["tgt_tokens_per_s"] for e in read_log(save_dir) if e.get("kind") == "speed"]
    return mean(speeds) if speeds else None


def train(config: Any) -> Any:
    """Train ``config`` (resuming from ``checkpoint_last.pt``) with the trainer ``nmtflow train`` would pick."""
    from nmtflow.train.multilingual import trainer_for

    return trainer_for(config).train()


def beyond_budget(progress: dict[str, Any], budget: dict[str, Any]) -> str | None:
    """How a run's ``progress`` (update, epoch: the epoch under way) exceeds ``budget``; None if it does not."""
    update, epoch = progress.get("update"), progress.get("epoch")
    if budget.get("updates") is not None and update is not None and update > budget["updates"]:
        return f"{update} updates, budget {budget['updates']}"
    if budget.get("epochs") is not None and epoch is not None and epoch - 1 > budget["epochs"]:
        return f"{epoch - 1} epochs, budget {budget['epochs']}"
    return None


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Train unless ``trained.json`` matches, then decode and score; writes and returns ``finished.json``."""
    from nmtflow.config import load_config
    from nmtflow.train.trainer import resolve_device

    run_dir = Path(job["dir"])
    if job.get("threads"):
        torch.set_num_threads(job["threads"])
    cuda = resolve_device(job["device"]).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trained = read_json(run_dir / TRAINED)
    if is_trained(job, trained):
        if trained["fingerprint"] != job["fingerprint"]:  # recorded before the fingerprint left out decode
            trained["fingerprint"] = job["fingerprint"]
            write_json(run_dir / TRAINED, trained)
    else:
        config = load_config(job["config"])
        result = train(config)
        if result.progress.stopped.startswith("interrupted"):
            raise Interrupted(result.progress.stopped)
        p = result.progress
        if p.bad_updates >= config.train.max_bad_updates:  # diverged: the reason, not decoding's NaN scores after it
            raise RuntimeError(f"training diverged: {p.stopped}")
        beyond = beyond_budget(vars(p), job["budget"])
        if beyond:  # the comparison checks this before it starts a run; a lowered budget cannot undo training
            raise ValueError(f"{run_dir}: the run trained beyond the budget ({beyond}); use another --out, or "
                             "delete that run's directory")
        trained = {"fingerprint": job["fingerprint"], "budget": job["budget"], "update": p.update, "epoch": p.epoch,
                   "stopped": p.stopped, "train_seconds": p.elapsed, "train_tokens_per_s": train_tokens_per_s(run_dir),
                   "peak_rss_mb": max(peak_rss_mb(), (trained or {}).get("peak_rss_mb") or 0.0),
                   "cuda_peak_mb": torch.cuda.max_memory_allocated() / (1 << 20) if cuda else None}
        write_json(run_dir / TRAINED, trained)
    evaluation = evaluate(job)
    finished = {**trained, **evaluation, "eval_key": job["eval_key"],
                "peak_rss_mb": max(peak_rss_mb(), trained["peak_rss_mb"]),
                "cuda_peak_mb": max(torch.cuda.max_memory_allocated() / (1 << 20),
                                    trained["cuda_peak_mb"] or 0.0) if cuda else None}
    write_json(run_dir / FINISHED, finished)
    return finished


def is_trained(job: dict[str, Any], trained: dict[str, Any] | None) -> bool:
    """Whether ``trained`` (a run's trained.json) records this job's training: only decoding is left."""
    fingerprints = (job["fingerprint"], job.get("legacy", {}).get("fingerprint"))
    return bool(trained) and trained.get("fingerprint") in fingerprints and trained.get("budget") == job["budget"]


def checkpoint_to_decode(run_dir: Path, choice: str, average_last: int | None) -> tuple[Path, list[str]]:
    """(checkpoint file, the periodic checkpoints averaged into it) for ``best``, ``last`` or ``averaged``."""
    from nmtflow.checkpoint import average_checkpoints, periodic_checkpoints, save_atomic

    last, best = run_dir / "checkpoint_last.pt", run_dir / "checkpoint_best.pt"
    if choice == "averaged":
        found = periodic_checkpoints(run_dir)[-(average_last or 1):]
        if found and len(found) < (average_last or 1):
            log.warning("%s: average_last is %d but only %d periodic checkpoint(s) are there; averaging %s",
                        run_dir, average_last, len(found), ", ".join(p.name for p in found))
        if found:
            save_atomic(average_checkpoints(found), run_dir / "averaged.pt")
            return run_dir / "averaged.pt", [p.name for p in found]
        log.warning("%s: no periodic checkpoints to average (budget below train.save_every?); decoding %s",
                    run_dir, last.name)
        return last, []
    if choice == "best" and best.is_file():
        return best, []
    return last, []


def load_texts(item: dict[str, Any], max_sentences: int | None) -> tuple[list[str], list[str]]:
    """Source and reference sentences of a test set: the raw files, else the prepared split detokenised."""
    if item["src_file"] and item["ref_file"]:
        src, ref = read_lines(item["src_file"]), read_lines(item["ref_file"])
        if len(src) != len(ref):
            raise ValueError(f"{item['src_file']} has {len(src)} lines but {item['ref_file']} has {len(ref)}")
        from nmtflow.evaluate.metrics import warn_not_nfc

        warn_not_nfc(ref, item["ref_file"])
    else:
        from nmtflow.data.prepare import load_meta, load_split, load_tokenizer

        meta = load_meta(item["data_dir"])
        sides = []
        for lang in (item["src"], item["tgt"]):
            tok = load_tokenizer(item["data_dir"], lang, meta)
            rows = load_split(item["data_dir"], item["split"], lang, meta)
            sides.append([tok.decode(rows[i].tolist()) for i in range(len(rows))])
        src, ref = sides
    n = len(src) if max_sentences is None else min(len(src), max_sentences)
    return src[:n], ref[:n]


def run_decode(ev: dict[str, Any], saved: Any) -> Any:
    """The run's current ``decode`` section (it may have changed since training), else the checkpoint's."""
    if ev.get("decode") is None:
        return saved
    known = {f.name for f in dataclasses.fields(saved)}
    return dataclasses.replace(saved, **{k: v for k, v in ev["decode"].items() if k in known})


def evaluate(job: dict[str, Any]) -> dict[str, Any]:
    """Decode every test item with the chosen checkpoint; BLEU, chrF, sentences/s and parameters."""
    from nmtflow.decode.translate import Translator
    from nmtflow.models.base import count_parameters
    from nmtflow.train.trainer import resolve_device

    ev, run_dir = job["eval"], Path(job["dir"])
    device = resolve_device(job["device"])
    path, averaged = checkpoint_to_decode(run_dir, ev["checkpoint"], ev["average_last"])
    translator_for: Callable[[str, str], Translator]
    if job["multilingual"]:
        from nmtflow.decode.multilingual import load_multilingual

        ckpt = load_multilingual(path, device)
        decode = dataclasses.replace(run_decode(ev, ckpt.config.decode), **ev["search"])
        model, translator_for = ckpt.model, lambda s, t: ckpt.translator(s, t, decode)
    else:
        translator = Translator.from_checkpoint(path, device)
        translator.decode = dataclasses.replace(run_decode(ev, translator.decode), **ev["search"])
        model, translator_for = translator.model, lambda s, t: translator
    return {"checkpoint": path.name, "averaged_from": averaged, "parameters": count_parameters(model),
            **decode_items(ev, translator_for, run_dir)}


def decode_items(ev: dict[str, Any], translator_for: Callable[[str, str], Any], out_dir: Path) -> dict[str, Any]:
    """Translate every test item of ``ev`` into ``out_dir/hyp.SET.DIRECTION.txt``; BLEU, chrF, sentences/s."""
    from nmtflow.evaluate.metrics import bleu, chrf

    scores: dict[str, dict[str, Any]] = {}
    for item in ev["items"]:
        src, ref = load_texts(item, ev["max_sentences"])
        start = time.perf_counter()
        hyps = [nbest[0][0] for nbest in translator_for(item["src"], item["tgt"]).translate(src)]
        seconds = time.perf_counter() - start
        hyp_file = out_dir / f"hyp.{item['test_set']}.{item['direction']}.txt"
        hyp_file.write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
        tokenize = ev.get("bleu_tokenize", BLEU_TOKENIZER)
        b, c = bleu(hyps, ref, tokenize=tokenize), chrf(hyps, ref)
        b_lc = bleu(hyps, ref, tokenize=tokenize, lowercase=True)  # sacreBLEU case.lc, as many papers report
        scores[item["key"]] = {"bleu": b.score, "bleu_lc": b_lc.score, "chrf": c.score, "sentences": len(src),
                               "decode_seconds": seconds, "bleu_signature": b.signature,
                               "bleu_lc_signature": b_lc.signature, "chrf_signature": c.signature,
                               "hypotheses": hyp_file.name}
        log.info("%s %s: BLEU %.2f (lowercased %.2f), chrF %.2f (%d sentences, %.1f sentences/s)", out_dir,
                 item["key"], b.score, b_lc.score, c.score, len(src), len(src) / max(seconds, 1e-9))
    sentences = sum(s["sentences"] for s in scores.values())
    seconds = sum(s["decode_seconds"] for s in scores.values())
    return {"scores": scores, "decode_sentences_per_s": sentences / seconds if seconds > 0 else None}


def evaluate_ensemble(jobs: list[dict[str, Any]], out_dir: Path, device: str) -> dict[str, Any]:
    """Decode the test items of one run's seeds (``jobs``, each finished) with the ensemble of the checkpoints
    they decoded alone (:mod:`nmtflow.decode.ensemble`: the mean of their probabilities), under the first
    seed's decode settings; reused from ``out_dir/ensemble.json`` while the seeds' results are unchanged."""
    import hashlib

    from nmtflow.decode.ensemble import open_translators
    from nmtflow.train.trainer import resolve_device

    members = [str(Path(job["dir"]) / job["result"]["checkpoint"]) for job in jobs]
    key = hashlib.sha1(json.dumps([[job["seed"], job["eval_key"], job["result"].get("fingerprint"),
                                    job["result"].get("update"), job["result"]["checkpoint"]] for job in jobs],
                                  sort_keys=True).encode()).hexdigest()[:16]
    done = read_json(out_dir / "ensemble.json")
    if done and done.get("key") == key:
        log.info("%s: the ensemble of seeds %s was decoded earlier, skipped", out_dir,
                 ", ".join(str(job["seed"]) for job in jobs))
        return done
    out_dir.mkdir(parents=True, exist_ok=True)
    ev, torch_device = jobs[0]["eval"], resolve_device(device)
    translators: dict[tuple[str, str], Any] = {}

    def translator_for(src: str, tgt: str) -> Any:
        if (src, tgt) not in translators:
            translators.clear()  # one direction's members in memory at a time
            langs = (src, tgt) if jobs[0]["multilingual"] else (None, None)
            translator = open_translators(members, torch_device, *langs)
            translator.decode = dataclasses.replace(run_decode(ev, translator.decode), **ev["search"])
            translators[(src, tgt)] = translator
        return translators[(src, tgt)]

    result = {"key": key, "seeds": [job["seed"] for job in jobs], "members": members,
              **decode_items(ev, translator_for, out_dir)}
    write_json(out_dir / "ensemble.json", result)
    return result


JOB_LOCK = ".job.lock"  # held by a run's process from start to end: training, then decoding (the save dir's
# .lock is the trainer's, released when training ends)


def training_pid(run_dir: Path) -> int | None:
    """The pid of a process at work on the run in ``run_dir``: its :data:`JOB_LOCK`'s holder (training or decoding),
    else the save dir's ``.lock``'s (a training started otherwise, e.g. ``nmtflow train``); None if neither."""
    return lock_holder(run_dir / JOB_LOCK) or lock_holder(run_dir / ".lock")


def lock_holder(lock: Path) -> int | None:
    """The pid written in lock file ``lock`` if that process is alive and, where ``/proc`` shows it, has the file
    open (a pid reused by another process then does not count). The lock itself is not probed: taking it, even for
    a moment, could refuse a process that is starting."""
    try:
        pid = int(lock.read_text(encoding="ascii").strip())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:  # no /proc (not Linux) or another user's process: alive is all we know
        return pid
    links = set()
    for fd in fds:
        try:
            links.add(os.readlink(fd))
        except OSError:  # closed since the listing (the listing's own, when pid is this process)
            continue
    return pid if os.path.realpath(lock) in links else None


def stop_with_parent() -> None:
    """Have the kernel send this run SIGTERM when the comparison that started it dies (``kill -9``, a closed
    terminal), which it answers as Ctrl-C: a checkpoint, then exit; otherwise it trained on, orphaned, and the next
    ``nmtflow compare`` found its save dir busy. Linux only (``prctl``); elsewhere nothing."""
    parent = os.environ.get(PARENT_ENV)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):  # no prctl (not Linux)
        return
    if parent is not None and os.getppid() != int(parent):  # it died before prctl: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


def main(argv: list[str] | None = None) -> int:
    """``python -m nmtflow.evaluate.compare_job JOB.json``: exit 0 done, 3 interrupted, 4 another process trains
    in the run's save dir, 1 failed."""
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    job = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    stop_with_parent()
    try:  # held until this process ends: a second comparison of the same --out neither trains nor decodes this run
        lock_file(Path(job["dir"]) / JOB_LOCK, new_file_mode())
    except LockHeld as held:
        print(f"SaveDirBusy: {job['dir']}: another process is at work on this run (pid {held.owner})", file=sys.stderr,
              flush=True)
        return EXIT_BUSY
    keep_freed_memory()
    sys.path.insert(0, os.getcwd())
    for module in job.get("plugins", []):
        importlib.import_module(module)
    try:
        run_job(job)
    except Interrupted as exc:
        log.warning("%s: %s", job["dir"], exc)
        return EXIT_INTERRUPTED
    except SaveDirBusy as exc:  # the same run started twice (two comparisons of one --out): not this run's failure
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return EXIT_BUSY
    except Exception as exc:  # the traceback goes to train.log; the last line is what the comparison reports
        log.exception("run failed")
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
