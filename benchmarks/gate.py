"""The lexical-shortcut gate alone (SPEC §2, Eq. 9-12): forward + backward over keys and values, on the CPU.

Usage (see benchmarks/README.md)::

    python benchmarks/gate.py --out benchmarks/results/gate.json [--compile]

Times, for one attention sub-layer's keys and values (N tokens × d features), ``PairGate`` (nmtflow's
hand-written autograd node), the same equations as a chain of autograd operators, and with ``--compile`` that
chain compiled by ``torch.compile`` (needs a C++ compiler), interleaved call by call. It also reports the
least memory traffic any implementation needs, read X_sc, X and the output gradients (``6·N·d`` floats) and
write K', V' and the two input gradients (as many), timed as a plain copy of ``6·N·d`` floats, which moves the
same bytes.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from nmtflow.nn.shortcuts import PairGate
from nmtflow.runtime import keep_freed_memory, machine_info
from throughput import interleaved_median_ms


def gate_in_operators(shortcut: Tensor, hidden: Tensor, bias: Tensor) -> tuple[Tensor, Tensor]:
    """Eq. 9-12 in autograd operators: r = σ(X_sc + X + b), X' = X + r (X_sc − X)."""
    r = torch.sigmoid(shortcut + hidden + bias)
    y = hidden + r * (shortcut - hidden)
    return y[:, 0], y[:, 1]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--compile", action="store_true", help="also time the operator chain under torch.compile")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/gate.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    torch.manual_seed(0)
    n, d = args.tokens, args.d_model
    shortcut, hidden = (torch.randn(n, 2, d, requires_grad=True) for _ in range(2))
    bias = torch.zeros(2, d, requires_grad=True)
    grads = [torch.randn(n, d), torch.randn(n, d)]
    inputs = (shortcut, hidden, bias)

    def timed(gate: Callable[..., tuple[Tensor, Tensor]]) -> Callable[[], None]:
        def step() -> None:
            torch.autograd.grad(gate(*inputs), inputs, grads)  # no accumulation into .grad
        return step

    cases = {"pair_gate": timed(PairGate.apply), "operators": timed(gate_in_operators)}
    if args.compile:
        cases["operators_compiled"] = timed(torch.compile(gate_in_operators, dynamic=False))
    source = torch.randn(6 * n * d)
    cases["copy_of_least_traffic"] = lambda: source.clone()  # reads 6·N·d floats and writes as many
    ms = interleaved_median_ms(cases, args.repeats)  # the warm-up compiles too
    floor_mib = 12 * n * d * 4 / 2 ** 20
    result = {"machine": machine_info("cpu", threads=torch.get_num_threads()),
              "config": {"tokens": n, "d_model": d, "threads": torch.get_num_threads(), "repeats": args.repeats,
                         "torch": torch.__version__},
              "median_ms": ms, "least_traffic_mib": floor_mib,
              "copy_gib_per_s": floor_mib / 1024 / (ms["copy_of_least_traffic"] / 1e3),
              "gate_vs_least_traffic": {name: value / ms["copy_of_least_traffic"] for name, value in ms.items()}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    for name, value in ms.items():
        print(f"{name:24}{value:8.2f} ms")
    print(f"least traffic {floor_mib:.0f} MiB, copied at {result['copy_gib_per_s']:.1f} GiB/s; written to {args.out}")
    return result


if __name__ == "__main__":
    main()
