"""nmtflow against HF transformers' MarianMTModel and OpenNMT-py 3.5.1 on the same batches (CPU, issue 8).

Usage (see benchmarks/README.md)::

    python benchmarks/peers.py                        # built-in synthetic corpus
    python benchmarks/peers.py --data data/multi30k   # raw train.LANG / val.LANG
    python benchmarks/peers.py --quick                # tiny settings: checks that everything runs

Every peer runs in its own virtual environment, which this script creates once from the package registry
(under ``--envs``, default ``benchmarks/.envs``) with ``torch==2.13.0``, the version nmtflow pins. nmtflow
prepares the data and builds the batches once; each system then trains its own Transformer of the same size
on exactly those id batches, and beam-searches the same validation sentences, in its own process
(``benchmarks/peers_workers/worker.py``). The processes take turns (never two systems at once): timed
training runs in alternating blocks, decoding alternates batch by batch, so load from elsewhere on the
machine hits every system alike.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from nmtflow.config import TrainConfig
from nmtflow.data.batching import TokenBatchSampler, collate
from nmtflow.data.bitext import open_bitext
from nmtflow.data.prepare import load_meta, load_tokenizer, prepare
from nmtflow.decode.search import max_output_lengths
from nmtflow.decode.translate import batches_by_length
from nmtflow.runtime import machine_info
from throughput import default_work, prepare_once  # the sibling benchmark's data cache

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKER = HERE / "peers_workers" / "worker.py"

TORCH = "torch==2.13.0"  # nmtflow's pin; every pip command below names it, so pip never picks another torch
TRANSFORMERS = "transformers==5.23.0"
OPENNMT = "OpenNMT-py==3.5.1"
# OpenNMT-py 3.5.1's Requires-Dist (its wheel's METADATA) less "torch<2.3,>=2.1", which would replace torch
# 2.13.0: installed with torch pinned, then OpenNMT-py itself with --no-deps.
OPENNMT_DEPS = ["configargparse", "ctranslate2>=4,<5", "tensorboard>=2.3", "flask", "waitress", "pyonmttok>=1.37,<2",
                "pyyaml", "sacrebleu", "rapidfuzz", "pyahocorasick", "fasttext-wheel", "spacy", "six"]
PEERS: dict[str, dict[str, Any]] = {
    "marian": {"label": f"HF {TRANSFORMERS} MarianMTModel",
               "pip": [[TORCH, TRANSFORMERS]], "check": "import transformers"},
    "opennmt": {"label": OPENNMT,
                "pip": [[TORCH, *OPENNMT_DEPS], ["--no-deps", TORCH, OPENNMT]], "check": "import onmt, onmt.translate"},
}
SYSTEMS = ["nmtflow", *PEERS]
KEY_PACKAGES = ["torch", "transformers", "tokenizers", "safetensors", "huggingface-hub", "OpenNMT-py", "pyonmttok",
                "ctranslate2", "numpy"]
# issue 8's reference numbers (2 CPU cores, 2 threads) and targets
ISSUE_REFERENCE = {"marian_train_tgt_tokens_per_s": 1520, "opennmt_train_tgt_tokens_per_s": 1270,
                   "opennmt_decode_sentences_per_s": 23}
TARGETS = {"train": 1.2, "decode": 1.5}

FULL = dict(n_train=20000, vocab_size=8000, max_tokens=4096, warmup=5, steps=40, rounds=4, decode_sentences=300,
            decode_max_tokens=2000)
QUICK = dict(n_train=2000, vocab_size=1000, max_tokens=1024, warmup=1, steps=3, rounds=3, decode_sentences=6,
             decode_max_tokens=60)


def shown(path: Path) -> str:
    """A path for the report: relative to the repository when inside it, else just its name."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return path.name


def log(msg: str) -> None:
    print(f"[peers] {msg}", file=sys.stderr, flush=True)


# ---- environments ----------------------------------------------------------------------------------
class EnvError(RuntimeError):
    pass


def ensure_env(name: str, envs: Path, rebuild: bool) -> dict[str, Any]:
    """The peer's virtual environment, created once; returns its marker (pip steps, frozen packages)."""
    spec = PEERS[name]
    env = envs / name
    marker = env / "peers-env.json"
    want = {"pip": spec["pip"], "python": platform.python_version()}
    if not rebuild and marker.is_file():
        info = json.loads(marker.read_text(encoding="utf-8"))
        if info.get("want") == want:
            return info
    if env.exists():
        shutil.rmtree(env)
    envs.mkdir(parents=True, exist_ok=True)
    logfile = envs / f"{name}.log"
    log(f"creating the {name} environment in {shown(env)} (a few minutes; pip output in {shown(logfile)})")
    t0 = time.perf_counter()
    with logfile.open("w", encoding="utf-8") as out:
        def run(cmd: list[str]) -> None:
            out.write(f"$ {' '.join(cmd)}\n")
            out.flush()
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode:
                out.flush()
                tail = "\n".join(logfile.read_text(encoding="utf-8", errors="replace").splitlines()[-15:])
                raise EnvError(f"{name}: `{' '.join(cmd[1:] if cmd[0].endswith('python') else cmd)}` failed:\n{tail}")

        run([sys.executable, "-m", "venv", str(env)])
        python = str(env / "bin" / "python")
        for step in spec["pip"]:
            run([python, "-m", "pip", "install", "--disable-pip-version-check", *step])
        run([python, "-c", "import torch, sys; v = torch.__version__.split('+')[0]; "
                           f"sys.exit(0 if v == '{TORCH.split('==')[1]}' else 'torch ' + v)"])
        run([python, "-W", "ignore", "-c", spec["check"]])
        frozen = subprocess.run([python, "-m", "pip", "freeze", "--all", "--disable-pip-version-check"],
                                capture_output=True, text=True, check=True).stdout
    packages = {}
    for line in frozen.splitlines():
        if "==" in line:
            k, v = line.split("==", 1)
            packages[k] = v
        elif " @ " in line:
            k, v = line.split(" @ ", 1)
            packages[k] = "local wheel"
    info = {"want": want, "packages": packages, "build_seconds": round(time.perf_counter() - t0, 1)}
    marker.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    log(f"{name} environment ready in {info['build_seconds']:.0f} s")
    return info


# ---- data and batches ------------------------------------------------------------------------------
def prepared(args: argparse.Namespace) -> Path:
    """The nmtflow-prepared directory (made once: from --data, or from the built-in synthetic corpus)."""
    if args.work:
        work = args.work
    elif args.data:
        work = default_work(args)  # shared with throughput.py
    else:
        work = Path(f"runs/bench-peers-{'quick' if args.quick else 'synthetic'}-{args.src}-{args.tgt}")

    def make() -> None:
        if args.data:
            raw = args.data
            valid = raw / "val" if (raw / f"val.{args.src}").is_file() else raw / "valid"
        else:
            from nmtflow.data.synthetic import generate_corpus
            raw = work.parent / f"{work.name}-raw"
            log(f"writing the built-in synthetic corpus ({args.n_train} training sentences) to {raw}")
            generate_corpus(raw, langs=[args.src, args.tgt], n_train=args.n_train,
                            n_valid=max(args.decode_sentences, 500), n_test=10, seed=args.seed)
            valid = raw / "valid"
        log(f"preparing {raw} into {work} (joint vocabulary of {args.vocab_size})")
        prepare({"train": raw / "train", "valid": valid}, [args.src, args.tgt], work, vocab_size=args.vocab_size,
                joint=True, progress=False)

    prepare_once(work, [args.src, args.tgt], make)
    return work


def make_batches(args: argparse.Namespace, work: Path, out: Path) -> dict[str, Any]:
    """Collate the training and decoding batches once and save them as id tensors for every system."""
    meta = load_meta(work)
    tokenizer = load_tokenizer(work, args.tgt, meta)
    vocab = tokenizer.vocab_size
    train = open_bitext(work, "train", args.src, args.tgt)
    valid = open_bitext(work, "valid", args.src, args.tgt)
    sampler = TokenBatchSampler(train.src.sizes, train.tgt.sizes, args.max_tokens, shuffle=True, seed=args.seed)
    needed, order, epoch = args.warmup + args.steps, [], 1
    while len(order) < needed:
        order += sampler.batches(epoch)
        epoch += 1
    train_batches = [train.batch(idx) for idx in order[:needed]]
    sources = [valid.src[i].tolist() for i in range(min(args.decode_sentences, len(valid)))]
    decode = []
    for rows in batches_by_length([len(s) for s in sources], args.decode_max_tokens):
        src = collate([sources[i] for i in rows], [[]] * len(rows)).src
        cap = int(max_output_lengths(src, args.max_len_a, args.max_len_b, args.max_positions - 2).max())
        decode.append({"src": src, "cap": cap})
    data = {"train": [{"src": b.src, "tgt_in": b.tgt_in, "tgt_out": b.tgt_out} for b in train_batches],
            "decode": decode, "vocab_size": vocab, "pieces": [tokenizer.piece(i) for i in range(vocab)]}
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(data, out)
    return data


# ---- the worker processes --------------------------------------------------------------------------
class WorkerError(RuntimeError):
    pass


class Worker:
    """One system's process; ``ask(cmd)`` sends a command and waits for its answer."""

    def __init__(self, name: str, python: str, batches: Path, spec: Path, logfile: Path, threads: int) -> None:
        self.name, self.logfile = name, logfile
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONNOUSERSITE="1",
                   TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        if name != "nmtflow":  # a peer sees only its own environment
            for k in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME"):
                env.pop(k, None)
        self.log = logfile.open("w", encoding="utf-8")
        self.proc = subprocess.Popen([python, str(WORKER), "--system", name, "--batches", str(batches),
                                      "--spec", str(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env, cwd=str(REPO))
        self.ready = self._answer()

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            self.log.flush()
            tail = "\n".join(self.logfile.read_text(encoding="utf-8", errors="replace").splitlines()[-20:])
            raise WorkerError(f"{self.name} worker exited with code {self.proc.returncode}:\n{tail}")
        msg = json.loads(line)
        if "error" in msg:
            raise WorkerError(f"{self.name} worker failed:\n{msg['error']}")
        return msg

    def ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(cmd) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # _answer reports the exit
        return self._answer()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.ask({"op": "quit"})
            except (WorkerError, OSError, ValueError):
                pass
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


# ---- main --------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, help="raw parallel text: train.LANG and val.LANG (or valid.LANG); "
                                             "default: the built-in synthetic corpus")
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--work", type=Path, help="prepared-data cache (default runs/bench-data-SRC-TGT with --data, "
                                             "else runs/bench-peers-synthetic-SRC-TGT)")
    p.add_argument("--envs", type=Path, default=HERE / ".envs", help="the peers' virtual environments")
    p.add_argument("--rebuild-envs", action="store_true", help="recreate the environments")
    p.add_argument("--setup-only", action="store_true", help="create the environments, then stop")
    p.add_argument("--systems", nargs="+", choices=SYSTEMS, default=SYSTEMS)
    p.add_argument("--out", type=Path, help="default benchmarks/results/peers.json "
                                            "(with --quick: runs/bench-peers-quick.json)")
    p.add_argument("--quick", action="store_true", help="tiny settings (a smoke test; numbers mean nothing)")
    for k, v in FULL.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, default=None, help=f"default {v} (--quick: {QUICK[k]})")
    p.add_argument("--layers", type=int, default=3, help="encoder and decoder layers of every system")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--len-penalty", type=float, default=0.6)
    p.add_argument("--max-len-a", type=float, default=1.5, help="output cap of a decoding batch: "
                                                                "A·(longest source incl. EOS) + B")
    p.add_argument("--max-len-b", type=int, default=10)
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--decode-lengths", choices=["forced", "capped"], default="forced",
                   help="forced: EOS is banned until the cap, so every system emits exactly the cap; "
                        "capped: systems stop at EOS or the cap")
    p.add_argument("--lr-warmup", type=int, default=4000, help="inverse_sqrt warm-up updates")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    for k, v in (QUICK if args.quick else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.out is None:
        args.out = Path("runs/bench-peers-quick.json") if args.quick else Path("benchmarks/results/peers.json")
    if args.steps < 1 or args.decode_sentences < 1 or args.rounds < 1:
        p.error("--steps, --rounds and --decode-sentences must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    errors: dict[str, str] = {}

    # 1. environments (created once, cached)
    envs: dict[str, dict[str, Any]] = {}
    for name in args.systems:
        if name == "nmtflow":
            continue
        try:
            envs[name] = ensure_env(name, args.envs, args.rebuild_envs)
        except (EnvError, subprocess.CalledProcessError, OSError) as e:
            errors[name] = f"environment: {e}"
            log(f"{name} is left out: {e}")
    if args.setup_only:
        for name, info in envs.items():
            pk = info["packages"]
            norm = {k.lower().replace("_", "-"): v for k, v in pk.items()}
            log(f"{name}: " + ", ".join(f"{k} {norm[k.lower()]}" for k in KEY_PACKAGES if k.lower() in norm))
        return {"envs": envs, "errors": errors}

    # 2. data: prepared once, batches collated once and saved as id tensors
    work = prepared(args)
    run_dir = work / "peers"
    run_dir.mkdir(parents=True, exist_ok=True)
    tc = TrainConfig()
    spec = {"threads": args.threads, "seed": args.seed, "d_model": 256, "heads": 4, "ffn_dim": 1024,
            "layers": args.layers, "dropout": 0.1, "attention_dropout": 0.0, "label_smoothing": 0.1,
            "clip_norm": 1.0, "lr": tc.lr, "adam_betas": list(tc.adam_betas), "adam_eps": tc.adam_eps,
            "warmup_updates": args.lr_warmup, "warmup_init_lr": tc.warmup_init_lr, "beam": args.beam,
            "len_penalty": args.len_penalty, "max_positions": args.max_positions,
            "decode_lengths": args.decode_lengths, "data_path": str(work.resolve()), "src": args.src,
            "tgt": args.tgt}
    batches_file = run_dir / "batches.pt"
    data = make_batches(args, work, batches_file)
    spec_file = run_dir / "spec.json"
    spec_file.write_text(json.dumps(spec, indent=2) + "\n", encoding="utf-8")
    warm = list(range(args.warmup))
    timed = list(range(args.warmup, args.warmup + args.steps))
    rounds = max(1, min(args.rounds, len(timed)))
    blocks = [timed[i * len(timed) // rounds:(i + 1) * len(timed) // rounds] for i in range(rounds)]
    timed_tokens = sum(int(data["train"][i]["tgt_out"].ne(0).sum()) for i in timed)
    caps = [d["cap"] for d in data["decode"] for _ in range(d["src"].size(0))]

    # 3. start the workers one after the other (each builds its model, then waits)
    workers: dict[str, Worker] = {}
    ready: dict[str, dict[str, Any]] = {}

    def fail(name: str, e: Exception) -> None:
        errors[name] = str(e)
        log(f"{name} failed, left out of the rest:\n{e}")
        w = workers.pop(name, None)
        if w is not None:
            w.close()

    for name in args.systems:
        if name in errors:
            continue
        python = sys.executable if name == "nmtflow" else str((args.envs / name / "bin" / "python").absolute())
        log(f"starting {name}")
        try:
            workers[name] = w = Worker(name, python, batches_file.resolve(), spec_file.resolve(),
                                       run_dir / f"{name}.log", args.threads)
            ready[name] = w.ready
        except (WorkerError, OSError) as e:
            fail(name, e)

    train_s = {n: 0.0 for n in workers}
    losses: dict[str, list[float]] = {n: [] for n in workers}
    dec_s = {n: 0.0 for n in workers}
    lengths: dict[str, list[int]] = {n: [] for n in workers}
    steps: dict[str, list[int]] = {n: [] for n in workers}
    rss_train: dict[str, float] = {}
    rss_end: dict[str, float] = {}

    def each(fn: Any) -> None:
        for name in list(workers):
            try:
                fn(name, workers[name])
            except (WorkerError, OSError) as e:
                fail(name, e)

    try:
        # 4. training: untimed warm-up, then alternating timed blocks over the same batches
        log(f"training: {len(warm)} warm-up + {len(timed)} timed batches ({timed_tokens} target tokens) "
            f"in {rounds} rounds")
        each(lambda n, w: w.ask({"op": "train", "batches": warm}) if warm else None)
        for block in blocks:
            def train_block(n: str, w: Worker, block: list[int] = block) -> None:
                r = w.ask({"op": "train", "batches": block})
                train_s[n] += r["seconds"]
                losses[n] += r["losses"]
            each(train_block)
        each(lambda n, w: rss_train.__setitem__(n, w.ask({"op": "rss"})["peak_rss_mb"]))

        # 5. decoding: one untimed warm-up call each, then the batches in turn
        log(f"decoding: {len(caps)} sentences in {len(data['decode'])} batches, beam {args.beam}, "
            f"{args.decode_lengths} lengths")
        each(lambda n, w: w.ask({"op": "decode", "batches": [0], "limit": 2}))
        for i in range(len(data["decode"])):
            def decode_batch(n: str, w: Worker, i: int = i) -> None:
                r = w.ask({"op": "decode", "batches": [i]})
                dec_s[n] += r["seconds"]
                lengths[n] += r["lengths"]
                steps[n] += r["steps"]
            each(decode_batch)
        each(lambda n, w: rss_end.__setitem__(n, w.ask({"op": "rss"})["peak_rss_mb"]))
    finally:
        for name in list(workers):
            workers.pop(name).close()

    # 6. report
    results: dict[str, Any] = {}
    for name in args.systems:
        if name not in rss_end:
            continue
        r, n = ready[name], lengths[name]
        env_info = envs.get(name)
        results[name] = {
            "label": "nmtflow" if name == "nmtflow" else PEERS[name]["label"],
            "parameters": r["parameters"],
            "train_tgt_tokens_per_s": timed_tokens / train_s[name],
            "train_seconds": train_s[name],
            "train_loss_first": losses[name][0],
            "train_loss_last": losses[name][-1],
            "decode_sentences_per_s": len(n) / dec_s[name],
            "decode_output_tokens_per_s": sum(k + 1 for k in n) / dec_s[name],
            "decode_seconds": dec_s[name],
            "decode_mean_output_len": sum(n) / len(n),
            "decode_frac_at_cap": sum(k >= c for k, c in zip(n, caps)) / len(n),
            "decode_max_steps_per_batch": steps[name],
            "peak_rss_mb_after_build": round(r["peak_rss_mb"], 1),
            "peak_rss_mb_after_train": round(rss_train[name], 1),
            "peak_rss_mb": round(rss_end[name], 1),
            "startup_seconds": r["startup_seconds"],
            "threads": r["threads"],
            "versions": r["versions"],
            "settings": r["settings"],
            "environment": ({"path": shown(args.envs / name), "pip": PEERS[name]["pip"],
                             "packages": env_info["packages"]} if env_info else {"path": "this interpreter"}),
        }
    ratios: dict[str, dict[str, float]] = {}
    targets: dict[str, Any] = {}
    if "nmtflow" in results:
        a = results["nmtflow"]
        peers = [p for p in PEERS if p in results]
        for p in peers:
            ratios[p] = {"train_tokens_per_s": a["train_tgt_tokens_per_s"] / results[p]["train_tgt_tokens_per_s"],
                         "decode_sentences_per_s": a["decode_sentences_per_s"] / results[p]["decode_sentences_per_s"]}
        for what, metric, key_ in (("train", "train_tgt_tokens_per_s", "train_tokens_per_s"),
                                   ("decode", "decode_sentences_per_s", "decode_sentences_per_s")):
            if peers:
                best = max(peers, key=lambda p: results[p][metric])
                ratio = ratios[best][key_]
                targets[what] = {"best_peer": best, "ratio": ratio, "target": TARGETS[what],
                                 "met": ratio >= TARGETS[what],
                                 "all_peers_measured": len(peers) == len(PEERS)}
    result = {
        "machine": machine_info("cpu", threads=args.threads),
        "config": {"data": args.data.name if args.data else "synthetic", "src": args.src, "tgt": args.tgt,
                   "quick": args.quick, "vocab_size": data["vocab_size"], "vocab_size_requested": args.vocab_size,
                   "layers": args.layers, "d_model": spec["d_model"], "heads": spec["heads"],
                   "ffn_dim": spec["ffn_dim"], "dropout": spec["dropout"],
                   "attention_dropout": spec["attention_dropout"], "max_tokens": args.max_tokens,
                   "warmup_batches": len(warm), "timed_batches": len(timed), "rounds": rounds,
                   "timed_tgt_tokens": timed_tokens, "label_smoothing": spec["label_smoothing"],
                   "clip_norm": spec["clip_norm"], "lr": spec["lr"], "lr_warmup": args.lr_warmup,
                   "adam_betas": spec["adam_betas"], "adam_eps": spec["adam_eps"], "precision": "fp32",
                   "decode_sentences": len(caps), "decode_batches": len(data["decode"]),
                   "decode_max_tokens": args.decode_max_tokens, "beam": args.beam, "len_penalty": args.len_penalty,
                   "decode_lengths": args.decode_lengths, "max_len_a": args.max_len_a, "max_len_b": args.max_len_b,
                   "decode_caps": [d["cap"] for d in data["decode"]], "seed": args.seed,
                   "systems": args.systems},
        "systems": results,
        "ratios_nmtflow_over_peer": ratios,
        "targets": targets,
        "issue_reference": ISSUE_REFERENCE,
        "errors": errors,
        "notes": [
            "each system runs in its own process (peers in their own virtual environments); the processes take "
            "turns, never two at once; peak RSS is each process's own ru_maxrss",
            "one update everywhere: forward, label-smoothed cross-entropy / target tokens, backward, clipping, "
            "Adam, inverse-sqrt schedule; timed inside the worker around the update only",
            "decoding times the search on id tensors (no text processing); 'forced' lengths ban EOS until the "
            "batch's cap so every system decodes the same number of steps; OpenNMT-py does not force EOS at its "
            "limit, so its outputs count one token more (cap+1) for the same number of decoder steps",
        ],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    print_table(result, args.out)
    return result


def print_table(result: dict[str, Any], out: Path) -> None:
    systems = result["systems"]
    names = list(systems)
    rows = [("train tgt tokens/s", "train_tgt_tokens_per_s", ",.0f"),
            ("decode sentences/s", "decode_sentences_per_s", ",.1f"),
            ("decode mean output len", "decode_mean_output_len", ",.1f"),
            ("peak RSS MB", "peak_rss_mb", ",.0f"),
            ("parameters", "parameters", ",")]
    print(f"{'':24}" + "".join(f"{n:>14}" for n in names))
    for label, key, fmt in rows:
        print(f"{label:24}" + "".join(f"{systems[n][key]:>14{fmt}}" for n in names))
    for p, r in result["ratios_nmtflow_over_peer"].items():
        print(f"nmtflow/{p}: training {r['train_tokens_per_s']:.2f}x, decoding {r['decode_sentences_per_s']:.2f}x")
    for what, t in result["targets"].items():
        print(f"target {what}: {t['ratio']:.2f}x the best peer ({t['best_peer']}), need {t['target']}x: "
              f"{'met' if t['met'] else 'NOT met'}")
    for name, err in result["errors"].items():
        last = [line for line in err.splitlines() if line.strip()]
        print(f"{name}: FAILED ({last[-1].strip() if last else 'no message'}; details in the JSON's errors)")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
