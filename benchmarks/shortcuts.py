"""Training throughput of lexical shortcuts and feature-fusion relative to the baseline Transformer (SPEC §2).

Usage (see benchmarks/README.md)::

    python benchmarks/shortcuts.py --data data/multi30k --src en --tgt de --out results/shortcuts.json

The three systems differ only in their attention slots: baseline; ``{type: shortcut}`` in every encoder and
decoder self-attention sub-layer; the same with ``feature_fusion: true``. They run in one process on the same
collated batches with the same training step as ``throughput.py`` (its ``Optimiser``: label-smoothed loss,
backward, clipping, Adam + inverse-sqrt step), interleaved batch by batch (A, B, C on batch 1, then on batch 2,
...) so that load from other processes hits all three alike. Two ratios are reported: of total times, and the
median over batches of the per-batch ratio (robust to a burst of load during a few steps), and a bootstrap
interval over batches for the first. On the CPU the heap is held at its steady state before timing
(``--heap-headroom-mb``; page faults during the timed steps are reported). ``--profile-steps N`` adds each
system's share of time in matrix products and its matmul FLOPs. The paper's cost (Emelin et al. 2019,
Table 5, words/s on GPUs): shortcuts -11.0%, feature-fusion -20.5% relative to transformer-BASE; the target is
to lose less than that.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from nmtflow.config import load_config
from nmtflow.models.base import Vocabularies, build_model, count_parameters
from nmtflow.nn import shortcuts as shortcut_module
from nmtflow.runtime import machine_info
from throughput import (  # the sibling benchmark's training step (same batches, same step)
    Optimiser, add_common_args, default_work, matmul_profile, median_step_ratio, peak_rss_mb, prepared_data,
    slowdown_interval, timed_training, training_batches)

PAPER_WORDS_PER_S = {"baseline": 29_698, "shortcuts": 26_423, "feature_fusion": 23_601}  # Table 5, base
SC = {"type": "shortcut"}
FF = {"type": "shortcut", "feature_fusion": True}
SYSTEMS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "shortcuts": {"encoder_self_attention": SC, "decoder_self_attention": SC},
    "feature_fusion": {"encoder_self_attention": FF, "decoder_self_attention": FF},
}


def add_system_args(p: argparse.ArgumentParser, preset: str) -> None:
    """Data and model options shared with ``gpu_profile.py``."""
    p.add_argument("--data", type=Path, required=True, help="directory with train.LANG and val.LANG")
    p.add_argument("--work", type=Path, help="prepared-data cache (default runs/bench-data-SRC-TGT, as throughput.py)")
    p.add_argument("--preset", default=preset, choices=["small", "base", "big"])
    p.add_argument("--layers", type=int, default=6, help="encoder and decoder layers (shortcuts go into all)")


def build_systems(args: argparse.Namespace, vocab: int, device: torch.device) -> dict[str, Optimiser]:
    """The three systems from one config; only the attention slots differ."""
    systems: dict[str, Optimiser] = {}
    for name, slots in SYSTEMS.items():
        cfg = load_config(data={
            "model": {"name": "transformer", "preset": args.preset, "encoder_layers": args.layers,
                      "decoder_layers": args.layers, **slots},
            "train": {"seed": args.seed, "precision": args.precision, "label_smoothing": 0.1, "clip_norm": 1.0}})
        torch.manual_seed(args.seed)
        systems[name] = Optimiser(build_model(cfg.model, Vocabularies(vocab, vocab, joint=True)).to(device), cfg.train)
    return systems


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_system_args(p, preset="small")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/shortcuts.json"))
    p.add_argument("--profile-steps", type=int, default=0,
                   help="then profile this many steps per system (CPU): time in matrix products")
    p.add_argument("--elementwise-gate", action="store_true",
                   help="on CUDA, the gates in elementwise operators (as on the CPU) instead of one fused kernel")
    add_common_args(p, warmup=3, steps=30, rounds=None,  # default: --steps rounds, interleaved batch by batch
                    heap_headroom_mb=2048)  # three models of different sizes in one heap
    args = p.parse_args(argv)
    shortcut_module.USE_CUDA_KERNELS = not args.elementwise_gate
    args.rounds = args.rounds or args.steps
    if args.steps < 1:
        p.error("--steps must be >= 1")
    if args.profile_steps and args.device != "cpu":
        p.error("--profile-steps profiles CPU operators; use it with --device cpu")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    # 1. data: the same preparation (and default cache) as throughput.py; batches collated once, untimed
    work = args.work or default_work(args)
    vocab = prepared_data(args, work)
    batches = training_batches(work, args, args.warmup + args.steps, device)
    warm, timed = batches[:args.warmup], batches[args.warmup:]

    # 2. models: one config, only the attention slots differ
    systems = build_systems(args, vocab, device)

    # 3. untimed warm-up, then alternating timed blocks over the same batches
    faults: dict[str, int] = {}
    seconds, all_losses, steps = timed_training(systems, warm, timed, args.rounds, device, args.heap_headroom_mb,
                                                faults)
    losses = {name: values[-1] for name, values in all_losses.items()}
    rounds = max(1, min(args.rounds, len(timed)))
    tokens = sum(b.num_tgt_tokens for b in timed)

    # 4. report
    base_speed = tokens / seconds["baseline"]
    result: dict[str, Any] = {
        "machine": machine_info(device, threads=torch.get_num_threads()),
        "config": {"data": args.data.name, "src": args.src, "tgt": args.tgt, "vocab_size": vocab,
                   "preset": args.preset, "layers": args.layers, "max_tokens": args.max_tokens,
                   "precision": args.precision, "elementwise_gate": args.elementwise_gate,
                   "heap_headroom_mb": args.heap_headroom_mb if device.type == "cpu" else None,
                   "warmup_batches": len(warm), "timed_batches": len(timed), "rounds": rounds,
                   "timed_tgt_tokens": tokens, "seed": args.seed},
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }
    for name, opt in systems.items():
        speed = tokens / seconds[name]
        paper = PAPER_WORDS_PER_S[name] / PAPER_WORDS_PER_S["baseline"]
        result[name] = {"parameters": count_parameters(opt.model), "train_tgt_tokens_per_s": speed,
                        "train_seconds": seconds[name], "train_loss_last": losses[name],
                        "speed_vs_baseline": speed / base_speed, "slowdown_pct": 100 * (1 - speed / base_speed),
                        "slowdown_pct_ci95": list(slowdown_interval(steps, name, "baseline")),
                        "median_step_speed_vs_baseline": (median := median_step_ratio(steps, name, "baseline")),
                        "median_step_slowdown_pct": 100 * (1 - median), "paper_slowdown_pct": 100 * (1 - paper),
                        "timed_page_faults": faults[name]}
    if args.profile_steps:  # after the timing: how much of the slowdown the extra matrix products explain
        profiled = {name: matmul_profile(opt, timed[:args.profile_steps]) for name, opt in systems.items()}
        base = profiled["baseline"]
        for name, prof in profiled.items():
            # if the extra matmul FLOPs ran at the baseline's matmul speed and nothing else were added
            flops_ratio = prof["matmul_flops"] / base["matmul_flops"]
            extra = base["matmul_share"] * (flops_ratio - 1)
            result[name]["profile"] = {**prof, "matmul_flops_vs_baseline": flops_ratio,
                                       "matmul_only_slowdown_pct": 100 * extra / (1 + extra)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")

    print(f"{'':16}{'parameters':>14}{'tgt tokens/s':>14}{'vs baseline':>13}{'slowdown':>10}{'95% interval':>16}"
          f"{'median step':>13}{'paper':>8}{'page faults':>13}")
    for name in systems:
        r = result[name]
        low, high = r["slowdown_pct_ci95"]
        print(f"{name:16}{r['parameters']:>14,}{r['train_tgt_tokens_per_s']:>14,.1f}{r['speed_vs_baseline']:>13.3f}"
              f"{r['slowdown_pct']:>9.1f}%{f'{low:.1f} to {high:.1f}%':>16}{r['median_step_slowdown_pct']:>12.1f}%"
              f"{r['paper_slowdown_pct']:>7.1f}%{r['timed_page_faults']:>13,}")
    for name in systems:
        if "profile" in result[name]:
            r = result[name]["profile"]
            print(f"{name}: matmuls {100 * r['matmul_share']:.1f}% of the profiled step, "
                  f"matmul FLOPs x{r['matmul_flops_vs_baseline']:.3f} of the baseline's: "
                  f"a {r['matmul_only_slowdown_pct']:.1f}% slowdown at the baseline's matmul speed")
    print(f"timed target tokens: {tokens:,}; written to {args.out}")
    return result


if __name__ == "__main__":
    main()
