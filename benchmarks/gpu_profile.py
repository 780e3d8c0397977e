"""Where a training step's time goes on a GPU: wall time, GPU kernel time and kernel launches per step.

Usage (see benchmarks/README.md)::

    python benchmarks/gpu_profile.py --data data/multi30k --preset base --precision tf32 \
        --out benchmarks/results/gpu-profile.json

Builds the systems of ``shortcuts.py`` (baseline, shortcuts, feature-fusion), trains each on the same batches
with the same step, then times ``--steps`` steps unprofiled (wall) and profiles the same steps again (CUDA
kernel time and kernel count). When the kernel time is well below the wall time the GPU waits for the host
between kernels: the step is bound by how many operators it launches, not by their arithmetic.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from shortcuts import SYSTEMS, add_system_args, build_systems
from throughput import Optimiser, add_common_args, default_work, prepared_data, training_batches


def step_profile(opt: Optimiser, batches: list, top: int) -> dict[str, Any]:
    """Wall ms per step (unprofiled), then kernel ms and kernels per step (profiled) over the same batches."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for b in batches:
        opt.step(b)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / len(batches)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for b in batches:
            opt.step(b)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    kernel_s = sum(e.self_device_time_total for e in kernels) / 1e6 / len(batches)
    heaviest = sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]
    return {"wall_ms_per_step": 1e3 * wall, "kernel_ms_per_step": 1e3 * kernel_s,
            "kernels_per_step": sum(e.count for e in kernels) / len(batches), "gpu_busy_share": kernel_s / wall,
            "top_kernels_ms_per_step": {e.key[:80]: e.self_device_time_total / 1e3 / len(batches) for e in heaviest}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_system_args(p, preset="base")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/gpu-profile.json"))
    p.add_argument("--top", type=int, default=8, help="heaviest kernels listed per system")
    add_common_args(p, warmup=5, steps=5, rounds=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device")
    device = torch.device("cuda")
    work = args.work or default_work(args)
    vocab = prepared_data(args, work)
    batches = training_batches(work, args, args.warmup + args.steps, device)
    result: dict[str, Any] = {"config": {"preset": args.preset, "layers": args.layers, "precision": args.precision,
                                         "max_tokens": args.max_tokens, "vocab_size": vocab, "steps": args.steps,
                                         "torch": torch.__version__, "gpu": torch.cuda.get_device_name()}}
    for name, opt in build_systems(args, vocab, device).items():
        for b in batches[:args.warmup]:
            opt.step(b)
        result[name] = step_profile(opt, batches[args.warmup:], args.top)
    for name in SYSTEMS:
        r = result[name]
        print(f"{name:16} wall {r['wall_ms_per_step']:7.1f} ms/step  kernels {r['kernel_ms_per_step']:7.1f} ms/step "
              f"({100 * r['gpu_busy_share']:.0f}% busy), {r['kernels_per_step']:,.0f} kernels/step")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
