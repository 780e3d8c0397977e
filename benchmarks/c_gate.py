"""Would a single-pass C shortcut gate make CPU training faster? An experiment, not a code path of nmtflow.

Usage (see benchmarks/README.md; needs gcc and glibc on Linux; expf vectorises on x86-64)::

    python benchmarks/c_gate.py --data data/multi30k --out benchmarks/results/c-gate.json

On the CPU the gate of lexical shortcuts (SPEC §2, Eq. 9-12) runs as PyTorch element-wise operators, which
move about five times the bytes a single pass needs (``gate.py``). This script compiles the gate as one C loop
per direction (OpenMP on PyTorch's own thread pool, ``expf`` from glibc's vector math library; the backward
recomputes r from X_sc and X), checks it against nmtflow's ``PairGate``/``FusedGate``, then times

1. the gate alone: keys and values of one sub-layer, forward + backward, C against ``PairGate``;
2. training steps of the baseline and of shortcuts and feature-fusion with either gate, all five systems in one
   process on the same batches, interleaved batch by batch (``throughput.timed_training``), the C and the
   operator twin of a variant built from the same seed.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor

from nmtflow.config import load_config
from nmtflow.nn import shortcuts
from nmtflow.runtime import keep_freed_memory, machine_info
from shortcuts import add_system_args, build_systems
from throughput import (add_common_args, default_work, interleaved_median_ms, prepared_data, slowdown_interval,
                        timed_training, training_batches)

SOURCE = r"""
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>
#if defined(__x86_64__)
#pragma omp declare simd notinbranch
float expf(float); /* glibc's libmvec has SIMD variants: the loops below vectorise through them */
#endif

static inline float gate_r(float s, float x, float b) { return 1.0f / (1.0f + expf(-(s + x + b))); }

/* X_sc, X: rows of [keys ; values] (row strides s0/h0, k|v strides s1/h1, unit stride along d) */
void gate_forward(const float *sc, const float *h, const float *b, float *k, float *v, int64_t rows, int64_t d,
                  int64_t s0, int64_t s1, int64_t h0, int64_t h1, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t n = 0; n < rows; ++n)
    for (int i = 0; i < 2; ++i) {
      const float *s = sc + n * s0 + i * s1, *x = h + n * h0 + i * h1, *bi = b + i * d;
      float *o = (i == 0 ? k : v) + n * d;
#pragma omp simd
      for (int64_t c = 0; c < d; ++c) o[c] = x[c] + gate_r(s[c], x[c], bi[c]) * (s[c] - x[c]);
    }
}

/* p = g (X_sc - X) r (1 - r): dX_sc = g r + p, dX = g (1 - r) + p, db = sum of p (per-thread partial sums) */
void gate_backward(const float *gk, const float *gv, const float *sc, const float *h, const float *b, float *dsc,
                   float *dh, float *db, float *partial, int64_t rows, int64_t d, int64_t s0, int64_t s1,
                   int64_t h0, int64_t h1, int64_t ds0, int64_t ds1, int64_t dh0, int64_t dh1, int threads) {
  memset(partial, 0, sizeof(float) * (size_t)threads * 2 * d);
#pragma omp parallel num_threads(threads)
  {
    float *acc = partial + (int64_t)omp_get_thread_num() * 2 * d;
#pragma omp for schedule(static)
    for (int64_t n = 0; n < rows; ++n)
      for (int i = 0; i < 2; ++i) {
        const float *s = sc + n * s0 + i * s1, *x = h + n * h0 + i * h1, *bi = b + i * d;
        const float *g = (i == 0 ? gk : gv) + n * d;
        float *a = dsc + n * ds0 + i * ds1, *e = dh + n * dh0 + i * dh1, *q = acc + i * d;
#pragma omp simd
        for (int64_t c = 0; c < d; ++c) {
          float r = gate_r(s[c], x[c], bi[c]), p = g[c] * (s[c] - x[c]) * r * (1.0f - r);
          a[c] = g[c] * r + p;
          e[c] = g[c] - g[c] * r + p;
          q[c] += p;
        }
      }
  }
  memset(db, 0, sizeof(float) * 2 * d);
  for (int t = 0; t < threads; ++t)
    for (int64_t c = 0; c < 2 * d; ++c) db[c] += partial[(int64_t)t * 2 * d + c];
}
"""


def build(directory: Path) -> ctypes.CDLL:
    """gcc → a shared library; -fopenmp links libgomp.so.1, which resolves to the one PyTorch has loaded."""
    if shutil.which("gcc") is None:
        raise SystemExit("c_gate.py compiles its gate with gcc, which is not on the PATH")
    source, library = directory / "gate.c", directory / "gate.so"
    source.write_text(SOURCE)
    libs = ["-lmvec", "-lm"] if platform.machine() == "x86_64" else ["-lm"]
    subprocess.run(["gcc", "-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", str(source), "-o", str(library),
                    *libs], check=True)
    lib = ctypes.CDLL(str(library))
    lib.gate_forward.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 6 + [ctypes.c_int]
    lib.gate_backward.argtypes = [ctypes.c_void_p] * 9 + [ctypes.c_int64] * 10 + [ctypes.c_int]
    return lib


def c_gates(lib: ctypes.CDLL) -> tuple[type, type]:
    """Drop-in replacements of ``shortcuts.PairGate`` and ``shortcuts.FusedGate`` (float32, CPU)."""
    def forward(sc: Tensor, h: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        n, _, d = sc.shape
        k, v = sc.new_empty(n, d), sc.new_empty(n, d)
        lib.gate_forward(sc.data_ptr(), h.data_ptr(), b.data_ptr(), k.data_ptr(), v.data_ptr(), n, d,
                         *sc.stride()[:2], *h.stride()[:2], torch.get_num_threads())
        return k, v

    def backward(dk: Tensor, dv: Tensor, sc: Tensor, h: Tensor, b: Tensor, dsc: Tensor, dh: Tensor) -> Tensor:
        n, _, d = sc.shape
        dk, dv, threads = dk.contiguous(), dv.contiguous(), torch.get_num_threads()
        db, partial = b.new_empty(2, d), b.new_empty(threads, 2, d)
        lib.gate_backward(dk.data_ptr(), dv.data_ptr(), sc.data_ptr(), h.data_ptr(), b.data_ptr(), dsc.data_ptr(),
                          dh.data_ptr(), db.data_ptr(), partial.data_ptr(), n, d, *sc.stride()[:2], *h.stride()[:2],
                          *dsc.stride()[:2], *dh.stride()[:2], threads)
        return db

    class CPairGate(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, sc: Tensor, h: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
            b = b.contiguous()
            ctx.save_for_backward(sc, h, b)
            return forward(sc, h, b)

        @staticmethod
        def backward(ctx: Any, dk: Tensor, dv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
            sc, h, b = ctx.saved_tensors
            dsc, dh = torch.empty(sc.shape), torch.empty(h.shape)
            return dsc, dh, backward(dk, dv, sc, h, b, dsc, dh)

    class CFusedGate(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, y: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
            b = b.contiguous()
            ctx.save_for_backward(y, b)
            return forward(y[:, :, 0], y[:, :, 1], b)

        @staticmethod
        def backward(ctx: Any, dk: Tensor, dv: Tensor) -> tuple[Tensor, Tensor]:
            y, b = ctx.saved_tensors
            dy = torch.empty(y.shape)
            return dy, backward(dk, dv, y[:, :, 0], y[:, :, 1], b, dy[:, :, 0], dy[:, :, 1])

    return CPairGate, CFusedGate


def gate_checks_and_times(gates: dict[str, tuple[type, type]], n: int, d: int, repeats: int) -> dict[str, Any]:
    """Largest differences from nmtflow's gates (values and gradients), and median ms of the gate alone."""
    torch.manual_seed(0)
    y, bias, up = torch.randn(n, 2, 2, d) * 3, torch.randn(2, d), torch.randn(2, n, d)

    def run(pair: type, fused: type, which: str) -> list[Tensor]:
        yy, b = y.clone().requires_grad_(), bias.clone().requires_grad_()
        k, v = fused.apply(yy, b) if which == "fused" else pair.apply(yy[:, :, 0], yy[:, :, 1], b)
        return [k, v, *torch.autograd.grad((k * up[0]).sum() + (v * up[1]).sum(), [yy, b])]

    diffs = {which: max((a - b).abs().max().item() for a, b in zip(run(*gates["c"], which),
                                                                      run(*gates["operators"], which)))
             for which in ("pair", "fused")}
    sc, h = (torch.randn(n, 2, d, requires_grad=True) for _ in range(2))
    b = torch.zeros(2, d, requires_grad=True)
    grads = [torch.randn(n, d), torch.randn(n, d)]
    cases: dict[str, Callable[[], Any]] = {
        name: (lambda pair=pair: torch.autograd.grad(pair.apply(sc, h, b), (sc, h, b), grads))
        for name, (pair, _) in gates.items()}
    return {"max_abs_difference": diffs, "gate_median_ms": interleaved_median_ms(cases, repeats)}


class WithGate:
    """A system's training step with the given gate classes put in place first."""

    def __init__(self, opt: Any, gates: tuple[type, type]) -> None:
        self.opt, self.gates = opt, gates

    def step(self, batch: Any) -> float:
        shortcuts.PairGate, shortcuts.FusedGate = self.gates
        return self.opt.step(batch)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_system_args(p, preset="small")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/c-gate.json"))
    p.add_argument("--gate-tokens", type=int, default=4096)
    p.add_argument("--gate-repeats", type=int, default=50)
    add_common_args(p, warmup=3, steps=30, rounds=None, heap_headroom_mb=2048)
    args = p.parse_args(argv)
    if torch.device(args.device).type != "cpu":
        p.error("the C gate runs on the CPU only: leave --device at cpu")
    if args.steps < 1:
        p.error("--steps must be >= 1")
    args.rounds = args.rounds or args.steps  # default: interleaved batch by batch, as shortcuts.py
    torch.set_num_threads(args.threads)
    keep_freed_memory()
    device = torch.device("cpu")
    with tempfile.TemporaryDirectory() as tmp:
        lib = build(Path(tmp))
    gates = {"c": c_gates(lib), "operators": (shortcuts.PairGate, shortcuts.FusedGate)}
    d = load_config(data={"model": {"name": "transformer", "preset": args.preset}}).model.d_model
    settings = {k: v for k, v in vars(args).items() if k not in ("data", "work", "out")}  # no local paths
    result: dict[str, Any] = {"machine": machine_info(device, threads=torch.get_num_threads()),
                              "config": {"data": args.data.name, **settings, "torch": torch.__version__,
                                         "threads": torch.get_num_threads()},
                              **gate_checks_and_times(gates, args.gate_tokens, d, args.gate_repeats)}
    vocab = prepared_data(args, work := (args.work or default_work(args)))
    batches = training_batches(work, args, args.warmup + args.steps, device)
    first, twins = build_systems(args, vocab, device), build_systems(args, vocab, device)  # same seed, same weights
    systems: dict[str, Any] = {"baseline": WithGate(first["baseline"], gates["operators"])}
    for variant in ("shortcuts", "feature_fusion"):
        systems[f"{variant}/c"] = WithGate(first[variant], gates["c"])
        systems[f"{variant}/operators"] = WithGate(twins[variant], gates["operators"])
    seconds, _, steps = timed_training(systems, batches[:args.warmup], batches[args.warmup:], args.rounds, device,
                                       args.heap_headroom_mb)
    result["slowdown_vs_baseline_pct"] = {
        name: {"point": 100 * (1 - seconds["baseline"] / seconds[name]),
               "ci95": list(slowdown_interval(steps, name, "baseline"))} for name in systems if name != "baseline"}
    result["c_gate_step_time_saving_pct"] = {  # 100 (1 − C / operators) over the same batches, with its interval
        variant: {"point": 100 * (1 - seconds[f"{variant}/c"] / seconds[f"{variant}/operators"]),
                  "ci95": list(slowdown_interval(steps, f"{variant}/operators", f"{variant}/c"))}
        for variant in ("shortcuts", "feature_fusion")}
    shortcuts.PairGate, shortcuts.FusedGate = gates["operators"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=1))
    return result


if __name__ == "__main__":
    main()
