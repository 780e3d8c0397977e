"""``nmtflow serve`` under load: requests per second and latency at 1, 4 and 16 concurrent clients.

Usage (see benchmarks/README.md)::

    python benchmarks/serve_load.py [--checkpoint CKPT] --out benchmarks/results/serve-load.json

The server is started as ``nmtflow serve`` in a child process on 127.0.0.1 (a free port) with ``--checkpoint``, or
without one with a tiny Transformer trained here for a few updates on the built-in corpus (in ``--work``). For each
client count, that many threads send ``/api/translate`` requests of ``--sentences`` sentences each (beam 5, the
same sentences for every level) until ``--requests`` requests are answered or ``--seconds`` have passed; the
result has requests/s and sentences/s, latency p50/p90/p99 (ms), the server's peak resident memory (Linux: its
``VmHWM``) and the machine. Only the loopback interface is used; the server is stopped at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from nmtflow.runtime import machine_info  # noqa: E402
from throughput import write_json  # noqa: E402


def tiny_checkpoint(work: Path) -> Path:
    """A 2+2-layer d=64 Transformer trained 20 updates on the built-in en-de corpus (made once in ``work``)."""
    from nmtflow.config import load_config
    from nmtflow.data.prepare import prepare
    from nmtflow.data.synthetic import generate_corpus
    from nmtflow.train.trainer import Trainer

    ckpt = work / "model" / "checkpoint_last.pt"
    if ckpt.is_file():
        return ckpt
    generate_corpus(work / "raw", langs=("en", "de"), n_train=2000, n_valid=20, n_test=20, seed=1)
    prepare({"train": str(work / "raw" / "train"), "valid": str(work / "raw" / "valid")}, ["en", "de"],
            work / "data", vocab_size=400, progress=False)
    Trainer(load_config(data={
        "model": {"name": "transformer", "d_model": 64, "ffn_dim": 128, "heads": 4, "encoder_layers": 2,
                  "decoder_layers": 2},
        "data": {"path": str(work / "data"), "src_lang": "en", "tgt_lang": "de", "max_tokens": 2000},
        "train": {"save_dir": str(work / "model"), "lr": 3e-3, "warmup_updates": 5, "max_updates": 20,
                  "validate_every": 0, "save_every": 0, "progress": False, "valid_bleu": False}})).train()
    return ckpt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict[str, Any]) -> float:
    """Seconds one request took (an HTTP error raises)."""
    start = time.perf_counter()
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        json.loads(response.read())
    return time.perf_counter() - start


def load_level(url: str, clients: int, sentences: list[list[str]], requests: int, seconds: float) -> dict[str, Any]:
    """``clients`` threads sending requests until ``requests`` are answered or ``seconds`` pass."""
    latencies: list[float] = []
    lock, counter = threading.Lock(), iter(range(requests))
    deadline = time.monotonic() + seconds

    def client() -> None:
        while time.monotonic() < deadline:
            with lock:
                n = next(counter, None)
            if n is None:
                return
            took = post(url, {"sentences": sentences[n % len(sentences)], "beam_size": 5})
            with lock:
                latencies.append(took)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ms = np.array(latencies) * 1000
    per_request = len(sentences[0])
    return {"clients": clients, "requests": len(latencies), "seconds": round(wall, 3),
            "requests_per_s": round(len(latencies) / wall, 2),
            "sentences_per_s": round(len(latencies) * per_request / wall, 2),
            **{f"latency_p{p}_ms": round(float(np.percentile(ms, p)), 1) for p in (50, 90, 99)}}


def peak_rss_mb(pid: int) -> float | None:
    """The peak resident memory of process ``pid`` (Linux ``/proc``; None elsewhere)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", help="the model to serve (default: a tiny one trained in --work)")
    p.add_argument("--work", default="runs/bench-serve", help="where the tiny model is made (default: %(default)s)")
    p.add_argument("--out", default="benchmarks/results/serve-load.json")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--requests", type=int, default=96, help="requests per client count (default: %(default)s)")
    p.add_argument("--seconds", type=float, default=60.0, help="time limit per client count (default: %(default)s)")
    p.add_argument("--sentences", type=int, default=2, help="sentences per request (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads (OMP_NUM_THREADS)")
    p.add_argument("--source", help="a text file whose first lines are the requests' sentences (default: "
                                    "sentences of the built-in corpus)")
    p.add_argument("--precision", choices=["fp32", "bf16"], help="the server's --precision (default: the model's)")
    args = p.parse_args(argv)
    ckpt = Path(args.checkpoint) if args.checkpoint else tiny_checkpoint(Path(args.work))
    from nmtflow.data.synthetic import generate_corpus

    if args.source:
        lines = Path(args.source).read_text(encoding="utf-8").splitlines()[:args.requests * args.sentences]
    else:
        corpus = Path(args.work) / "sentences"
        generate_corpus(corpus, langs=("en", "de"), n_train=10, n_valid=2, n_test=args.requests * args.sentences,
                        seed=7)
        lines = (corpus / "test.en").read_text(encoding="utf-8").splitlines()
    sentences = [lines[i:i + args.sentences] for i in range(0, len(lines) - args.sentences + 1, args.sentences)]
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "nmtflow", "serve", str(ckpt), "--host", "127.0.0.1", "--port", str(port),
               "--device", "cpu", *(["--precision", args.precision] if args.precision else [])]
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(base + "/api/health", timeout=5).read()
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("serve_load: the server did not start") from None
                time.sleep(0.2)
        post(base + "/api/translate", {"sentences": sentences[0]})  # warm-up
        levels = [load_level(base + "/api/translate", c, sentences, args.requests, args.seconds)
                  for c in args.clients]
        rss = peak_rss_mb(server.pid)
    finally:
        server.terminate()
        server.wait(30)
    result = {"benchmark": "serve_load", "checkpoint": ckpt.name, "precision": args.precision or "checkpoint's",
              "source": Path(args.source).name if args.source else "built-in corpus",
              "sentences_per_request": args.sentences,
              "beam_size": 5, "server_threads": args.threads, "server_peak_rss_mb": rss, "levels": levels,
              "machine": machine_info("cpu", threads=args.threads, torch_threads_client=torch.get_num_threads())}
    write_json(Path(args.out), result)
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
