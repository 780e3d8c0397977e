"""bf16 against fp32 on a CPU: training speed and loss, beam-search speed and outputs (issue 26).

Usage (see benchmarks/README.md)::

    python benchmarks/bf16_cpu.py --data data/multi30k --out benchmarks/results/bf16-cpu.json

One model (``throughput.py``'s small 3+3-layer Transformer by default) is copied into systems that differ only in
precision, and trained on the same batches in alternating blocks (``throughput.py``'s ``timed_training``):
``fp32``; ``bf16`` (``train.precision: bf16``, autocast, as nmtflow trains); with ``--old-attention`` also
``bf16_sdpa_in_bf16``, the same with attention left to PyTorch's bf16 CPU kernel (nmtflow before it computed CPU
attention in fp32 under bf16); with ``--torch-dropout`` also ``fp32_torch_dropout`` and ``bf16_torch_dropout``,
with PyTorch's dropout masks instead of nmtflow's (:mod:`nmtflow.nn.dropout`). Then both main systems train
``--loss-updates`` more updates on the same batches and their validation loss (in fp32, on the first
``--valid-sentences`` pairs) is compared (``--decode-only`` skips training). Last, a model translates the first
``--decode-sentences`` validation sentences with beam search, alternating batch by batch between the decoding
systems: ``fp32``; ``bf16`` (``decode.precision: bf16``: the matrix modules in bf16, the embeddings, residual
sums, LayerNorms and output layer in fp32, :mod:`nmtflow.decode.precision`); the same copy with each step's
attention the other way than nmtflow chooses on this CPU (:func:`nmtflow.nn.attention.single_query_products`):
``bf16_fused_attention`` (PyTorch's fused kernel, as before) or ``bf16_single_query_attention``;
``bf16_whole_copy`` (the copy as nmtflow made it before: the whole model in bf16 but the output layer and, on the
CPU, the LayerNorms' parameters, so the residual stream in bf16); ``bf16_logits_in_bf16`` (the whole model in bf16,
the output layer too); ``bf16_autocast`` (fp32 weights under bf16 autocast). Reported: sentences/s, the speed over
fp32 in wall time and in this process's CPU time (less disturbed by other work on the machine) and the share of
outputs identical to fp32's. The model is the fp32-trained one of the training part, or, with
``--decode-checkpoint``, a trained checkpoint (its sources: ``DATA/val.SRC`` through its own tokenizer); with it,
``--decode-workers N`` also times ``Translator.translate_ids`` in fp32 and bf16 in this process and in N worker
processes (``decode.workers``), whole-set rounds alternating. The machine's load average is recorded before and
after (the timings need an idle CPU), and first one thread's fp32 and bf16 rates on a (2048 × 1024)·(1024 × 1024)
product, the most bf16 can gain where matrix products bound a step (``--matmul-only`` records only those).

On a CPU without native bf16 (neither AMX nor AVX-512 BF16) bf16 is emulated and many times slower: the script
then records the machine and skips, unless ``--force``.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

import nmtflow.nn.attention as attention
from nmtflow.config import DecodeConfig, load_config
from nmtflow.data.batching import Batch, TokenBatchSampler, collate
from nmtflow.data.bitext import open_bitext
from nmtflow.decode.precision import model_in_precision
from nmtflow.decode.search import beam_search
from nmtflow.decode.translate import Translator, batches_by_length
from nmtflow.models.base import EncoderDecoder, Vocabularies, build_model, count_parameters
from nmtflow.nn.dropout import torch_dropout
from nmtflow.runtime import autocast, cpu_info, machine_info
from nmtflow.train.loss import label_smoothed_nll
from throughput import Optimiser, add_common_args, default_work, prepared_data, training_batches, write_json
from throughput import timed_training as alternating_training


@contextmanager
def attention_in_bf16() -> Iterator[None]:
    """Attention through PyTorch's own CPU kernel in the autocast dtype, as before nmtflow computed it in fp32."""
    saved = attention.sdpa
    attention.sdpa = lambda q, k, v, mask, p, causal: torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=p, is_causal=causal)
    try:
        yield
    finally:
        attention.sdpa = saved


class OldAttention(Optimiser):
    def step(self, b: Batch) -> float:
        with attention_in_bf16():
            return super().step(b)


class TorchDropout(Optimiser):
    """Dropout masks from PyTorch's per-element Bernoulli draws (``F.dropout``), as before nmtflow's own CPU masks."""

    def step(self, b: Batch) -> float:
        with torch_dropout():
            return super().step(b)


@torch.no_grad()
def valid_nll(model: EncoderDecoder, batches: list[Batch]) -> float:
    """Mean NLL per target token in fp32."""
    model.eval()
    total, tokens = 0.0, 0
    for b in batches:
        _, nll = label_smoothed_nll(model(b.src, b.tgt_in), b.tgt_out, 0.0)
        total, tokens = total + float(nll), tokens + b.num_tgt_tokens
    model.train()
    return total / tokens


def whole_copy(model: EncoderDecoder) -> EncoderDecoder:
    """The bf16 decoding copy as nmtflow made it before: the whole model in bf16 but its output layers' weights and,
    on the CPU, its LayerNorms' parameters (float32, shared with ``model``)."""
    cast = copy.deepcopy(model).to(torch.bfloat16).eval()
    for mine, theirs in zip(cast.modules(), model.modules()):
        kept = ["output_weight"] + (["weight", "bias"] if isinstance(theirs, torch.nn.LayerNorm) else [])
        for name in kept:
            param = getattr(theirs, name, None)
            if isinstance(param, torch.nn.Parameter) and param.device.type == "cpu":
                setattr(mine, name, param)
    return cast


def decoding_systems(model: EncoderDecoder) -> dict[str, tuple[EncoderDecoder, str, bool]]:
    """name → (model, autocast precision, single-query attention) of each way to decode ``model`` (fp32 weights)
    compared here; single-query attention as nmtflow chooses it on this CPU
    (:func:`nmtflow.nn.attention.single_query_products`), and ``bf16`` the other way too: ``bf16_fused_attention``
    (each step's attention through PyTorch's fused kernel, as nmtflow did before) or ``bf16_single_query_attention``."""
    bf16 = model_in_precision(model, "bf16")
    default = attention.single_query_products()  # as nmtflow decodes on this CPU
    return {"fp32": (model, "fp32", default), "bf16": (bf16, "fp32", default),
            "bf16_fused_attention" if default else "bf16_single_query_attention": (bf16, "fp32", not default),
            "bf16_whole_copy": (whole_copy(model), "fp32", default),
            "bf16_logits_in_bf16": (copy.deepcopy(model).to(torch.bfloat16), "fp32", default),
            "bf16_autocast": (model, "bf16", default)}


@contextmanager
def single_query_products(enabled: bool) -> Iterator[None]:
    """Decoding steps' attention by :func:`nmtflow.nn.attention.single_query_attention` (True) or PyTorch's fused
    kernel (False) within the block."""
    saved = attention.SINGLE_QUERY_PRODUCTS
    attention.SINGLE_QUERY_PRODUCTS = enabled
    try:
        yield
    finally:
        attention.SINGLE_QUERY_PRODUCTS = saved


def timed_decoding(model: EncoderDecoder, sources: list[list[int]], args: argparse.Namespace,
                   device: torch.device) -> dict[str, Any]:
    """Beam search over ``sources`` with each of :func:`decoding_systems`, alternating batch by batch in rotating
    order (after one untimed batch each): sentences/s, speed over fp32 and the share of outputs identical to fp32's."""
    systems = decoding_systems(model.eval())
    src_batches = [collate([sources[i] for i in r], [[]] * len(r)).src
                   for r in batches_by_length([len(s) for s in sources], args.decode_max_tokens)]
    seconds = {name: 0.0 for name in systems}
    cpu_seconds = {name: 0.0 for name in systems}  # this process's CPU time: less disturbed by other processes
    outputs: dict[str, list[list[int]]] = {name: [] for name in systems}
    search = dict(beam_size=args.beam, len_penalty=0.6, max_len_a=1.5, max_len_b=10)
    with torch.inference_mode():
        for name, (decoder, precision, single) in systems.items():  # warm-up
            with autocast(precision, device), single_query_products(single):
                beam_search(decoder, src_batches[0][:8], **search)
        names = list(systems)
        for i, src in enumerate(src_batches):  # the order rotates: who meets a batch's shapes first compiles
            for name in names[i % len(names):] + names[:i % len(names)]:  # oneDNN's bf16 kernels for them
                decoder, precision, single = systems[name]
                start, cpu_start = time.perf_counter(), time.process_time()
                with autocast(precision, device), single_query_products(single):
                    hyps = beam_search(decoder, src, **search)
                seconds[name] += time.perf_counter() - start
                cpu_seconds[name] += time.process_time() - cpu_start
                outputs[name] += [h[0].tokens for h in hyps]
    result: dict[str, Any] = {}
    for name in systems:
        same = sum(a == b for a, b in zip(outputs["fp32"], outputs[name])) / len(sources)
        result[name] = {"sentences_per_s": len(sources) / seconds[name], "seconds": seconds[name],
                        "speed_over_fp32": seconds["fp32"] / seconds[name], "cpu_seconds": cpu_seconds[name],
                        "cpu_time_speed_over_fp32": cpu_seconds["fp32"] / cpu_seconds[name],
                        "identical_output_share": same}
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, help="directory with train.LANG and val.LANG (needed unless the CPU lacks "
                   "native bf16, where the script only records that, or with --decode-checkpoint --decode-only)")
    p.add_argument("--work", type=Path, help="prepared-data cache (default runs/bench-data-SRC-TGT, as throughput.py)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/bf16-cpu.json"))
    p.add_argument("--preset", default="small", choices=["small", "base"])
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--old-attention", action="store_true", help="also time bf16 with attention in PyTorch's bf16 kernel")
    p.add_argument("--torch-dropout", action="store_true",
                   help="also time fp32 and bf16 with PyTorch's dropout masks (F.dropout) instead of nmtflow's")
    p.add_argument("--loss-updates", type=int, default=150, help="updates of both systems before the loss check")
    p.add_argument("--lr-warmup", type=int, default=100)
    p.add_argument("--valid-sentences", type=int, default=500)
    p.add_argument("--decode-sentences", type=int, default=200)
    p.add_argument("--decode-max-tokens", type=int, default=6000)
    p.add_argument("--decode-checkpoint", type=Path, help="decode with this trained checkpoint (not the benchmark's "
                   "model); its sources: DATA/val.SRC through its tokenizer")
    p.add_argument("--decode-only", action="store_true", help="skip training: time decoding only")
    p.add_argument("--train-only", action="store_true", help="skip decoding: time training only")
    p.add_argument("--seen-shapes", action="store_true",
                   help="one untimed pass of every system over the timed batches first, so that the timed steps "
                        "meet batch shapes already seen, as every epoch after the first of a long run does")
    p.add_argument("--decode-workers", type=int, default=1,
                   help="with --decode-checkpoint: also time fp32 and bf16 decoding in N worker processes "
                        "(decode.workers) against one process")
    p.add_argument("--decode-rounds", type=int, default=3, help="rounds of --decode-workers' timing")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--force", action="store_true", help="run even where the CPU has no native bf16")
    p.add_argument("--matmul-only", action="store_true",
                   help="only record one thread's fp32 and bf16 matrix-product rates (the CPU's ceiling for bf16)")
    p.add_argument("--compile", action="store_true",
                   help="also time fp32 and bf16 with train.compile (each layer and the loss under torch.compile)")
    add_common_args(p, warmup=3, steps=24, rounds=4)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    result: dict[str, Any] = {"machine": machine_info(device, threads=torch.get_num_threads()),
                              "load_average_before": os.getloadavg()}
    if not cpu_info()["native_bf16"] and not args.force:
        result["skipped"] = "this CPU has no native bf16 (AMX or AVX-512 BF16): bf16 is emulated here"
        write_json(args.out, result)
        print(result["skipped"])
        return result
    result["matmul_gflops_1thread"] = matmul_rates()  # restores the thread count
    print("one thread, 2048×1024·1024×1024:", result["matmul_gflops_1thread"])
    if args.matmul_only:
        result["load_average_after"] = os.getloadavg()
        write_json(args.out, result)
        return result

    decode_only = args.decode_checkpoint is not None and args.decode_only  # no prepared data needed
    if args.data is None and not decode_only:
        p.error("--data is required (a directory with train.LANG and val.LANG)")
    if decode_only:
        result.update(decode_checkpoint(args, device))
        result["load_average_after"] = os.getloadavg()
        write_json(args.out, result)
        return result
    work = args.work or default_work(args)
    vocab = prepared_data(args, work)
    valid = open_bitext(work, "valid", args.src, args.tgt)

    def config(precision: str, compiled: bool = False) -> Any:
        return load_config(data={
            "model": {"name": "transformer", "preset": args.preset, "encoder_layers": args.layers,
                      "decoder_layers": args.layers, "dropout": 0.1, "tie_embeddings": True},
            "train": {"seed": args.seed, "label_smoothing": 0.1, "clip_norm": 1.0, "precision": precision,
                      "warmup_updates": args.lr_warmup, "compile": compiled}})

    torch.manual_seed(args.seed)
    model = build_model(config("fp32").model, Vocabularies(vocab, vocab, joint=True))
    result["config"] = {"data": args.data.name, "src": args.src, "tgt": args.tgt, "vocab_size": vocab,
                        "preset": args.preset, "layers": args.layers, "parameters": count_parameters(model),
                        "seed": args.seed}
    if not args.decode_only:
        result.update(timed_training(args, model, config, work, valid, device))
    if args.decode_checkpoint is not None and not args.train_only:
        result.update(decode_checkpoint(args, device))
    elif not args.train_only:
        sources = [valid.src[i].tolist() for i in range(min(args.decode_sentences, len(valid)))]
        result["decode"] = timed_decoding(model, sources, args, device)
        result["config"].update(decode_sentences=len(sources), beam=args.beam,
                                decode_model="the fp32 system after the training part" if not args.decode_only
                                else "untrained")
    result["load_average_after"] = os.getloadavg()
    write_json(args.out, result)
    return result


def matmul_rates(m: int = 2048, k: int = 1024, n: int = 1024, repeats: int = 20) -> dict[str, float]:
    """GFLOP/s (2mkn per product) of one thread multiplying (m × k)·(k × n) in fp32 and in bf16, the best of
    ``repeats`` after a warm-up: the most bf16 can gain over fp32 in a step bound by its matrix products."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rates = {}
    try:
        for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
            a, b = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
            for _ in range(3):
                a @ b
            best = float("inf")
            for _ in range(repeats):
                start = time.perf_counter()
                a @ b
                best = min(best, time.perf_counter() - start)
            rates[name] = round(2 * m * k * n / best / 1e9, 1)
    finally:
        torch.set_num_threads(threads)
    rates["bf16_over_fp32"] = round(rates["bf16"] / rates["fp32"], 2)
    return rates


def decode_checkpoint(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """``timed_decoding`` of ``--decode-checkpoint`` on the first ``--decode-sentences`` lines of DATA/val.SRC, and
    with ``--decode-workers N`` also :func:`timed_worker_decoding`."""
    translator = Translator.from_checkpoint(args.decode_checkpoint, device)
    lines = (args.data / f"val.{args.src}").read_text(encoding="utf-8").splitlines()[:args.decode_sentences]
    sources = translator.encode_source(lines)
    result = {"decode": timed_decoding(translator.model, sources, args, device),
              "decode_config": {"checkpoint": args.decode_checkpoint.name,
                                "model": translator.config.model.name if translator.config else "?",
                                "parameters": count_parameters(translator.model), "decode_sentences": len(sources),
                                "beam": args.beam}}
    if args.decode_workers > 1:
        result["decode_workers"] = timed_worker_decoding(translator, sources, args)
    return result


def timed_worker_decoding(translator: Translator, sources: list[list[int]], args: argparse.Namespace) -> dict:
    """``Translator.translate_ids`` over ``sources`` (beam ``--beam``, batches of ``--decode-max-tokens``), fp32 and
    bf16 (``decode.precision``), each in this process (``--threads`` threads) and in ``--decode-workers`` worker
    processes (``decode.workers``: the threads shared out among them); every system decodes the whole set once per
    round, alternating over ``--decode-rounds`` rounds, after a warm-up that starts the workers. Sentences/s, speed
    over fp32 in this process, share of outputs identical to that system's."""
    workers = args.decode_workers
    base = DecodeConfig(beam_size=args.beam, len_penalty=0.6, max_len_a=1.5, max_len_b=10,
                        max_tokens=args.decode_max_tokens)
    systems = {f"{precision}{'' if n == 1 else f'_{n}_workers'}":
               Translator(translator.model, translator.src_tokenizer, translator.tgt_tokenizer,
                          dataclasses.replace(base, precision=precision, workers=n))
               for n in (1, workers) for precision in ("fp32", "bf16")}
    for t in systems.values():  # warm-up: the workers started, each given a batch (its bf16 copy made)
        if t.decode.workers > 1:
            pool = t.decode_pool()
            for future in [pool.submit(sources[:16], None, t.decode, None) for _ in range(workers)]:
                future.result()
        t.translate_ids(sources[:16])
    seconds = {name: 0.0 for name in systems}
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.decode_rounds):
        for name, t in systems.items():
            start = time.perf_counter()
            hyps = t.translate_ids(sources)
            seconds[name] += time.perf_counter() - start
            outputs[name] = [h[0].tokens for h in hyps]
    for t in systems.values():
        t.close()
    total = len(sources) * args.decode_rounds
    return {"workers": workers, "threads": torch.get_num_threads(),
            "threads_per_worker": max(1, torch.get_num_threads() // workers), "rounds": args.decode_rounds,
            "systems": {name: {"sentences_per_s": total / seconds[name], "seconds": seconds[name],
                               "speed_over_fp32": seconds["fp32"] / seconds[name],
                               "identical_to_fp32": sum(a == b for a, b in zip(outputs["fp32"], outputs[name]))
                               / len(sources)}
                        for name in systems}}


def timed_training(args: argparse.Namespace, model: EncoderDecoder, config: Callable[[str], Any], work: Path,
                   valid: Any, device: torch.device) -> dict[str, Any]:
    """Training speed of fp32 and bf16 (and bf16 with attention in bf16) on the same batches, then the validation
    loss of both after ``--loss-updates`` more; the fp32 system's model is trained in place."""
    count = args.warmup + args.steps + args.loss_updates
    batches = training_batches(work, args, count, device)
    warm, timed = batches[:args.warmup], batches[args.warmup:args.warmup + args.steps]
    more = batches[args.warmup + args.steps:]
    rows = list(range(min(args.valid_sentences, len(valid))))
    sampler = TokenBatchSampler(valid.src.sizes[rows], valid.tgt.sizes[rows], args.max_tokens, shuffle=False)
    valid_batches = [valid.batch(idx) for idx in sampler.batches(1)]
    systems: dict[str, Optimiser] = {"fp32": Optimiser(model, config("fp32").train),
                                     "bf16": Optimiser(copy.deepcopy(model), config("bf16").train)}
    if args.old_attention:
        systems["bf16_sdpa_in_bf16"] = OldAttention(copy.deepcopy(model), config("bf16").train)
    if args.torch_dropout:
        for precision in ("fp32", "bf16"):
            systems[f"{precision}_torch_dropout"] = TorchDropout(copy.deepcopy(model), config(precision).train)
    compile_seconds = {}
    if args.compile:  # every shape class these batches need is compiled (on a throwaway copy) before any is timed
        for precision in ("fp32", "bf16"):
            name, tc = f"{precision}_compiled", config(precision, compiled=True).train
            start = time.perf_counter()
            throwaway = Optimiser(copy.deepcopy(model), tc)  # the compiled graphs are per layer class: kept
            for b in warm + timed:
                throwaway.step(b)
            compile_seconds[name] = time.perf_counter() - start
            systems[name] = Optimiser(copy.deepcopy(model), tc)

    # 1. training speed on the same batches, alternating blocks
    if args.seen_shapes:  # oneDNN compiles a bf16 kernel per new matrix shape and caches it (nmtflow/__init__.py)
        for opt in systems.values():
            for b in timed:
                opt.step(b)
    seconds, _, _ = alternating_training(systems, warm, timed, args.rounds, device)
    tokens = sum(b.num_tgt_tokens for b in timed)
    train = {name: {"tgt_tokens_per_s": tokens / s, "seconds": s} for name, s in seconds.items()}
    for name in train:
        train[name]["speed_over_fp32"] = seconds["fp32"] / seconds[name]

    for name, s in compile_seconds.items():
        train[name]["compile_pass_seconds"] = s

    # 2. validation loss after the same updates
    checked = ("fp32", "bf16", "bf16_compiled") if args.compile else ("fp32", "bf16")
    for b in more:
        for name in checked:
            systems[name].step(b)
    loss = {name: valid_nll(systems[name].model, valid_batches) for name in checked}
    return {"train_config": {"max_tokens": args.max_tokens, "warmup_batches": len(warm), "timed_batches": len(timed),
                             "seen_shapes": args.seen_shapes,
                             "rounds": args.rounds, "timed_tgt_tokens": tokens, "loss_updates": len(batches),
                             "lr_warmup": args.lr_warmup, "valid_sentences": len(rows)},
            "train": train,
            "valid_nll_after_updates": {**loss, **{f"{name}_relative_difference": loss[name] / loss["fp32"] - 1
                                                    for name in checked[1:]}}}


if __name__ == "__main__":
    r = main()
    print(json.dumps({k: r[k] for k in ("train", "valid_nll_after_updates", "decode", "load_average_before",
                                        "load_average_after") if k in r}, indent=1))
