"""Where a training step's time goes on a GPU: wall time, GPU kernel time and kernel launches per step.

Usage (see benchmarks/README.md)::

    python benchmarks/gpu_profile.py --data data/multi30k --preset base --precision tf32 \
        --out benchmarks/results/gpu-profile.json

Builds the systems of ``shortcuts.py`` (baseline, shortcuts, feature-fusion), trains them on the same batches
with the same step, interleaved batch by batch, and takes the median wall time of ``--steps`` steps
(unprofiled); then profiles the same steps again per system (CUDA kernel time and kernel count, and which
kernels add GPU time against the baseline). When the kernel time is well below the wall time the GPU waits
for the host between kernels: the step is bound by how many operators it launches, not by their arithmetic.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from nmtflow.runtime import machine_info
from shortcuts import SYSTEMS, add_system_args, build_systems
from throughput import Optimiser, add_common_args, default_work, prepared_data, timed_training, training_batches


def kernel_times(opt: Optimiser, batches: list) -> dict[str, list[float]]:
    """Profile ``opt`` over ``batches``: per kernel name, [ms per step, launches per step].

    Only kernels, copies and memsets: the GPU-side spans of annotated regions (``Optimizer.step#Adam.step``)
    also come with CUDA as their device and would count their kernels twice.
    """
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for b in batches:
            opt.step(b)
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for e in prof.events():
        if e.device_type.name == "CUDA" and not getattr(e, "is_user_annotation", False):
            row = kernels.setdefault(e.name, [0.0, 0.0])
            row[0] += e.device_time / 1e3 / len(batches)
            row[1] += 1 / len(batches)
    return kernels


def summary(wall_ms: float, kernels: dict[str, list[float]], top: int,
            baseline: dict[str, list[float]] | None) -> dict[str, Any]:
    kernel_ms = sum(ms for ms, _ in kernels.values())
    out: dict[str, Any] = {
        "wall_ms_per_step": wall_ms, "kernel_ms_per_step": kernel_ms,
        "kernels_per_step": sum(n for _, n in kernels.values()), "gpu_busy_share": kernel_ms / wall_ms,
        "top_kernels_ms_per_step": {k[:80]: round(v[0], 4) for k, v in
                                    sorted(kernels.items(), key=lambda kv: -kv[1][0])[:top]}}
    if baseline is not None:  # where the extra GPU time goes: kernel names by their added ms per step
        names = set(kernels) | set(baseline)
        extra = {k: kernels.get(k, [0.0, 0.0])[0] - baseline.get(k, [0.0, 0.0])[0] for k in names}
        out["kernel_ms_vs_baseline"] = kernel_ms - sum(ms for ms, _ in baseline.values())
        out["top_extra_kernels_ms_per_step"] = {k[:80]: round(v, 4) for k, v in
                                                sorted(extra.items(), key=lambda kv: -kv[1])[:top]}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_system_args(p, preset="base")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu-profile.json"))
    p.add_argument("--top", type=int, default=8, help="heaviest kernels listed per system")
    add_common_args(p, warmup=5, steps=5, rounds=None)
    p.set_defaults(device="cuda")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    device = torch.device(args.device)
    if device.type != "cuda":
        p.error(f"--device {args.device}: profiles CUDA kernels, give cuda or cuda:N")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    torch.set_num_threads(args.threads)
    torch.cuda.set_device(device)  # cuda:N, not the first GPU
    work = args.work or default_work(args)
    vocab = prepared_data(args, work)
    batches = training_batches(work, args, args.warmup + args.steps, device)
    result: dict[str, Any] = {"machine": machine_info(device, threads=torch.get_num_threads()),
                              "config": {"preset": args.preset, "layers": args.layers, "precision": args.precision,
                                         "max_tokens": args.max_tokens, "vocab_size": vocab, "steps": args.steps,
                                         "threads": torch.get_num_threads(),
                                         "torch": torch.__version__, "gpu": torch.cuda.get_device_name(device)}}
    systems = build_systems(args, vocab, device)
    warm, timed = batches[:args.warmup], batches[args.warmup:]
    _, _, steps = timed_training(systems, warm, timed, args.rounds or len(timed), device)  # default: batch by batch
    wall = {name: 1e3 * statistics.median(t) for name, t in steps.items()}
    kernels = {name: kernel_times(opt, timed) for name, opt in systems.items()}
    for name in SYSTEMS:
        result[name] = summary(wall[name], kernels[name], args.top, None if name == "baseline" else kernels["baseline"])
    for name in SYSTEMS:
        r = result[name]
        print(f"{name:16} wall {r['wall_ms_per_step']:7.1f} ms/step  kernels {r['kernel_ms_per_step']:7.1f} ms/step "
              f"({100 * r['gpu_busy_share']:.0f}% busy), {r['kernels_per_step']:,.0f} kernels/step")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
