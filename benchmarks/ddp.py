"""Data-parallel scaling: training target tokens/s of 1 process against N processes (DDP), same effective batch.

Usage (see benchmarks/README.md)::

    python benchmarks/ddp.py --out benchmarks/results/ddp.json                      # CPU, gloo, 1 vs 2 processes
    python benchmarks/ddp.py --data DIR --src en --tgt de                            # e.g. Multi30k
    python benchmarks/ddp.py --device cuda                                           # nccl; as many GPUs as there are

Every configuration trains the same model on the same data with the same effective batch: ``--batches-per-update``
token batches per update, i.e. one process with ``update_freq`` = that number and N processes with
``update_freq`` = that number / N (the sampler shards the batches, so the N ranks of an update see what the single
process accumulates). Each rank is started with ``torch.multiprocessing`` and the torchrun environment variables
and builds the ordinary :class:`~nmtflow.train.trainer.Trainer` (gloo on CPU, nccl on CUDA); the timed loop is
``Trainer.train_step`` (forward, backward with DDP's gradient all-reduce, clipping, Adam) on batches collated
before timing, between two barriers. On CPU the cores are shared out: ``--threads`` per process defaults to
(CPU cores ÷ N). Configurations run in ``--rounds`` alternating rounds (1, N, 1, N, ...) so that background load
hits them alike. On CUDA, N processes need N GPUs: a configuration with more processes than GPUs is skipped.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepared(args: argparse.Namespace) -> Path:
    """The prepared directory (cached in ``--work``); the synthetic corpus unless ``--data`` is given."""
    from nmtflow.data.prepare import prepare
    from throughput import prepare_once  # the sibling benchmark's cache check

    work = args.work or Path(f"runs/bench-ddp-{args.src}-{args.tgt}")

    def make() -> None:
        raw = args.data
        if raw is None:
            from nmtflow.data.synthetic import generate_corpus

            raw = work.parent / f"{work.name}-raw"
            generate_corpus(raw, langs=(args.src, args.tgt), n_train=args.n_train, n_valid=10, n_test=1,
                            seed=args.seed)
        prepare({"train": str(raw / "train")}, [args.src, args.tgt], work, vocab_size=args.vocab_size, joint=True,
                progress=False)

    prepare_once(work, [args.src, args.tgt], make)
    return work


def worker(rank: int, world: int, port: int, args: argparse.Namespace, data: str, result: str) -> None:
    """One rank: build the Trainer, warm up, then time ``--steps`` updates between barriers."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    logging.basicConfig(level=logging.WARNING)
    from nmtflow.config import load_config
    from nmtflow.models.base import count_parameters
    from nmtflow.train import distributed
    from nmtflow.train.trainer import Trainer

    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    with tempfile.TemporaryDirectory() as save_dir:
        config = load_config(data={
            "model": {"name": "transformer", "preset": args.preset, "encoder_layers": args.layers,
                      "decoder_layers": args.layers},
            "data": {"path": data, "src_lang": args.src, "tgt_lang": args.tgt, "max_tokens": args.max_tokens,
                     "valid_split": ""},
            "train": {"save_dir": save_dir, "seed": args.seed, "threads": threads, "device": args.device,
                      "update_freq": args.batches_per_update // world, "lr": 1e-3, "warmup_updates": 1000,
                      "precision": args.precision, "progress": False}})
        torch.manual_seed(args.seed)
        trainer = Trainer(config, resume=False)
        stream = trainer.batches()
        updates = [[next(stream)[2] for _ in range(trainer.config.train.update_freq)]
                   for _ in range(args.warmup + args.steps)]
        sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
        for group in updates[:args.warmup]:
            trainer.train_step(group)
        sync()
        distributed.barrier()
        start = time.perf_counter()
        tokens, loss = 0, None
        for group in updates[args.warmup:]:
            stats = trainer.train_step(group)  # tokens: the whole update's, over all ranks
            tokens += int(stats["tokens"])
            loss = stats["loss"]
        sync()
        distributed.barrier()
        seconds = time.perf_counter() - start
        if rank == 0:
            Path(result).write_text(json.dumps({
                "processes": world, "threads_per_process": threads, "update_freq": trainer.config.train.update_freq,
                "device": str(trainer.device), "backend": ("nccl" if trainer.device.type == "cuda" else "gloo")
                if world > 1 else None, "parameters": count_parameters(trainer.model), "updates": args.steps,
                "tgt_tokens": tokens, "seconds": seconds, "train_tgt_tokens_per_s": tokens / max(seconds, 1e-9),
                "last_loss": loss}), encoding="utf-8")
        if trainer.dist.enabled:
            distributed.cleanup()


def run(world: int, args: argparse.Namespace, data: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        mp.spawn(worker, args=(world, free_port(), args, str(data), str(result)), nprocs=world, join=True)
        return json.loads(result.read_text(encoding="utf-8"))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, help="raw directory with train.SRC/train.TGT (default: the synthetic corpus)")
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--work", type=Path, help="prepared-data cache (default runs/bench-ddp-SRC-TGT)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/ddp.json"))
    p.add_argument("--n-train", type=int, default=20000, help="synthetic corpus size (without --data)")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--device", default="cpu", help="cpu (gloo) | cuda (nccl, one GPU per process)")
    p.add_argument("--procs", type=int, nargs="+", help="process counts (default: 1 2 on CPU; 1..GPUs on CUDA)")
    p.add_argument("--batches-per-update", type=int, help="effective batch in token batches (default: max --procs)")
    p.add_argument("--threads", type=int, help="torch threads per process (default: CPU cores ÷ processes)")
    p.add_argument("--preset", default="small")
    p.add_argument("--layers", type=int, default=3, help="encoder and decoder layers")
    p.add_argument("--max-tokens", type=int, default=2048, help="tokens per batch (one batch per rank and step)")
    p.add_argument("--precision", nargs="+", default=["fp32"],
                   help="fp32 | bf16 | fp16 (CUDA); several: every process count in each, alternating")
    p.add_argument("--warmup", type=int, default=2, help="untimed updates")
    p.add_argument("--steps", type=int, default=12, help="timed updates per round")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds over the configurations")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)

    cuda = args.device.startswith("cuda")
    gpus = torch.cuda.device_count() if cuda else 0
    if cuda and gpus == 0:
        raise SystemExit("--device cuda: no GPU visible")
    procs = sorted(set(args.procs or ([1, 2] if not cuda else list(range(1, gpus + 1)))))
    skipped = {n: f"{n} processes need {n} GPUs, {gpus} visible" for n in procs if cuda and n > gpus}
    procs = [n for n in procs if n not in skipped]
    args.batches_per_update = args.batches_per_update or max(procs)
    bad = [n for n in procs if args.batches_per_update % n]
    if bad:
        raise SystemExit(f"--batches-per-update {args.batches_per_update} is not divisible by {bad}")
    data = prepared(args)

    precisions = args.precision
    # one precision: runs keyed by the process count, as before; several: "N-PRECISION"
    configs = {(str(n) if len(precisions) == 1 else f"{n}-{prec}"): (n, prec) for prec in precisions for n in procs}
    rounds: dict[str, list[dict[str, Any]]] = {key: [] for key in configs}
    for r in range(args.rounds):
        for key, (n, prec) in configs.items():
            res = run(n, argparse.Namespace(**{**vars(args), "precision": prec}), data)
            rounds[key].append({**res, "precision": prec})
            print(f"round {r + 1}: {n} process(es), {prec}: {res['train_tgt_tokens_per_s']:.0f} tgt tok/s", flush=True)
    runs = {}
    for key, rs in rounds.items():
        speeds = [x["train_tgt_tokens_per_s"] for x in rs]
        runs[key] = {**{k: v for k, v in rs[-1].items() if k not in ("seconds", "tgt_tokens", "last_loss",
                                                                    "train_tgt_tokens_per_s")},
                     "train_tgt_tokens_per_s": statistics.median(speeds), "per_round_tgt_tokens_per_s": speeds,
                     "tgt_tokens_per_round": rs[-1]["tgt_tokens"], "last_loss": rs[-1]["last_loss"]}
    first = next(iter(configs))  # the first precision's first process count
    base = runs[first]["train_tgt_tokens_per_s"]
    from nmtflow.runtime import machine_info
    report = {
        "machine": machine_info(args.device, gpus=gpus),
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "runs": runs,
        "skipped": {str(n): why for n, why in skipped.items()},
        "speedup_over_1_process": {key: r["train_tgt_tokens_per_s"] / max(base, 1e-9) for key, r in runs.items()}
        if procs[0] == 1 else {},
    }
    if len(precisions) > 1:
        report["speedup_over_1_process_note"] = f"over {first}: 1 process in {precisions[0]}"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    print(f"{'processes':<10}{'threads':>8}{'update_freq':>12}{'tgt tok/s':>12}{'speedup':>9}")
    for n, r in runs.items():
        speedup = report["speedup_over_1_process"].get(n)
        print(f"{n:<10}{r['threads_per_process']:>8}{r['update_freq']:>12}{r['train_tgt_tokens_per_s']:>12.0f}"
              f"{'' if speedup is None else f'{speedup:>9.2f}'}")
    for n, why in skipped.items():
        print(f"{n} processes skipped: {why}")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
