"""Training throughput of the attention-bridge model against the language-label model (SPEC §5).

Usage (see benchmarks/README.md)::

    python benchmarks/bridge.py --data DIR --langs en de fr --out benchmarks/results/bridge.json

Both systems are trained by :class:`~nmtflow.train.multilingual.MultilingualTrainer` on the same multi-way
prepared directory, with the same language-rotating schedule (every ordered pair of ``--langs``, round robin),
hence the same directions and sentences in the same order; only the model differs (the language-label
sources carry one extra ``<2xx>`` token). Timed steps are ``Trainer.train_step`` on one batch (forward, loss
incl. the bridge penalty, backward, clipping, Adam step), in alternating blocks (A, B, A, B, ...).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from nmtflow.config import load_config
from nmtflow.data.batching import Batch
from nmtflow.data.prepare import load_meta, prepare
from nmtflow.data.synthetic import generate_corpus
from nmtflow.models.base import count_parameters
from nmtflow.runtime import machine_info
from nmtflow.train.multilingual import MultilingualTrainer
from nmtflow.train.trainer import Trainer
from throughput import device_option, prepare_once  # the sibling benchmark's helpers


def prepared(args: argparse.Namespace) -> Path:
    """The prepared multi-way directory (joint vocabulary with <2xx> tags, as the language-label model needs)."""
    work = args.work or Path(f"runs/bench-bridge-{'-'.join(args.langs)}")

    def make() -> None:
        raw = args.data
        if raw is None:  # the built-in synthetic corpus
            raw = work.parent / f"{work.name}-raw"
            generate_corpus(raw, langs=args.langs, n_train=args.n_train, n_valid=10, n_test=10, seed=args.seed)
        prepare({"train": str(raw / "train")}, args.langs, work, vocab_size=args.vocab_size, joint=True,
                lang_tags=True, progress=False)

    prepare_once(work, args.langs, make)
    return work


def trainer(args: argparse.Namespace, data: Path, model: dict[str, Any], save_dir: Path) -> MultilingualTrainer:
    config = load_config(data={
        "model": model,
        "data": {"path": str(data), "max_tokens": args.max_tokens, "max_sentences": args.max_sentences,
                 "valid_split": "", "multilingual": {"langs": list(args.langs)}},
        "train": {"save_dir": str(save_dir), "seed": args.seed, "threads": args.threads, "device": args.device,
                  "lr": 1e-3, "warmup_updates": 1000, "clip_norm": 5.0, "progress": False}})
    torch.manual_seed(args.seed)
    return MultilingualTrainer(config, resume=False)


def time_in_blocks(trainers: dict[str, Trainer], batches: dict[str, list[Batch]], args: argparse.Namespace,
                   results: dict[str, dict[str, Any]]) -> None:
    """Time ``args.steps`` ``train_step`` calls per system on its ``batches`` after the first ``args.warmup``, in
    ``args.rounds`` alternating blocks (A, B, A, B, ...); ``results[name]`` gets seconds, tokens and every loss."""
    for name in trainers:
        results[name].update(seconds=0.0, tokens=0, losses=[])
    per_round = -(-args.steps // args.rounds)
    for r in range(args.rounds):
        for name, t in trainers.items():
            for b in batches[name][args.warmup + r * per_round: args.warmup + (r + 1) * per_round]:
                start = time.perf_counter()
                stats = t.train_step([b])
                if t.device.type == "cuda":
                    torch.cuda.synchronize()
                results[name]["seconds"] += time.perf_counter() - start
                results[name]["tokens"] += stats["tokens"]
                results[name]["losses"].append(round(stats["loss"], 5))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, help="directory with raw multi-way train.LANG (default: the synthetic corpus)")
    p.add_argument("--langs", nargs="+", default=["en", "de", "fr"])
    p.add_argument("--work", type=Path, help="prepared-data cache (default runs/bench-bridge-LANGS)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/bridge.json"))
    p.add_argument("--n-train", type=int, default=20000, help="synthetic corpus size (without --data)")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--hidden", type=int, default=512, help="d_h of both systems")
    p.add_argument("--layers", type=int, default=2, help="encoder and decoder layers of both systems")
    p.add_argument("--bridge-heads", type=int, default=10, help="k")
    p.add_argument("--bridge-dim", type=int, default=1024, help="d_w")
    p.add_argument("--no-input-feeding", action="store_true")
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--max-sentences", type=int, default=64)
    p.add_argument("--warmup", type=int, default=3, help="untimed training batches per system")
    p.add_argument("--steps", type=int, default=24, help="timed training batches per system")
    p.add_argument("--rounds", type=int, default=4, help="alternating A/B blocks the timed steps are split into")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", type=device_option)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        p.error("--steps and --rounds must be >= 1")
    torch.set_num_threads(args.threads)

    data = prepared(args)
    rnn = {"hidden_dim": args.hidden, "encoder_layers": args.layers, "decoder_layers": args.layers,
           "dropout": 0.3, "input_feeding": not args.no_input_feeding}
    systems = {
        "bridge": {"name": "bridge", **rnn, "bridge_heads": args.bridge_heads, "bridge_dim": args.bridge_dim},
        "language_label": {"name": "language_label", "backbone": {"name": "rnn", **rnn}},
    }
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {name: trainer(args, data, model, Path(tmp) / name) for name, model in systems.items()}
        batches: dict[str, list[Batch]] = {}
        for name, t in trainers.items():
            stream = t.batches()
            batches[name] = [next(stream)[2] for _ in range(args.warmup + args.steps)]
            for b in batches[name][:args.warmup]:
                t.train_step([b])
            results[name] = {"parameters": count_parameters(t.model)}
        time_in_blocks(trainers, batches, args, results)
        for r in results.values():
            r["last_loss"] = r.pop("losses")[-1]
        directions = [str(d) for d in trainers["bridge"].directions]
    for r in results.values():
        r["train_tgt_tokens_per_s"] = r["tokens"] / max(r["seconds"], 1e-9)
    report = {
        "machine": machine_info(args.device, threads=args.threads),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "directions": directions,
        "vocab_size": load_meta(data)["vocab_size"],
        **results,
        "ratio_bridge_over_language_label": results["bridge"]["train_tgt_tokens_per_s"]
        / max(results["language_label"]["train_tgt_tokens_per_s"], 1e-9),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"{'system':<16}{'params':>12}{'tgt tok/s':>12}")
    for name in systems:
        print(f"{name:<16}{results[name]['parameters']:>12,}{results[name]['train_tgt_tokens_per_s']:>12.0f}")
    print(f"bridge / language_label: {report['ratio_bridge_over_language_label']:.3f}; wrote {args.out}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
