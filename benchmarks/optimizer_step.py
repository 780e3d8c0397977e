"""One Adam update over a Transformer's parameters: PyTorch's default implementation against its fused one.

Usage (see benchmarks/README.md)::

    python benchmarks/optimizer_step.py --out benchmarks/results/optimizer-step.json [--device cuda]

Builds the Transformer of ``--preset``, ``--layers`` and ``--vocab-size`` (default: the ``small`` preset, 6+6
layers, 8,000-piece joint vocabulary: the shortcut benchmarks' baseline), gives every parameter a random
gradient and times ``optimizer.step()`` with nmtflow's Adam settings under ``train.fused_optimizer: false``
(PyTorch's default: foreach on CUDA, one tensor at a time on the CPU) and ``true`` (fused), interleaved step by
step, after a warm-up. It also checks that both give the same parameters after the timed steps.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from nmtflow.config import load_config
from nmtflow.models.base import Vocabularies, build_model, count_parameters
from nmtflow.runtime import machine_info
from nmtflow.train.optim import build_optimizer
from throughput import device_option, interleaved_median_ms


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small", choices=["small", "base", "big"])
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--device", default="cpu", type=device_option)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/optimizer-step.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    runs = {}
    for name, fused in (("default", False), ("fused", True)):
        cfg = load_config(data={"model": {"name": "transformer", "preset": args.preset,
                                          "encoder_layers": args.layers, "decoder_layers": args.layers},
                                "train": {"fused_optimizer": fused}})
        torch.manual_seed(0)
        model = build_model(cfg.model, Vocabularies(args.vocab_size, args.vocab_size, joint=True)).to(device)
        params = [q for q in model.parameters() if q.requires_grad]
        for q in params:
            q.grad = torch.randn_like(q) * 1e-2
        runs[name] = (model, build_optimizer(params, cfg.train))
    assert runs["fused"][1].defaults["fused"] and not runs["default"][1].defaults["fused"]
    ms = interleaved_median_ms({name: optimizer.step for name, (_, optimizer) in runs.items()}, args.steps,
                               args.warmup, sync)
    difference = max((a - b).abs().max().item() for a, b in zip(runs["default"][0].parameters(),
                                                                  runs["fused"][0].parameters()))
    result = {"machine": machine_info(device, threads=torch.get_num_threads()),
              "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"}
              | {"torch": torch.__version__, "parameters": count_parameters(runs["fused"][0])},
              "median_step_ms": ms, "fused_speedup": ms["default"] / ms["fused"],
              "max_abs_parameter_difference": difference}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print(f"{result['config']['parameters']:,} parameters: default {ms['default']:.2f} ms, fused {ms['fused']:.2f} ms "
          f"(x{result['fused_speedup']:.2f}); largest parameter difference {difference:.2e}; written to {args.out}")
    return result


if __name__ == "__main__":
    main()
