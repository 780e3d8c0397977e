"""Peak memory of ``prepare`` and of a short training run as the corpus grows (1×, 4×, 10× a base corpus).

Usage (see benchmarks/README.md)::

    python benchmarks/prepare_memory.py --out benchmarks/results/prepare_memory.json            # synthetic base
    python benchmarks/prepare_memory.py --data DIR --src en --tgt de                               # e.g. Multi30k

The base corpus is the built-in synthetic one (``nmtflow.data.synthetic``, ``--n-train`` sentences) or the raw
``train.SRC``/``train.TGT`` of ``--data``. A corpus of scale k is the base written k times: the first copy as it
is, every further copy with light noise (per sentence and side, with probability ``--noise``: one random word
dropped or two neighbouring words swapped), so no two copies are byte-identical. Each scale is prepared
(``nmtflow.data.prepare.prepare``, joint SentencePiece vocabulary) and then trained on for ``--updates`` updates
(``Trainer``, a small Transformer), each in its own child process, which reports its own peak RSS
(``resource.getrusage(RUSAGE_SELF).ru_maxrss``, and ``RUSAGE_CHILDREN`` for ``--workers`` encoder processes).
Memory that is bounded does not grow with k beyond the O(rows) index arrays (8 bytes per sentence and side).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator


def rss_mb(who: int = resource.RUSAGE_SELF) -> float:
    """Peak resident set size in MiB (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(who).ru_maxrss
    return peak / (1 << 20) if sys.platform == "darwin" else peak / 1024


# ---- corpora ------------------------------------------------------------------------------------------------
def noisy(line: str, rng: random.Random, p: float) -> str:
    """With probability ``p``: drop one random word, or swap two neighbouring words (sentences of 3+ words)."""
    words = line.split()
    if len(words) < 3 or rng.random() >= p:
        return line
    i = rng.randrange(len(words) - 1)
    if rng.random() < 0.5:
        del words[i]
    else:
        words[i], words[i + 1] = words[i + 1], words[i]
    return " ".join(words)


def lines_of(path: Path) -> Iterator[str]:
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            yield line.rstrip("\n")


def build_corpus(base: Path, out: Path, langs: list[str], scale: int, noise: float, seed: int) -> dict[str, Any]:
    """``out.LANG`` = ``scale`` copies of ``base.LANG`` (copies after the first with noise), streamed."""
    out.parent.mkdir(parents=True, exist_ok=True)
    handles = {lang: open(f"{out}.{lang}", "w", encoding="utf-8") for lang in langs}
    rows = 0
    try:
        for copy in range(scale):
            rng = random.Random(seed * 1000 + copy)
            for row in zip(*(lines_of(Path(f"{base}.{lang}")) for lang in langs)):
                for lang, line in zip(langs, row):
                    handles[lang].write((line if copy == 0 else noisy(line, rng, noise)) + "\n")
                rows += 1
    finally:
        for h in handles.values():
            h.close()
    return {"rows": rows, "raw_mb": sum(Path(f"{out}.{lang}").stat().st_size for lang in langs) / (1 << 20)}


# ---- the child processes ------------------------------------------------------------------------------------
def child_prepare(args: argparse.Namespace) -> dict[str, Any]:
    from nmtflow.data.prepare import prepare  # no torch: the data pipeline alone

    baseline = rss_mb()
    start = time.perf_counter()
    splits = {"train": args.train_prefix, **({"valid": args.valid_prefix} if args.valid_prefix else {})}
    kwargs = {"max_sentences": args.spm_sentences} if args.spm_sentences else {}
    meta = prepare(splits, [args.src, args.tgt], Path(args.prepared), vocab_size=args.vocab_size, joint=True,
                   workers=args.workers, num_threads=args.threads, progress=False, **kwargs)
    return {"seconds": time.perf_counter() - start, "baseline_rss_mb": baseline, "peak_rss_mb": rss_mb(),
            "workers_peak_rss_mb": rss_mb(resource.RUSAGE_CHILDREN), "rows": meta["splits"]["train"]["rows"],
            "prepared_mb": sum(p.stat().st_size for p in Path(args.prepared).iterdir()) / (1 << 20)}


def child_train(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from nmtflow.config import load_config
    from nmtflow.train.trainer import Trainer, read_log

    baseline = rss_mb()
    config = load_config(data={
        "model": {"name": "transformer", "preset": "small", "encoder_layers": args.layers,
                  "decoder_layers": args.layers, "d_model": args.d_model, "ffn_dim": 4 * args.d_model},
        "data": {"path": args.prepared, "src_lang": args.src, "tgt_lang": args.tgt, "max_tokens": args.max_tokens,
                 "valid_split": "valid" if args.valid_prefix else ""},
        "train": {"save_dir": args.save_dir, "max_updates": args.updates, "threads": args.threads, "device": "cpu",
                  "lr": 1e-3, "warmup_updates": 100, "valid_bleu": False, "validate_every": 0, "save_every": 0,
                  "log_every": max(1, args.updates // 4), "progress": False, "seed": args.seed}})
    torch.manual_seed(args.seed)
    start = time.perf_counter()
    trainer = Trainer(config, resume=False)
    built = rss_mb()
    trainer.train()
    speeds = [e["tgt_tokens_per_s"] for e in read_log(args.save_dir) if e["kind"] == "speed"]
    return {"seconds": time.perf_counter() - start, "baseline_rss_mb": baseline, "after_setup_rss_mb": built,
            "peak_rss_mb": rss_mb(), "updates": trainer.progress.update, "epochs_seen": trainer.progress.epoch,
            "batches_per_epoch": len(trainer.epoch_batches(1)),
            "tgt_tokens_per_s": speeds[-1] if speeds else None}


def run_child(mode: str, args: argparse.Namespace, **paths: str) -> dict[str, Any]:
    """Run this script in ``--child MODE`` in a fresh process; its last stdout line is its JSON report."""
    cmd = [sys.executable, __file__, "--child", mode, "--src", args.src, "--tgt", args.tgt,
           "--vocab-size", str(args.vocab_size), "--workers", str(args.workers), "--threads", str(args.threads),
           "--updates", str(args.updates), "--layers", str(args.layers), "--d-model", str(args.d_model),
           "--max-tokens", str(args.max_tokens), "--seed", str(args.seed)]
    if args.spm_sentences:
        cmd += ["--spm-sentences", str(args.spm_sentences)]
    for key, value in paths.items():
        cmd += [f"--{key.replace('_', '-')}", value]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"child {mode} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- the benchmark ------------------------------------------------------------------------------------------
def base_corpus(args: argparse.Namespace, work: Path) -> tuple[Path, Path | None]:
    """(train prefix, valid prefix or None) of the base corpus."""
    if args.data is None:
        from nmtflow.data.synthetic import generate_corpus

        raw = work / "base"
        if not all((raw / f"train.{lang}").is_file() for lang in (args.src, args.tgt)):
            try:
                generate_corpus(raw, langs=(args.src, args.tgt), n_train=args.n_train, n_valid=200, n_test=1,
                                seed=args.seed)
            except ValueError as e:  # a language the synthetic corpus does not have
                raise SystemExit(str(e)) from None
        return raw / "train", raw / "valid"
    missing = [str(args.data / f"train.{lang}") for lang in (args.src, args.tgt)
               if not (args.data / f"train.{lang}").is_file()]
    if missing:
        raise SystemExit(f"{', '.join(missing)}: file not found (--data, --src, --tgt)")
    for name in ("valid", "val", "dev"):
        if all((args.data / f"{name}.{lang}").is_file() for lang in (args.src, args.tgt)):
            return args.data / "train", args.data / name
    return args.data / "train", None


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, help="raw directory with train.SRC/train.TGT (default: the synthetic corpus)")
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--n-train", type=int, default=20000, help="synthetic base corpus size (without --data)")
    p.add_argument("--scales", type=int, nargs="+", default=[1, 4, 10], help="corpus sizes, in copies of the base")
    p.add_argument("--noise", type=float, default=0.3, help="share of sentences per copy with a word dropped/swapped")
    p.add_argument("--vocab-size", type=int, default=4000)
    p.add_argument("--spm-sentences", type=int, help="SentencePiece training sample (default: prepare's 2,000,000)")
    p.add_argument("--workers", type=int, default=1, help="prepare's encoder processes")
    p.add_argument("--updates", type=int, default=20, help="training updates per scale")
    p.add_argument("--layers", type=int, default=2, help="encoder and decoder layers of the trained Transformer")
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--work", type=Path, default=Path("runs/bench-prepare-memory"), help="corpora, data, runs")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/prepare_memory.json"))
    p.add_argument("--keep", action="store_true", help="keep each scale's corpus and prepared data")
    # child modes (internal)
    p.add_argument("--child", choices=["prepare", "train"], help=argparse.SUPPRESS)
    p.add_argument("--train-prefix", help=argparse.SUPPRESS)
    p.add_argument("--valid-prefix", help=argparse.SUPPRESS)
    p.add_argument("--prepared", help=argparse.SUPPRESS)
    p.add_argument("--save-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        report = child_prepare(args) if args.child == "prepare" else child_train(args)
        print(json.dumps(report))
        return None

    import shutil

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    train_base, valid_base = base_corpus(args, work)
    valid = {"valid_prefix": str(valid_base)} if valid_base else {}
    results = []
    for k in sorted(set(args.scales)):
        corpus, prepared, run = work / f"x{k}" / "raw" / "train", work / f"x{k}" / "data", work / f"x{k}" / "run"
        shutil.rmtree(work / f"x{k}", ignore_errors=True)
        built = build_corpus(train_base, corpus, [args.src, args.tgt], k, args.noise, args.seed)
        prep = run_child("prepare", args, train_prefix=str(corpus), prepared=str(prepared), **valid)
        train = run_child("train", args, prepared=str(prepared), save_dir=str(run), **valid)
        results.append({"scale": k, "corpus_rows": built["rows"], "raw_mb": round(built["raw_mb"], 2),
                        "prepare": prep, "train": train})
        print(f"x{k:<3} {built['rows']:>9,} rows {built['raw_mb']:8.1f} MB raw | prepare {prep['seconds']:6.1f} s, "
              f"peak {prep['peak_rss_mb']:7.1f} MB | train {train['seconds']:6.1f} s, "
              f"peak {train['peak_rss_mb']:7.1f} MB", flush=True)
        if not args.keep:
            shutil.rmtree(work / f"x{k}", ignore_errors=True)
    first, last = results[0], results[-1]
    import torch

    from nmtflow.runtime import machine_info
    report = {
        "machine": machine_info(platform=platform.platform(), threads=args.threads),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                   if k not in ("child", "train_prefix", "valid_prefix", "prepared", "save_dir")},
        "base": "synthetic" if args.data is None else str(args.data),
        "scales": results,
        "growth": {  # peak RSS at the largest scale over the smallest one
            "scale_ratio": last["scale"] / first["scale"],
            "prepare_peak_rss_ratio": last["prepare"]["peak_rss_mb"] / first["prepare"]["peak_rss_mb"],
            "train_peak_rss_ratio": last["train"]["peak_rss_mb"] / first["train"]["peak_rss_mb"],
            "prepare_peak_rss_delta_mb": last["prepare"]["peak_rss_mb"] - first["prepare"]["peak_rss_mb"],
            "train_peak_rss_delta_mb": last["train"]["peak_rss_mb"] - first["train"]["peak_rss_mb"],
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    g = report["growth"]
    print(f"x{last['scale']} vs x{first['scale']}: prepare peak RSS ×{g['prepare_peak_rss_ratio']:.2f} "
          f"({g['prepare_peak_rss_delta_mb']:+.1f} MB), train peak RSS ×{g['train_peak_rss_ratio']:.2f} "
          f"({g['train_peak_rss_delta_mb']:+.1f} MB); wrote {args.out}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
