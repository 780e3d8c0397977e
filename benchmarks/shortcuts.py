"""Training throughput of lexical shortcuts and feature-fusion relative to the baseline Transformer (SPEC §2).

Usage (see benchmarks/README.md)::

    python benchmarks/shortcuts.py --data data/multi30k --src en --tgt de --out results/shortcuts.json

The three systems differ only in their attention slots: baseline; ``{type: shortcut}`` in every encoder and
decoder self-attention sub-layer; the same with ``feature_fusion: true``. They run in one process on the same
collated batches with the same training step as ``throughput.py`` (its ``Optimiser``: label-smoothed loss,
backward, clipping, Adam + inverse-sqrt step), in alternating blocks (A, B, C, A, B, C, ...) so that load from
other processes hits all three alike. The paper's cost (Emelin et al. 2019, Table 5, words/s on GPUs): shortcuts
-11.0%, feature-fusion -20.5% relative to transformer-BASE; the target is to lose less than that.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

from nmtflow.config import load_config
from nmtflow.data.batching import TokenBatchSampler
from nmtflow.data.bitext import open_bitext
from nmtflow.data.prepare import load_meta, load_tokenizer, prepare
from nmtflow.models.base import Vocabularies, build_model, count_parameters
from throughput import Optimiser, peak_rss_mb  # the sibling benchmark's training step (same batches, same step)

PAPER_WORDS_PER_S = {"baseline": 29_698, "shortcuts": 26_423, "feature_fusion": 23_601}  # Table 5, base
SC = {"type": "shortcut"}
FF = {"type": "shortcut", "feature_fusion": True}
SYSTEMS: dict[str, dict[str, Any]] = {
    "baseline": {},
    "shortcuts": {"encoder_self_attention": SC, "decoder_self_attention": SC},
    "feature_fusion": {"encoder_self_attention": FF, "decoder_self_attention": FF},
}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True, help="directory with train.LANG and val.LANG")
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--work", type=Path, help="prepared-data cache (default runs/bench-data-SRC-TGT, as throughput.py)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/shortcuts.json"))
    p.add_argument("--preset", default="small", choices=["small", "base", "big"])
    p.add_argument("--layers", type=int, default=6, help="encoder and decoder layers (shortcuts go into all)")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=3, help="untimed training batches per system")
    p.add_argument("--steps", type=int, default=30, help="timed training batches per system")
    p.add_argument("--rounds", type=int, default=3, help="alternating blocks the timed steps are split into")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", help="cpu | cuda (timings synchronise the GPU)")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be >= 1")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    # 1. data: the same preparation (and default cache) as throughput.py; batches collated once, untimed
    work = args.work or Path(f"runs/bench-data-{args.src}-{args.tgt}")
    if not (work / "meta.json").is_file():
        prepare({"train": args.data / "train", "valid": args.data / "val"}, [args.src, args.tgt], work,
                vocab_size=args.vocab_size, joint=True)
    vocab = load_tokenizer(work, args.tgt, load_meta(work)).vocab_size
    train = open_bitext(work, "train", args.src, args.tgt)
    sampler = TokenBatchSampler(train.src.sizes, train.tgt.sizes, args.max_tokens, shuffle=True, seed=args.seed)
    needed, order, epoch = args.warmup + args.steps, [], 1
    while len(order) < needed:
        order += sampler.batches(epoch)
        epoch += 1
    batches = [train.batch(idx).to(device) for idx in order[:needed]]
    warm, timed = batches[:args.warmup], batches[args.warmup:]

    # 2. models: one config, only the attention slots differ
    systems: dict[str, Optimiser] = {}
    for name, slots in SYSTEMS.items():
        cfg = load_config(data={
            "model": {"name": "transformer", "preset": args.preset, "encoder_layers": args.layers,
                      "decoder_layers": args.layers, **slots},
            "train": {"seed": args.seed, "label_smoothing": 0.1, "clip_norm": 1.0}})
        torch.manual_seed(args.seed)
        systems[name] = Optimiser(build_model(cfg.model, Vocabularies(vocab, vocab, joint=True)).to(device), cfg.train)

    # 3. untimed warm-up, then alternating timed blocks over the same batches
    for opt in systems.values():
        for b in warm:
            opt.step(b)
    seconds = dict.fromkeys(systems, 0.0)
    losses: dict[str, float] = {}
    rounds = max(1, min(args.rounds, len(timed)))
    for r in range(rounds):
        block = timed[r * len(timed) // rounds:(r + 1) * len(timed) // rounds]
        for name, opt in systems.items():
            for b in block:
                sync()
                start = time.perf_counter()
                losses[name] = opt.step(b)
                seconds[name] += time.perf_counter() - start
    tokens = sum(b.num_tgt_tokens for b in timed)

    # 4. report
    base_speed = tokens / seconds["baseline"]
    result: dict[str, Any] = {
        "machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads(),
                    "device": str(device), "python": platform.python_version(), "arch": platform.machine()},
        "config": {"data": args.data.name, "src": args.src, "tgt": args.tgt, "vocab_size": vocab,
                   "preset": args.preset, "layers": args.layers, "max_tokens": args.max_tokens,
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
                        "paper_slowdown_pct": 100 * (1 - paper)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")

    print(f"{'':16}{'parameters':>14}{'tgt tokens/s':>14}{'vs baseline':>13}{'slowdown':>10}{'paper':>8}")
    for name in systems:
        r = result[name]
        print(f"{name:16}{r['parameters']:>14,}{r['train_tgt_tokens_per_s']:>14,.1f}{r['speed_vs_baseline']:>13.3f}"
              f"{r['slowdown_pct']:>9.1f}%{r['paper_slowdown_pct']:>7.1f}%")
    print(f"timed target tokens: {tokens:,}; written to {args.out}")
    return result


if __name__ == "__main__":
    main()
