"""Attention alone, by ``scaled_dot_product_attention`` backend and sentence length: forward + backward in ms.

Usage (see benchmarks/README.md)::

    python benchmarks/sdpa_backends.py --device cuda --out benchmarks/results/sdpa-backends.json

Transformer-base's attention (8 heads of 64) on batches of about ``--tokens`` tokens of sentences of length L
(B = tokens // L), in the two forms nmtflow's training uses: with a key padding mask (encoder self-attention and
cross-attention; each sentence's length drawn from [0.8 L, L], as in length-sorted batches) and causal without a
mask (decoder self-attention). Every backend that takes the form is timed (``auto``: PyTorch's own choice, the one
nmtflow gets), round by round in turn on the same tensors, with the given attention dropout. On Multi30k the
sentences are short (~13 tokens): ``gpu_base.py`` found the attention kernels taking 9 ms of a 61 ms
Transformer-base step, for a small share of its FLOPs.
"""
from __future__ import annotations

import argparse
import statistics
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from nmtflow.runtime import machine_info
from throughput import write_json

BACKENDS = {"auto": None, "math": SDPBackend.MATH, "efficient": SDPBackend.EFFICIENT_ATTENTION,
            "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def inputs(batch: int, length: int, heads: int, head_dim: int, padded: bool, dtype: torch.dtype,
           device: torch.device, gen: torch.Generator) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """q, k, v (B,H,L,Dh) needing gradients, and a key padding mask (B,1,1,L), True = may attend, or None."""
    qkv = [torch.randn(batch, heads, length, head_dim, generator=gen, device=device).to(dtype).requires_grad_()
           for _ in range(3)]
    if not padded:
        return qkv, None
    lengths = torch.randint(int(0.8 * length), length + 1, (batch,), generator=gen, device=device)
    mask = (torch.arange(length, device=device) < lengths[:, None])[:, None, None, :]
    return qkv, mask


def run(qkv: list[torch.Tensor], mask: torch.Tensor | None, causal: bool, dropout: float) -> None:
    out = F.scaled_dot_product_attention(*qkv, attn_mask=mask, dropout_p=dropout, is_causal=causal)
    torch.autograd.grad(out, qkv, torch.ones_like(out))


def time_backend(backend: SDPBackend | None, qkv: list[torch.Tensor], mask: torch.Tensor | None, causal: bool,
                 dropout: float, iters: int, sync) -> float | None:
    """Mean ms of one forward + backward, None if the backend does not take these inputs."""
    ctx = sdpa_kernel([backend]) if backend is not None else nullcontext()
    try:
        with ctx:
            run(qkv, mask, causal, dropout)  # the first call per shape may plan (cuDNN) or fail
            sync()
            start = time.perf_counter()
            for _ in range(iters):
                run(qkv, mask, causal, dropout)
            sync()
    except RuntimeError:
        return None
    return 1e3 * (time.perf_counter() - start) / iters


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/sdpa-backends.json"))
    p.add_argument("--lengths", type=int, nargs="+", default=[12, 16, 24, 32, 48, 64, 128, 256])
    p.add_argument("--tokens", type=int, default=16384, help="tokens per batch (B = tokens // L)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--backends", nargs="+", choices=list(BACKENDS), default=list(BACKENDS))
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    gen = torch.Generator(device=device).manual_seed(1)
    result: dict[str, Any] = {"machine": machine_info(device, threads=torch.get_num_threads()),
                              "config": {k: v for k, v in vars(args).items() if k != "out"}, "ms": {}}
    for length in args.lengths:
        batch = max(1, args.tokens // length)
        for form, padded, causal in (("padding_mask", True, False), ("causal", False, True)):
            qkv, mask = inputs(batch, length, args.heads, args.head_dim, padded, dtype, device, gen)
            times: dict[str, list[float]] = {name: [] for name in args.backends}
            for _ in range(args.rounds):
                for name in args.backends:
                    ms = time_backend(BACKENDS[name], qkv, mask, causal, args.dropout, args.iters, sync)
                    if ms is not None:
                        times[name].append(ms)
            row = {name: statistics.median(ts) for name, ts in times.items() if ts}
            result["ms"][f"L{length} {form}"] = {"batch": batch, **{k: round(v, 4) for k, v in row.items()}}
            best = min(row, key=row.get)
            print(f"L={length:4d} B={batch:5d} {form:12s} " + "  ".join(f"{k} {v:.3f}" for k, v in row.items())
                  + f"  → {best}", flush=True)
            write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
