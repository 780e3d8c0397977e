"""Throughput of nmtflow's Transformer against a plain ``torch.nn.Transformer`` on the same data (CPU).

Usage (see benchmarks/README.md)::

    python benchmarks/throughput.py --data data/multi30k --src en --tgt de --out results.json

Both systems get the same batches, the same loss, optimiser, schedule and gradient clipping, and the same
beam search; only the model differs. Training steps run in alternating blocks (A, B, A, B, ...) and
decoding alternates per batch, so background load on the machine hits both systems alike.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import resource
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmtflow.config import PRECISIONS, TrainConfig, load_config
from nmtflow.data.batching import Batch, TokenBatchSampler, collate
from nmtflow.data.bitext import open_bitext
from nmtflow.data.prepare import load_meta, load_tokenizer, prepare
from nmtflow.data.vocab import PAD
from nmtflow.decode.search import beam_search, max_output_lengths
from nmtflow.decode.translate import batches_by_length
from nmtflow.models.base import EncoderDecoder, EncoderOut, ModelConfig, State, Vocabularies, build_model, \
    count_parameters
from nmtflow.nn.compiled import compile_regions
from nmtflow.nn.layers import SinusoidalPositions
from nmtflow.runtime import autocast, hold_heap, keep_freed_memory, machine_info, use_precision
from nmtflow.train.loss import label_smoothed_nll
from nmtflow.train.optim import build_optimizer, build_scheduler

# nn.Transformer builds its encoder with enable_nested_tensor=True, which norm_first layers cannot use.
warnings.filterwarnings("ignore", message=r"enable_nested_tensor is True")


# ---- system B: the reference model ----------------------------------------------------------------
@dataclass
class ReferenceConfig(ModelConfig):
    name: str = "nn.Transformer"
    d_model: int = 256
    heads: int = 4
    layers: int = 3
    ffn_dim: int = 1024
    dropout: float = 0.1
    max_positions: int = 1024  # read by beam_search for its length limit


class ReferenceTransformer(EncoderDecoder):
    """``nn.Transformer`` (pre-norm, batch-first) behind nmtflow's EncoderDecoder contract.

    One token embedding (scaled by √d) shared by source, target and the output projection, sinusoidal
    positions. No incremental cache: with a ``state`` it keeps the generated prefix in ``state["prefix"]``
    (B,t), batch-first so beam search reorders it, and re-runs the whole decoder over it at every step.
    """

    def __init__(self, cfg: ReferenceConfig, vocab_size: int) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = nn.Transformer(d_model=cfg.d_model, nhead=cfg.heads, num_encoder_layers=cfg.layers,
                                          num_decoder_layers=cfg.layers, dim_feedforward=cfg.ffn_dim,
                                          dropout=cfg.dropout, batch_first=True, norm_first=True)
        self.embed = nn.Embedding(vocab_size, cfg.d_model, padding_idx=PAD)
        nn.init.normal_(self.embed.weight, std=cfg.d_model ** -0.5)
        with torch.no_grad():
            self.embed.weight[PAD].zero_()
        self.positions = SinusoidalPositions(cfg.d_model, cfg.max_positions)
        self.dropout = nn.Dropout(cfg.dropout)

    def embed_tokens(self, tokens: Tensor) -> Tensor:
        x = self.embed(tokens) * math.sqrt(self.config.d_model) + self.positions(tokens.size(1))
        return self.dropout(x)

    def encode(self, src: Tensor) -> EncoderOut:
        pad = src.eq(PAD)
        out = self.transformer.encoder(self.embed_tokens(src), src_key_padding_mask=pad)
        return {"out": out, "padding_mask": pad}

    def decode(self, tgt_in: Tensor, enc: EncoderOut, state: State | None = None) -> Tensor:
        tgt = tgt_in
        if state is not None:
            tgt = torch.cat([state["prefix"], tgt_in], dim=1) if "prefix" in state else tgt_in
            state["prefix"] = tgt
        causal = nn.Transformer.generate_square_subsequent_mask(tgt.size(1), device=tgt.device)
        tgt_pad = torch.zeros(tgt.shape, device=tgt.device).masked_fill(tgt.eq(PAD), float("-inf"))
        h = self.transformer.decoder(self.embed_tokens(tgt), enc["out"], tgt_mask=causal, tgt_is_causal=True,
                                     tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=enc["padding_mask"])
        logits = F.linear(h, self.embed.weight)  # tied output projection
        return logits[:, -tgt_in.size(1):]


# ---- one training update (mirrors nmtflow.train.trainer.Trainer.train_step for one batch) ----------
class Optimiser:
    """A model with nmtflow's optimiser and schedule; ``step(batch)`` is one update, returns loss/token."""

    def __init__(self, model: EncoderDecoder, tc: TrainConfig) -> None:
        self.model, self.tc = model, tc
        self.device = next(model.parameters()).device
        if tc.compile:  # as Trainer.compile_model: the layers and the loss run compiled in training
            compile_regions(model)
        keep_freed_memory()  # as Trainer does (process-wide)
        use_precision(tc.precision)
        self.optimizer = build_optimizer([p for p in model.parameters() if p.requires_grad], tc)
        self.scheduler = build_scheduler(self.optimizer, tc)

    def step(self, b: Batch) -> float:
        model, tc = self.model, self.tc
        model.train()
        self.optimizer.zero_grad(set_to_none=True)
        tokens = b.num_tgt_tokens
        with autocast(tc.precision, self.device):
            enc = model.encode(b.src)
            loss, _ = label_smoothed_nll(model.decode(b.tgt_in, enc), b.tgt_out, tc.label_smoothing,
                                         compiled=tc.compile)
            aux = model.auxiliary_loss(enc, b.num_tgt_tokens)
            total = (loss if aux is None else loss + aux) / tokens
        total.backward()
        params = [p for p in model.parameters() if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, tc.clip_norm if tc.clip_norm > 0 else float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        return loss.item() / tokens


def peak_rss_mb() -> float:
    """Peak resident set size of this whole process so far (both systems live in it)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def decode_batch(model: EncoderDecoder, src: Tensor, args: argparse.Namespace) -> tuple[float, list[list[int]]]:
    """Beam search over one batch → (seconds, each sentence's best output without EOS, on the host)."""
    start = time.perf_counter()
    hyps = beam_search(model, src, beam_size=args.beam, len_penalty=0.6, max_len_a=1.5, max_len_b=10)
    return time.perf_counter() - start, [h[0].tokens for h in hyps]


# ---- shared by the sibling benchmarks (shortcuts.py, phrasal.py, convs2s.py) --------------------------------
DEFAULT_VOCAB = 8000  # --vocab-size


def device_option(name: str) -> str:
    """``--device``: a torch device name, ``cuda`` only where a GPU is visible (a usage error, not a traceback)."""
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{name}: no CUDA device visible")
    return name


def add_common_args(p: argparse.ArgumentParser, *, warmup: int, steps: int, rounds: int | None,
                    heap_headroom_mb: int = 0) -> None:
    """The options every same-batches training benchmark takes (data, batches, timing, device)."""
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--warmup", type=int, default=warmup, help="untimed training batches per system")
    p.add_argument("--steps", type=int, default=steps, help="timed training batches per system")
    p.add_argument("--rounds", type=int, default=rounds, help="alternating blocks the timed steps are split into")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", type=device_option, help="cpu | cuda (timings synchronise the GPU)")
    p.add_argument("--precision", default="fp32", choices=[x for x in PRECISIONS if x != "fp16"],  # no GradScaler
                   help="train.precision of every system: tf32 matmuls (CUDA) or bf16 autocast")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--heap-headroom-mb", type=int, default=heap_headroom_mb,
                   help="CPU: after the warm-up, stop heap trimming and pre-fault this much heap above its top, so "
                        "that timed steps do not page-fault (nmtflow.runtime.hold_heap; it adds to the peak RSS); "
                        "0: only stop trimming; -1: leave the heap as it is")


def default_work(args: argparse.Namespace, name: str = "bench-data") -> Path:
    """The default prepared-data cache: ``runs/NAME-SRC-TGT``, with ``-VOCAB`` for a ``--vocab-size`` other than
    the default."""
    suffix = "" if args.vocab_size == DEFAULT_VOCAB else f"-{args.vocab_size}"
    return Path(f"runs/{name}-{args.src}-{args.tgt}{suffix}")


def prepare_once(work: Path, langs: list[str], make: Callable[[], Any]) -> bool:
    """Run ``make`` (which writes the prepared directory ``work``) unless ``work`` already holds ``langs``; returns
    whether it ran. A cache of other languages, or a bad input to ``make`` (a missing file or language, too small a
    vocabulary: a ``ValueError``), exits with a one-line message instead of a traceback."""
    if (work / "meta.json").is_file():
        have = load_meta(work)["langs"]
        missing = [lang for lang in langs if lang not in have]
        if missing:
            raise SystemExit(f"{work} holds languages {' '.join(have)}, not {' '.join(missing)}: pass another --work")
        return False
    try:
        make()
    except ValueError as e:
        raise SystemExit(str(e)) from None
    return True


def prepared_data(args: argparse.Namespace, work: Path, with_valid: bool = True) -> int:
    """Prepare ``args.data`` (train, and val or valid) into the cache ``work`` once; returns the vocabulary size."""
    splits = {"train": args.data / "train"}
    if with_valid:
        splits["valid"] = args.data / ("val" if (args.data / f"val.{args.src}").is_file() else "valid")
    fresh = prepare_once(work, [args.src, args.tgt],
                         lambda: prepare(splits, [args.src, args.tgt], work, vocab_size=args.vocab_size, joint=True))
    meta = load_meta(work)
    if meta["vocab_size"][args.tgt] != args.vocab_size:
        raise SystemExit(f"{args.data} gives only {meta['vocab_size'][args.tgt]} pieces: pass a smaller --vocab-size"
                         if fresh else f"{work} holds a {meta['vocab_size'][args.tgt]}-piece vocabulary, not "
                         f"--vocab-size {args.vocab_size}: pass another --work")
    return load_tokenizer(work, args.tgt, meta).vocab_size


def training_batches(work: Path, args: argparse.Namespace, count: int, device: torch.device) -> list[Batch]:
    """The first ``count`` token batches of the shuffled training epochs, collated once (batching is not timed)."""
    train = open_bitext(work, "train", args.src, args.tgt)
    sampler = TokenBatchSampler(train.src.sizes, train.tgt.sizes, args.max_tokens, shuffle=True, seed=args.seed)
    order, epoch = [], 1
    while len(order) < count:
        order += sampler.batches(epoch)
        epoch += 1
    return [train.batch(idx).to(device) for idx in order[:count]]


def timed_training(systems: dict[str, Optimiser], warm: list[Batch], timed: list[Batch], rounds: int,
                   device: torch.device, heap_headroom_mb: int = 0,
                   faults: dict[str, int] | None = None, rotate: bool = False,
                   ) -> tuple[dict[str, float], dict[str, list[float]], dict[str, list[float]]]:
    """Untimed warm-up, then alternating timed blocks over the same batches → (seconds, losses, step seconds).

    Step seconds are per system in the order of ``timed``: entry i of every system is the same batch (with
    ``rotate``, block i starts with the i-th system and goes round, so that no system always comes first: in
    ``gpu_base.py`` on a GPU the first system left the GPU idle ~10 ms per step longer than the same model timed
    after it, ``benchmarks/README.md``). On the
    CPU the heap is then held at its steady state with ``heap_headroom_mb`` MB pre-faulted (a negative value
    leaves it as it is; :func:`nmtflow.runtime.hold_heap`), so that a step that grows the heap does not pay
    for page faults that a long training run pays once; ``faults``, if given,
    receives each system's minor page faults during its timed steps.
    """
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for opt in systems.values():
        for b in warm:
            opt.step(b)
    steady_heap(device, heap_headroom_mb)
    losses: dict[str, list[float]] = {name: [] for name in systems}
    steps: dict[str, list[float]] = {name: [] for name in systems}
    counted = faults if faults is not None else {}
    counted.update({name: 0 for name in systems})
    rounds = max(1, min(rounds, len(timed)))
    names = list(systems)
    for i in range(rounds):
        block = timed[i * len(timed) // rounds:(i + 1) * len(timed) // rounds]
        order = names[i % len(names):] + names[:i % len(names)] if rotate else names
        for name in order:
            opt = systems[name]
            for b in block:
                sync()
                before = minor_faults()
                start = time.perf_counter()
                losses[name].append(opt.step(b))  # .item() inside: the step has finished
                steps[name].append(time.perf_counter() - start)
                counted[name] += minor_faults() - before
    return {name: sum(t) for name, t in steps.items()}, losses, steps


def steady_heap(device: torch.device, headroom_mb: int) -> None:
    """Before timing on the CPU: :func:`nmtflow.runtime.hold_heap` with ``headroom_mb`` MB (``--heap-headroom-mb``;
    negative: leave the heap as it is)."""
    if device.type == "cpu" and headroom_mb >= 0:
        hold_heap(headroom_mb << 20)


def interleaved_median_ms(cases: dict[str, Callable[[], Any]], repeats: int, warmup: int = 3,
                          sync: Callable[[], Any] = lambda: None) -> dict[str, float]:
    """Median milliseconds per call of each case, the cases called in turn ``warmup`` untimed then ``repeats``
    timed rounds (``sync`` before and after each timed call: ``torch.cuda.synchronize`` on a GPU)."""
    for _ in range(warmup):
        for case in cases.values():
            case()
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, case in cases.items():
            sync()
            start = time.perf_counter()
            case()
            sync()
            seconds[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in seconds.items()}


def write_json(path: Path, result: dict[str, Any]) -> None:
    """A benchmark's result as indented JSON at ``path`` (its folder made if missing)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


def minor_faults() -> int:
    """Minor page faults of this process so far (pages the kernel had to map on first touch)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


MATMUL_OPS = ("mm", "addmm", "bmm", "baddbmm")


def matmul_profile(opt: Optimiser, batches: list[Batch]) -> dict[str, float]:
    """Steps of ``opt`` over ``batches`` on the CPU, twice: profiled (seconds in matrix products and in all
    operators, and their ratio) and under a FLOP counter (exact matrix-product FLOPs).

    Profiled self times carry a little overhead per operator, so the share is what to read, not the seconds;
    attention kernels count as non-matmul work.
    """
    from torch.profiler import ProfilerActivity, profile
    from torch.utils.flop_counter import FlopCounterMode

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for b in batches:
            opt.step(b)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events) / 1e6
    matmul = sum(e.self_cpu_time_total for e in events if e.key.removeprefix("aten::") in MATMUL_OPS) / 1e6
    with FlopCounterMode(display=False) as counter:
        for b in batches:
            opt.step(b)
    flops = sum(n for op, n in counter.get_flop_counts()["Global"].items() if str(op).split(".")[1] in MATMUL_OPS)
    return {"profiled_seconds": total, "matmul_seconds": matmul, "matmul_share": matmul / total,
            "matmul_flops": flops}


def slowdown_interval(steps: dict[str, list[float]], system: str, reference: str, level: float = 0.95,
                      resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Percentile-bootstrap interval (in %) for ``system``'s slowdown against ``reference`` on total time.

    Batches are resampled with replacement, each keeping its pair of step times (both systems ran it moments
    apart), and the slowdown ``100 (1 − Σ reference / Σ system)`` is recomputed per resample; the interval holds
    the central ``level`` of those values. It measures how much the figure depends on which batches were timed
    (including load from other processes during some of them), not drift between separate runs.
    """
    pairs = list(zip(steps[reference], steps[system]))
    rng = random.Random(seed)
    values = []
    for _ in range(resamples):
        sample = rng.choices(pairs, k=len(pairs))
        values.append(100 * (1 - sum(r for r, _ in sample) / sum(s for _, s in sample)))
    values.sort()
    tail = (1 - level) / 2
    return values[int(tail * (resamples - 1))], values[int((1 - tail) * (resamples - 1))]


def median_step_ratio(steps: dict[str, list[float]], system: str, reference: str) -> float:
    """Median over the timed batches of (reference step time / system step time): speed relative to the reference.

    Each ratio compares the two systems on the same batch, moments apart, so load from other processes that
    hits a few steps moves the median little (the ratio of total times takes it in full).
    """
    return statistics.median(r / s for r, s in zip(steps[reference], steps[system]))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True, help="directory with train.LANG and val.LANG")
    p.add_argument("--work", type=Path, help="prepared-data cache (default runs/bench-data-SRC-TGT)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/throughput.json"))
    p.add_argument("--layers", type=int, default=3, help="encoder and decoder layers of both systems")
    p.add_argument("--train-steps", type=int, default=0,
                   help="extra untimed updates of both systems (same batches) before decoding")
    p.add_argument("--lr-warmup", type=int, default=4000, help="inverse_sqrt warm-up updates")
    p.add_argument("--decode-sentences", type=int, default=300)
    p.add_argument("--decode-max-tokens", type=int, default=6000)
    p.add_argument("--beam", type=int, default=5)
    add_common_args(p, warmup=5, steps=40, rounds=4)
    args = p.parse_args(argv)
    if args.steps < 1 or args.decode_sentences < 1:
        p.error("--steps and --decode-sentences must be >= 1")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rss: dict[str, float] = {}

    # 1. data
    work = args.work or default_work(args)
    vocab = prepared_data(args, work)
    valid = open_bitext(work, "valid", args.src, args.tgt)
    batches = training_batches(work, args, args.warmup + args.steps + args.train_steps, device)
    warm, timed = batches[:args.warmup], batches[args.warmup:args.warmup + args.steps]
    extra = batches[args.warmup + args.steps:]
    rss["after_data"] = peak_rss_mb()

    # 2. models
    cfg = load_config(data={
        "model": {"name": "transformer", "preset": "small", "encoder_layers": args.layers,
                  "decoder_layers": args.layers, "dropout": 0.1, "tie_embeddings": True},
        "data": {"path": str(work), "src_lang": args.src, "tgt_lang": args.tgt, "max_tokens": args.max_tokens},
        "train": {"seed": args.seed, "threads": args.threads, "label_smoothing": 0.1, "clip_norm": 1.0,
                  "precision": args.precision,
                  "warmup_updates": args.lr_warmup}})
    torch.manual_seed(args.seed)
    sys_a = build_model(cfg.model, Vocabularies(vocab, vocab, joint=True)).to(device)
    torch.manual_seed(args.seed)
    ref_cfg = ReferenceConfig(d_model=cfg.model.d_model, heads=cfg.model.heads, layers=args.layers,
                              ffn_dim=cfg.model.ffn_dim, dropout=cfg.model.dropout)
    sys_b = ReferenceTransformer(ref_cfg, vocab).to(device)
    systems = {"nmtflow": Optimiser(sys_a, cfg.train), "reference_nn_transformer": Optimiser(sys_b, cfg.train)}
    rss["after_build"] = peak_rss_mb()

    # 3. training throughput: untimed warm-up, then alternating timed blocks over the same batches
    seconds, losses, _ = timed_training(systems, warm, timed, args.rounds, device, args.heap_headroom_mb)
    rounds = max(1, min(args.rounds, len(timed)))
    timed_tokens = sum(b.num_tgt_tokens for b in timed)
    rss["after_train"] = peak_rss_mb()
    for b in extra:
        for opt in systems.values():
            opt.step(b)

    # 4. decoding throughput: beam search over the first N validation sentences, alternating per batch
    sources = [valid.src[i].tolist() for i in range(min(args.decode_sentences, len(valid)))]
    src_batches = [collate([sources[i] for i in rows], [[]] * len(rows)).src.to(device)
                   for rows in batches_by_length([len(s) for s in sources], args.decode_max_tokens)]
    caps = torch.cat([max_output_lengths(s, 1.5, 10, ref_cfg.max_positions - 2) for s in src_batches]).tolist()
    dec_seconds = dict.fromkeys(systems, 0.0)
    dec_lengths: dict[str, list[int]] = {name: [] for name in systems}
    for opt in systems.values():
        opt.model.eval()
        decode_batch(opt.model, src_batches[0][:2], args)  # untimed warm-up
    for src in src_batches:
        for name, opt in systems.items():
            t, outputs = decode_batch(opt.model, src, args)
            dec_seconds[name] += t
            dec_lengths[name] += map(len, outputs)
            rss[f"after_decode_{name}"] = peak_rss_mb()  # running peak: both systems contribute

    # 5. report
    result: dict[str, Any] = {
        "machine": machine_info(device, threads=torch.get_num_threads()),
        "config": {"data": args.data.name, "src": args.src, "tgt": args.tgt, "vocab_size": vocab,
                   "layers": args.layers, "d_model": ref_cfg.d_model, "heads": ref_cfg.heads,
                   "ffn_dim": ref_cfg.ffn_dim, "dropout": ref_cfg.dropout, "max_tokens": args.max_tokens,
                   "precision": args.precision,
                   "warmup_batches": args.warmup, "timed_batches": len(timed), "rounds": rounds,
                   "timed_tgt_tokens": timed_tokens, "train_steps_before_decode": args.train_steps,
                   "label_smoothing": cfg.train.label_smoothing, "clip_norm": cfg.train.clip_norm,
                   "decode_sentences": len(sources), "decode_batches": len(src_batches), "beam": args.beam,
                   "len_penalty": 0.6, "max_len_a": 1.5, "max_len_b": 10, "decode_max_tokens": args.decode_max_tokens,
                   "lr_warmup": args.lr_warmup, "heap_headroom_mb": args.heap_headroom_mb, "seed": args.seed},
        "peak_rss_mb_by_phase": {k: round(v, 1) for k, v in rss.items()},
        "note": "peak RSS is process-wide (ru_maxrss): both systems live in one process, so a phase's value "
                "includes everything allocated before it",
    }
    for name, opt in systems.items():
        lengths = dec_lengths[name]
        result[name] = {
            "parameters": count_parameters(opt.model),
            "train_tgt_tokens_per_s": timed_tokens / seconds[name],
            "train_seconds": seconds[name],
            "train_loss_last": losses[name][-1],
            "decode_sentences_per_s": len(lengths) / dec_seconds[name],
            "decode_output_tokens_per_s": sum(n + 1 for n in lengths) / dec_seconds[name],
            "decode_seconds": dec_seconds[name],
            "decode_mean_output_len": sum(lengths) / len(lengths),
            "decode_frac_at_length_cap": sum(n >= c for n, c in zip(lengths, caps)) / len(lengths),
            "peak_rss_mb": rss[f"after_decode_{name}"],
        }
    a, b = result["nmtflow"], result["reference_nn_transformer"]
    result["ratios"] = {"train_tokens_per_s": a["train_tgt_tokens_per_s"] / b["train_tgt_tokens_per_s"],
                        "decode_sentences_per_s": a["decode_sentences_per_s"] / b["decode_sentences_per_s"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")

    rows = [("train tgt tokens/s", "train_tgt_tokens_per_s", "train_tokens_per_s"),
            ("decode sentences/s", "decode_sentences_per_s", "decode_sentences_per_s"),
            ("decode mean output len", "decode_mean_output_len", None),
            ("parameters", "parameters", None)]
    print(f"{'':24}{'nmtflow':>14}{'nn.Transformer':>16}{'ratio A/B':>11}")
    for label, key, ratio in rows:
        r = f"{result['ratios'][ratio]:>11.2f}" if ratio else ""
        fmt = ",.1f" if isinstance(a[key], float) else ","
        print(f"{label:24}{a[key]:>14{fmt}}{b[key]:>16{fmt}}{r}")
    print(f"peak RSS (process-wide): {max(rss.values()):.0f} MB; written to {args.out}")
    return result


if __name__ == "__main__":
    main()
