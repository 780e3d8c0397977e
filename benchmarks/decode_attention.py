"""The attention of one decoding step on the CPU, by path: microseconds per call (issue 26).

Usage (see benchmarks/README.md)::

    python benchmarks/decode_attention.py --out benchmarks/results/decode-attention.json

An incremental decoding step attends from one query per row: q (B,H,1,Dh) over keys and values (B,H,S,Dh), with a
key padding mask (B,1,1,S) as in cross-attention (about a tenth of the keys masked). Timed, round by round in turn
on the same tensors, without gradients: PyTorch's fused kernel in fp32 (``fused_fp32``: fp32 decoding) and in bf16
(``fused_bf16``: the bf16 decoding copy as before), and :func:`nmtflow.nn.attention.single_query_attention` on the
bf16 tensors (``single_query_bf16``: the copy now where nmtflow chooses it, on x86 CPUs with AVX-512 BF16 and no
AMX). Each shape at every ``--threads`` count; also the largest difference of each bf16 path from fp32 attention
of the same bf16 inputs.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from nmtflow.nn.attention import single_query_attention, single_query_products
from nmtflow.runtime import keep_freed_memory, machine_info
from throughput import write_json

SHAPES = ((320, 4, 10), (320, 4, 20), (320, 4, 40), (80, 4, 15), (320, 8, 20))  # (B·beam rows, heads, keys)


def timed(fn: Callable[[], Any], calls: int) -> float:
    """Microseconds per call of ``fn`` over ``calls`` calls."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def measure(rows: int, heads: int, keys: int, head_dim: int, calls: int, rounds: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(rows, heads, n, head_dim, generator=gen) for n in (1, keys, keys))
    mask = torch.rand(rows, 1, 1, keys, generator=gen) > 0.1
    mask[..., 0] = True
    qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
    paths = {"fused_fp32": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask),
             "fused_bf16": lambda: F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask),
             "single_query_bf16": lambda: single_query_attention(qb, kb, vb, mask)}
    times: dict[str, list[float]] = {name: [] for name in paths}
    with torch.inference_mode():
        for fn in paths.values():
            timed(fn, 10)
        for _ in range(rounds):
            for name, fn in paths.items():
                times[name].append(timed(fn, calls))
        reference = F.scaled_dot_product_attention(qb.float(), kb.float(), vb.float(), attn_mask=mask)
        errors = {name: float((paths[name]().float() - reference).abs().max())
                  for name in ("fused_bf16", "single_query_bf16")}
    us = {name: statistics.median(t) for name, t in times.items()}
    return {"rows": rows, "heads": heads, "keys": keys, "head_dim": head_dim, "microseconds": us,
            "fused_bf16_over_fused_fp32": us["fused_bf16"] / us["fused_fp32"],
            "fused_bf16_over_single_query_bf16": us["fused_bf16"] / us["single_query_bf16"],
            "max_abs_error_vs_fp32_of_bf16_inputs": errors}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--calls", type=int, default=300, help="calls per timed block")
    parser.add_argument("--rounds", type=int, default=3, help="timed blocks per path (the median is reported)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/decode-attention.json"))
    args = parser.parse_args(argv)
    keep_freed_memory()
    result: dict[str, Any] = {"machine": machine_info("cpu"), "single_query_by_default": single_query_products(),
                              "config": {"head_dim": args.head_dim, "calls": args.calls, "rounds": args.rounds},
                              "runs": []}
    for threads in args.threads:
        torch.set_num_threads(threads)
        for rows, heads, keys in SHAPES:
            run = {"threads": threads, **measure(rows, heads, keys, args.head_dim, args.calls, args.rounds)}
            result["runs"].append(run)
            us = run["microseconds"]
            print(f"threads {threads}, {rows} rows × {heads} heads, {keys} keys: "
                  f"fused fp32 {us['fused_fp32']:.0f} µs, fused bf16 {us['fused_bf16']:.0f}, "
                  f"single-query bf16 {us['single_query_bf16']:.0f}")
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
