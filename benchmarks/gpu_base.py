"""Transformer-base on a GPU: training throughput and model FLOPs utilisation, nmtflow against ``torch.nn.Transformer``.

Usage (see benchmarks/README.md)::

    python benchmarks/gpu_base.py --data data/multi30k --device cuda --precision bf16 \
        --out benchmarks/results/gpu-base.json

Both systems are Transformer-base (6+6 layers, d 512, 8 heads, FFN 2048, one 32k vocabulary shared by source,
target and the output projection), trained on the same ~25k-token batches of Multi30k EN→DE with the same loss,
optimiser, schedule and clipping (``throughput.py``'s ``Optimiser``), in alternating blocks. Reported per system:

* target tokens/s and its median step time;
* MFU as the issue defines it, ``6 · N · target tokens/s`` over the card's dense bf16 peak (N: all parameters; it
  counts the encoder's weights once per *target* token and leaves attention out), and the FLOPs that
  ``torch.utils.flop_counter`` counts in the same steps (matrix products and attention, forward and backward) over
  the measured time;
* where the time goes: one profiled pass over a few batches, kernel time by kind (matrix products, attention,
  softmax/loss, optimiser, other element-wise), kernels per step, and the share of the step's wall time the GPU
  is busy (well below 1: the step waits for the host to launch kernels).

With ``--compile`` nmtflow also runs with ``train.compile`` (regional compilation: one graph per layer class, shared
by the stack's layers, and the compiled loss; ``nmtflow/nn/compiled.py``) as a third system, provided the budget
``--compile-budget-s`` has time left after the eager systems. It first trains once, untimed, on every batch, so that
each shape class the compiler distinguishes (alignment, size thresholds) is compiled before the timed steps, as it
is after the first steps of a real training; that pass's time is reported apart.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch._dynamo.utils import counters
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from gpu_profile import kernel_times
from nmtflow.config import load_config
from nmtflow.data.batching import Batch
from nmtflow.models.base import Vocabularies, build_model, count_parameters
from nmtflow.nn import attention
from nmtflow.runtime import machine_info
from throughput import (Optimiser, ReferenceConfig, ReferenceTransformer, add_common_args, default_work,
                        prepared_data, timed_training, training_batches, write_json)

# dense (no sparsity) bf16 tensor-core peaks, FLOP/s, from the vendors' data sheets
BF16_PEAK = {"H100 PCIe": 756e12, "H100": 989.4e12, "H200": 989.4e12, "GH200": 989.4e12, "A100": 312e12,
             "L40S": 362e12, "L4": 121e12}

# first match wins: attention kernels are built on CUTLASS too ("fmha_cutlassB...", "flash_bwd<...cutlass::...>")
KINDS = (("attention", ("flash", "fmha", "attention", "attn")),
         ("matmul", ("gemm", "cutlass", "xmma", "nvjet", "cublas", "splitk")),
         ("softmax_loss", ("softmax", "log_softmax", "nll", "cross_entropy", "smoothed")),
         ("optimizer", ("multi_tensor", "adam", "foreach", "fused_adam")))


SDPA_BACKENDS = {"math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                 "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


class BackendOptimiser(Optimiser):
    """nmtflow's training step with ``scaled_dot_product_attention`` held to ``backends``, PyTorch choosing among
    them per call (flash takes no padding mask; nmtflow's own choice for short causal attention is off):
    ``flash+efficient`` is PyTorch's default choice in bf16 training, where cuDNN's backend is off."""

    def __init__(self, model: torch.nn.Module, tc: Any, backends: list[SDPBackend]) -> None:
        super().__init__(model, tc)
        self.backends = backends

    def step(self, b: Batch) -> float:
        short_causal, attention.EFFICIENT_CAUSAL_MAX_LEN = attention.EFFICIENT_CAUSAL_MAX_LEN, 0  # PyTorch chooses
        try:
            with sdpa_kernel(self.backends):
                return super().step(b)
        finally:
            attention.EFFICIENT_CAUSAL_MAX_LEN = short_causal


def peak_flops(name: str) -> float | None:
    """The dense bf16 peak of the GPU called ``name`` (the longest matching key), None if unknown."""
    hits = [key for key in BF16_PEAK if key in name]
    return BF16_PEAK[max(hits, key=len)] if hits else None


def kernel_kind(name: str) -> str:
    lower = name.lower()
    for kind, marks in KINDS:
        if any(m in lower for m in marks):
            return kind
    return "elementwise_other"


def counted_flops(opt: Optimiser, batches: list[Batch]) -> float:
    """FLOPs of training steps over ``batches`` as ``torch.utils.flop_counter`` counts them (forward + backward)."""
    with FlopCounterMode(display=False) as counter:
        for b in batches:
            opt.step(b)
    return float(counter.get_total_flops())


def where_time_goes(opt: Optimiser, batches: list[Batch], wall_ms: float) -> dict[str, Any]:
    kernels = kernel_times(opt, batches)
    by_kind: dict[str, float] = {}
    for name, (ms, _) in kernels.items():
        kind = kernel_kind(name)
        by_kind[kind] = by_kind.get(kind, 0.0) + ms
    kernel_ms = sum(by_kind.values())
    return {"kernel_ms_per_step": kernel_ms, "kernels_per_step": sum(n for _, n in kernels.values()),
            "gpu_busy_share": kernel_ms / wall_ms,
            "kernel_ms_by_kind": {k: round(v, 3) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms_per_step": {k[:90]: round(v[0], 3) for k, v in
                                        sorted(kernels.items(), key=lambda kv: -kv[1][0])[:8]}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True, help="directory with train.LANG and val.LANG")
    p.add_argument("--work", type=Path, help="prepared-data cache (default runs/bench-data-SRC-TGT-VOCAB)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu-base.json"))
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--profile-steps", type=int, default=3, help="steps profiled per system for the kernel breakdown")
    p.add_argument("--compile", action="store_true",
                   help="also nmtflow with train.compile (each layer and the loss under torch.compile)")
    p.add_argument("--compile-budget-s", type=float, default=float("inf"),
                   help="skip the compiled system unless this many seconds since the start are not yet spent")
    p.add_argument("--sdpa", nargs="*", default=[], metavar="BACKEND[+BACKEND]",
                   help="also nmtflow with attention held to these backends (e.g. math, flash+math), each a system "
                        f"nmtflow_sdpa_NAME; backends: {', '.join(SDPA_BACKENDS)}")
    add_common_args(p, warmup=5, steps=24, rounds=6)
    p.set_defaults(vocab_size=32000, max_tokens=25000, precision="bf16")
    args = p.parse_args(argv)
    started = time.perf_counter()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.set_num_threads(args.threads)

    work = args.work or default_work(args)
    vocab = prepared_data(args, work, with_valid=False)
    batches = training_batches(work, args, args.warmup + args.steps, device)
    warm, timed = batches[:args.warmup], batches[args.warmup:]
    cfg = load_config(data={
        "model": {"name": "transformer", "preset": "base", "encoder_layers": args.layers,
                  "decoder_layers": args.layers, "dropout": 0.1, "tie_embeddings": True},
        "train": {"seed": args.seed, "threads": args.threads, "label_smoothing": 0.1, "clip_norm": 1.0,
                  "precision": args.precision, "warmup_updates": 4000}})
    torch.manual_seed(args.seed)
    ours = build_model(cfg.model, Vocabularies(vocab, vocab, joint=True)).to(device)
    torch.manual_seed(args.seed)
    ref_cfg = ReferenceConfig(d_model=cfg.model.d_model, heads=cfg.model.heads, layers=args.layers,
                              ffn_dim=cfg.model.ffn_dim, dropout=cfg.model.dropout)
    systems = {"nmtflow": Optimiser(ours, cfg.train),
               "reference_nn_transformer": Optimiser(ReferenceTransformer(ref_cfg, vocab).to(device), cfg.train)}
    for spec in args.sdpa:  # copies of "nmtflow"'s untrained model
        systems[f"nmtflow_sdpa_{spec}"] = BackendOptimiser(copy.deepcopy(ours), cfg.train,
                                                           [SDPA_BACKENDS[n] for n in spec.split("+")])
    peak = peak_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    timed_tokens = sum(b.num_tgt_tokens for b in timed)
    result: dict[str, Any] = {
        "machine": machine_info(device, threads=torch.get_num_threads()),
        "config": {"data": args.data.name, "src": args.src, "tgt": args.tgt, "vocab_size": vocab,
                   "layers": args.layers, "d_model": ref_cfg.d_model, "heads": ref_cfg.heads,
                   "ffn_dim": ref_cfg.ffn_dim, "max_tokens": args.max_tokens, "precision": args.precision,
                   "warmup_batches": len(warm), "timed_batches": len(timed), "rounds": args.rounds,
                   "system_order": "rotated per round",
                   "timed_tgt_tokens": timed_tokens,
                   "timed_src_tokens": sum(int(b.src.ne(0).sum()) for b in timed),
                   "mean_tgt_tokens_per_batch": timed_tokens / len(timed)},
        "bf16_peak_flops": peak,
    }

    def measure(group: dict[str, Optimiser], flops_of: dict[str, str] | None = None) -> None:
        """Time ``group``; ``flops_of`` maps a system to one whose counted FLOPs it shares (a compiled model)."""
        seconds, losses, steps = timed_training(group, warm, timed, args.rounds, device, rotate=True)
        for name, opt in group.items():
            params = count_parameters(opt.model)
            tok_s = timed_tokens / seconds[name]
            same = (flops_of or {}).get(name)
            flops = (result[same]["counted_flops_per_tgt_token"] * timed_tokens if same
                     else counted_flops(opt, timed))
            median_ms = 1e3 * statistics.median(steps[name])
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            row: dict[str, Any] = {
                "parameters": params, "train_tgt_tokens_per_s": tok_s, "train_seconds": seconds[name],
                "median_step_ms": median_ms, "train_loss_last": losses[name][-1],
                "counted_flops_per_tgt_token": flops / timed_tokens,
                "achieved_tflops_6n": 6 * params * tok_s / 1e12,
                "achieved_tflops_counted": flops / seconds[name] / 1e12}
            if peak:
                row["mfu_6n"] = 6 * params * tok_s / peak
                row["mfu_counted"] = flops / seconds[name] / peak
            if device.type == "cuda":
                row.update(where_time_goes(opt, timed[:args.profile_steps], median_ms))
                row["peak_gpu_memory_mb"] = torch.cuda.max_memory_allocated(device) / 2**20
            result[name] = row
        sync()

    measure(systems)
    a, b = result["nmtflow"], result["reference_nn_transformer"]
    result["ratios"] = {"train_tokens_per_s": a["train_tgt_tokens_per_s"] / b["train_tgt_tokens_per_s"]}
    for spec in args.sdpa:
        result["ratios"][f"sdpa_{spec}_over_eager"] = (result[f"nmtflow_sdpa_{spec}"]["train_tgt_tokens_per_s"]
                                                       / a["train_tgt_tokens_per_s"])
    write_json(args.out, result)
    if args.compile:
        if time.perf_counter() - started < args.compile_budget_s:
            torch.manual_seed(args.seed)
            compiled = build_model(cfg.model, Vocabularies(vocab, vocab, joint=True)).to(device)
            t0 = time.perf_counter()
            opt = Optimiser(compiled, replace(cfg.train, compile=True))
            for b in batches:  # compile every shape class these batches need before any is timed
                opt.step(b)
            sync()
            compile_s = time.perf_counter() - t0
            measure({"nmtflow_compiled": opt}, flops_of={"nmtflow_compiled": "nmtflow"})
            result["nmtflow_compiled"]["compile_pass_seconds"] = compile_s
            result["nmtflow_compiled"]["graphs"] = int(counters["stats"]["unique_graphs"])
            result["nmtflow_compiled"]["compile_and_measure_seconds"] = time.perf_counter() - t0
            result["ratios"]["compiled_over_eager"] = (result["nmtflow_compiled"]["train_tgt_tokens_per_s"]
                                                       / a["train_tgt_tokens_per_s"])
        else:
            result["nmtflow_compiled"] = {"skipped": f"--compile-budget-s {args.compile_budget_s:g} spent"}
        write_json(args.out, result)
    result["seconds"] = time.perf_counter() - started
    write_json(args.out, result)
    return result



if __name__ == "__main__":
    out = main()
    for key in [k for k in out if k.startswith(("nmtflow", "reference"))]:
        if "train_tgt_tokens_per_s" in out[key]:
            r = out[key]
            print(f"{key}: {r['train_tgt_tokens_per_s']:,.0f} tgt tok/s, MFU 6N {r.get('mfu_6n', float('nan')):.1%}, "
                  f"counted {r.get('mfu_counted', float('nan')):.1%}")
