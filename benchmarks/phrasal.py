"""Training and decoding throughput, and memory, of phrasal attention relative to the baseline (SPEC §3).

Usage (see benchmarks/README.md)::

    python benchmarks/phrasal.py --data data/multi30k --src en --tgt de --out results/phrasal.json

The systems differ only in their attention slots: the baseline Transformer, and phrasal attention over
each ``--ngrams`` set (default {1,2} and {1,2,3}) in all three slots (encoder self, decoder self, cross).
They run in one process on the same collated batches with the same training step as ``throughput.py``
(its ``Optimiser``), in alternating blocks (A, B, C, A, B, C, ...), and decode the same validation
sentences with the same beam search, alternating batch by batch, so that load from other processes hits
all systems alike. Memory: per system the parameters, gradients and Adam state, and the activations a
training step keeps for backward (the bytes of the distinct storages autograd saves, measured on the
largest timed batch); on CUDA also the peak allocated memory of its training; process peak RSS per phase.

``--compare-with REV`` adds, per n-gram set, a system with the same weights whose phrasal modules run
``nmtflow/nn/phrasal.py`` as it was at git revision REV (loaded from ``git show``, the rest of nmtflow as checked
out): old and new code side by side in one process, and whether their decoded outputs are identical.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch

import nmtflow.registry
from nmtflow.config import load_config
from nmtflow.data.batching import Batch, collate
from nmtflow.data.bitext import open_bitext
from nmtflow.decode.search import max_output_lengths
from nmtflow.decode.translate import batches_by_length
from nmtflow.models.base import EncoderDecoder, Vocabularies, build_model, count_parameters
from nmtflow.nn.phrasal import PhrasalAttention
from nmtflow.runtime import machine_info
from nmtflow.train.loss import label_smoothed_nll
from throughput import (  # the sibling benchmark's step, search and RSS
    Optimiser, add_common_args, decode_batch, default_work, peak_rss_mb, prepared_data, steady_heap,
    training_batches)


def slots(ngrams: list[int] | None) -> dict[str, Any]:
    """Model-config overrides: phrasal attention over ``ngrams`` in every slot (None: the baseline)."""
    if ngrams is None:
        return {}
    slot = {"type": "phrasal", "ngrams": ngrams}
    return {"encoder_self_attention": slot, "decoder_self_attention": slot, "cross_attention": slot}


def phrasal_class_at(rev: str) -> type:
    """``PhrasalAttention`` as ``nmtflow/nn/phrasal.py`` defined it at git revision ``rev`` (not registered)."""
    source = subprocess.run(["git", "show", f"{rev}:nmtflow/nn/phrasal.py"], capture_output=True, text=True,
                            check=True, cwd=Path(__file__).resolve().parent).stdout
    module = types.ModuleType(f"phrasal_at_{rev}")
    sys.modules[module.__name__] = module  # for its dataclasses
    register = nmtflow.registry.register_attention
    nmtflow.registry.register_attention = lambda *a, **k: (lambda cls: cls)  # type: ignore[assignment]
    try:
        exec(compile(source, f"{rev}:nmtflow/nn/phrasal.py", "exec"), module.__dict__)
    finally:
        nmtflow.registry.register_attention = register
    return module.PhrasalAttention


def activation_mb(model: EncoderDecoder, b: Batch) -> float:
    """MB of the distinct non-parameter storages autograd saves for backward in one training forward pass."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = label_smoothed_nll(model(b.src, b.tgt_in), b.tgt_out, 0.1)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values()) / 2 ** 20


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True, help="directory with train.LANG and val.LANG (or valid.LANG)")
    p.add_argument("--work", type=Path, help="prepared-data cache (default runs/bench-data-SRC-TGT, as throughput.py)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/phrasal.json"))
    p.add_argument("--ngrams", nargs="+", default=["12", "123"], help="n-gram sets, digits each (12 = {1,2})")
    p.add_argument("--preset", default="small", choices=["small", "base", "big"])
    p.add_argument("--layers", type=int, default=3, help="encoder and decoder layers")
    p.add_argument("--decode-sentences", type=int, default=200)
    p.add_argument("--decode-max-tokens", type=int, default=6000)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--decode-rounds", type=int, default=1, help="decode the sentences this many times (alternating)")
    p.add_argument("--compare-with", metavar="REV", help="also run phrasal.py of this git revision (see above)")
    p.add_argument("--compile", action="store_true",
                   help="train every system with train.compile (its layers and the loss under torch.compile)")
    add_common_args(p, warmup=3, steps=30, rounds=3)
    args = p.parse_args(argv)
    if args.compile and args.compare_with:
        p.error("--compile and --compare-with: the old revision's phrasal attention does not compile like for like")
    if args.steps < 1 or args.decode_sentences < 1:
        p.error("--steps and --decode-sentences must be >= 1")
    if not all(s.isdigit() and "0" not in s and list(s) == sorted(set(s)) for s in args.ngrams):
        p.error(f"--ngrams takes increasing digits 1-9 (12 = {{1,2}}), got {' '.join(args.ngrams)}")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rss: dict[str, float] = {}

    # 1. data: the same preparation (and default cache) as throughput.py; batches collated once, untimed
    work = args.work or default_work(args)
    vocab = prepared_data(args, work)
    valid_set = open_bitext(work, "valid", args.src, args.tgt)
    batches = training_batches(work, args, args.warmup + args.steps, device)
    warm, timed = batches[:args.warmup], batches[args.warmup:]
    sources = [valid_set.src[i].tolist() for i in range(min(args.decode_sentences, len(valid_set)))]
    src_batches = [collate([sources[i] for i in rows], [[]] * len(rows)).src.to(device)
                   for rows in batches_by_length([len(s) for s in sources], args.decode_max_tokens)]
    rss["after_data"] = peak_rss_mb()

    # 2. models: one config, only the attention slots differ
    sets = {"baseline": None, **{f"phrasal_{s}": [int(c) for c in s] for s in args.ngrams}}
    rev = args.compare_with and subprocess.run(["git", "rev-parse", "--short", args.compare_with], check=True,
                                               capture_output=True, text=True).stdout.strip()
    old = phrasal_class_at(rev) if rev else None
    if old is not None:
        sets.update({f"phrasal_{s}@{rev}": [int(c) for c in s] for s in args.ngrams})
    systems: dict[str, Optimiser] = {}
    for name, ngrams in sets.items():
        cfg = load_config(data={
            "model": {"name": "transformer", "preset": args.preset, "encoder_layers": args.layers,
                      "decoder_layers": args.layers, **slots(ngrams)},
            "train": {"seed": args.seed, "precision": args.precision, "label_smoothing": 0.1, "clip_norm": 1.0,
                      "compile": args.compile}})
        torch.manual_seed(args.seed)
        model = build_model(cfg.model, Vocabularies(vocab, vocab)).to(device)
        if "@" in name:  # the same weights (same seed) under the old code
            for m in model.modules():
                if isinstance(m, PhrasalAttention):
                    m.__class__ = old
        systems[name] = Optimiser(model, cfg.train)
    rss["after_build"] = peak_rss_mb()
    largest = max(timed, key=lambda b: b.src.numel() + b.tgt_in.numel())
    memory = {name: activation_mb(opt.model, largest) for name, opt in systems.items()}

    # 3. training throughput: untimed warm-up, then alternating timed blocks over the same batches
    for opt in systems.values():
        for b in warm:
            opt.step(b)
    steady_heap(device, args.heap_headroom_mb)  # as timed_training does
    seconds = dict.fromkeys(systems, 0.0)
    cuda_peak: dict[str, float] = {}
    rounds = max(1, min(args.rounds, len(timed)))
    blocks = [timed[i * len(timed) // rounds:(i + 1) * len(timed) // rounds] for i in range(rounds)]
    for block in blocks:
        for name, opt in systems.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            for b in block:
                start = time.perf_counter()
                opt.step(b)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                seconds[name] += time.perf_counter() - start
            if device.type == "cuda":
                cuda_peak[name] = max(cuda_peak.get(name, 0.0), torch.cuda.max_memory_allocated() / 2 ** 20)
    rss["after_train"] = peak_rss_mb()
    timed_tokens = sum(b.num_tgt_tokens for b in timed)

    # 4. decoding throughput: the same sentences, the systems alternating batch by batch
    caps = torch.cat([max_output_lengths(s, 1.5, 10, 1022) for s in src_batches]).tolist()
    dec_seconds = dict.fromkeys(systems, 0.0)
    outputs: dict[str, list[list[int]]] = {name: [] for name in systems}
    for opt in systems.values():
        opt.model.eval()
        decode_batch(opt.model, src_batches[0][:2], args)  # untimed warm-up
    for round_ in range(max(1, args.decode_rounds)):
        for src in src_batches:
            for name, opt in systems.items():
                t, tokens = decode_batch(opt.model, src, args)
                dec_seconds[name] += t
                if round_ == 0:
                    outputs[name] += tokens
    rss["after_decode"] = peak_rss_mb()

    # 5. report
    base = "baseline"
    result: dict[str, Any] = {
        "machine": machine_info(device, threads=torch.get_num_threads()),
        "config": {"data": args.data.name, "src": args.src, "tgt": args.tgt, "vocab_size": vocab,
                   "preset": args.preset, "layers": args.layers, "max_tokens": args.max_tokens,
                   "precision": args.precision, "compile": args.compile,
                   "warmup_batches": args.warmup, "timed_batches": len(timed), "rounds": rounds,
                   "timed_tgt_tokens": timed_tokens, "decode_sentences": len(sources), "beam": args.beam,
                   "decode_rounds": max(1, args.decode_rounds),
                   "seed": args.seed, "compare_with": rev or None},
        "peak_rss_mb_by_phase": {k: round(v, 1) for k, v in rss.items()},
    }
    for name, opt in systems.items():
        n_params = count_parameters(opt.model)
        lengths = [len(tokens) for tokens in outputs[name]]
        result[name] = {
            "ngrams": sets[name],
            "parameters": n_params,
            "train_tgt_tokens_per_s": timed_tokens / seconds[name],
            "train_seconds": seconds[name],
            "decode_sentences_per_s": len(lengths) * max(1, args.decode_rounds) / dec_seconds[name],
            "decode_seconds": dec_seconds[name],
            "decode_mean_output_len": sum(lengths) / len(lengths),
            "decode_frac_at_length_cap": sum(n >= c for n, c in zip(lengths, caps)) / len(caps),
            "params_grads_adam_mb": 4 * 4 * n_params / 2 ** 20,  # fp32 parameters, gradients, two Adam moments
            "saved_activations_mb": memory[name],
            **({"cuda_peak_train_mb": cuda_peak[name]} if name in cuda_peak else {}),
        }
    b = result[base]
    if old is not None:
        result["decode_outputs_identical_to_new_code"] = {
            name: sum(a == b for a, b in zip(outputs[name], outputs[name.split("@")[0]])) / len(sources)
            for name in systems if "@" in name}
    result["relative_to_baseline"] = {
        name: {"parameters": result[name]["parameters"] - b["parameters"],
               "train_tokens_per_s": result[name]["train_tgt_tokens_per_s"] / b["train_tgt_tokens_per_s"],
               "decode_sentences_per_s": result[name]["decode_sentences_per_s"] / b["decode_sentences_per_s"],
               "saved_activations": memory[name] / memory[base]}
        for name in systems if name != base}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")

    print(f"{'':16}{'params':>12}{'train tok/s':>13}{'decode sent/s':>15}{'activations MB':>16}{'mean len':>10}")
    for name in systems:
        r = result[name]
        print(f"{name:16}{r['parameters']:>12,}{r['train_tgt_tokens_per_s']:>13,.0f}"
              f"{r['decode_sentences_per_s']:>15,.2f}{r['saved_activations_mb']:>16,.1f}"
              f"{r['decode_mean_output_len']:>10.1f}")
    for name, rel in result["relative_to_baseline"].items():
        print(f"{name}: train x{rel['train_tokens_per_s']:.2f}, decode x{rel['decode_sentences_per_s']:.2f}, "
              f"activations x{rel['saved_activations']:.2f}, +{rel['parameters']:,} parameters")
    print(f"written to {args.out}")
    return result


if __name__ == "__main__":
    main()
