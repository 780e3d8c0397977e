"""Training throughput of DenseNMT vs. ConvS2S vs. a Transformer (small), same process, same batches (CPU).

Usage (see benchmarks/README.md)::

    python benchmarks/convs2s.py --data data/multi30k --src en --tgt de --out results.json

The three systems get the same batches in the same order, the same loss, optimiser, schedule and gradient
clipping (one step = :class:`throughput.Optimiser`, which mirrors ``Trainer.train_step``); only the model
differs. Timed steps run in alternating blocks (A, B, C, A, B, C, ...), so background load hits all alike.
The optimiser is the same Adam for all three (the comparison is about the models' compute), not the
Nesterov SGD of the ConvS2S/DenseNMT presets.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark module
from throughput import (Optimiser, add_common_args, default_work, peak_rss_mb, prepared_data,  # noqa: E402
                        timed_training, training_batches)

from nmtflow.config import load_config, read_yaml  # noqa: E402
from nmtflow.models.base import Vocabularies, build_model, count_parameters  # noqa: E402
from nmtflow.runtime import machine_info  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TINY = {  # --tiny: a smoke test of this script, not a benchmark
    "densenmt": {"embed_dim": 32, "growth": 16, "encoder_layers": 2, "decoder_layers": 2},
    "convs2s": {"embed_dim": 32, "hidden": 32, "encoder_layers": 2, "decoder_layers": 2},
    "transformer": {"d_model": 32, "ffn_dim": 64, "heads": 4, "encoder_layers": 2, "decoder_layers": 2},
}


def model_sections(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The ``model`` section of each system: the two conv presets from configs/, Transformer small."""
    sections = {
        "densenmt": read_yaml(args.densenmt_config)["model"],
        "convs2s": read_yaml(args.convs2s_config)["model"],
        "transformer": {"name": "transformer", "preset": "small", "encoder_layers": args.transformer_layers,
                        "decoder_layers": args.transformer_layers},
    }
    if args.tiny:
        sections = {name: {**model, **TINY[name]} for name, model in sections.items()}
    return sections


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True, help="directory with train.LANG")
    p.add_argument("--work", type=Path, help="prepared-data cache (default runs/bench-conv-data-SRC-TGT)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/convs2s.json"))
    p.add_argument("--densenmt-config", type=Path, default=CONFIGS / "densenmt-4l-2.yaml")
    p.add_argument("--convs2s-config", type=Path, default=CONFIGS / "convs2s-4l.yaml")
    p.add_argument("--transformer-layers", type=int, default=4, help="encoder and decoder layers")
    p.add_argument("--tiny", action="store_true", help="tiny models: checks that the script runs")
    add_common_args(p, warmup=5, steps=40, rounds=4, heap_headroom_mb=2048)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    # 1. data: the same collated batches for every system
    work = args.work or default_work(args, "bench-conv-data")
    vocab = prepared_data(args, work, with_valid=False)
    batches = training_batches(work, args, args.warmup + args.steps, device)
    warm, timed = batches[:args.warmup], batches[args.warmup:]

    # 2. models (same seed before each), one optimiser configuration for all
    systems: dict[str, Optimiser] = {}
    for name, model in model_sections(args).items():
        cfg = load_config(data={"model": model, "train": {"seed": args.seed, "precision": args.precision,
                                                          "label_smoothing": 0.1, "clip_norm": 1.0,
                                                          "warmup_updates": 4000}})
        torch.manual_seed(args.seed)
        systems[name] = Optimiser(build_model(cfg.model, Vocabularies(vocab, vocab, joint=True)).to(device), cfg.train)

    # 3. untimed warm-up, then alternating timed blocks over the same batches
    seconds, losses, _ = timed_training(systems, warm, timed, args.rounds, device, args.heap_headroom_mb)
    rounds = max(1, min(args.rounds, len(timed)))
    tokens = sum(b.num_tgt_tokens for b in timed)

    # 4. report
    result: dict[str, Any] = {
        "machine": machine_info(device, threads=torch.get_num_threads()),
        "config": {"data": args.data.name, "src": args.src, "tgt": args.tgt, "vocab_size": vocab,
                   "densenmt_config": args.densenmt_config.name, "convs2s_config": args.convs2s_config.name,
                   "transformer_layers": args.transformer_layers, "tiny": args.tiny, "max_tokens": args.max_tokens,
                   "precision": args.precision,
                   "warmup_batches": args.warmup, "timed_batches": len(timed), "rounds": rounds,
                   "timed_tgt_tokens": tokens, "seed": args.seed},
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }
    for name, opt in systems.items():
        result[name] = {"parameters": count_parameters(opt.model), "train_tgt_tokens_per_s": tokens / seconds[name],
                        "train_seconds": seconds[name], "train_loss_last": losses[name][-1]}
    base = result["convs2s"]["train_tgt_tokens_per_s"]
    result["ratios_to_convs2s"] = {name: result[name]["train_tgt_tokens_per_s"] / base for name in systems}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")

    print(f"{'':14}{'parameters':>14}{'tgt tokens/s':>15}{'vs convs2s':>12}")
    for name in systems:
        r = result[name]
        print(f"{name:14}{r['parameters']:>14,}{r['train_tgt_tokens_per_s']:>15,.1f}"
              f"{result['ratios_to_convs2s'][name]:>12.2f}")
    print(f"written to {args.out}")
    return result


if __name__ == "__main__":
    main()
