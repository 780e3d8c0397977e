"""bf16 against fp32 on a CPU: training speed and loss, beam-search speed and outputs (issue 26).

Usage (see benchmarks/README.md)::

    python benchmarks/bf16_cpu.py --data data/multi30k --out benchmarks/results/bf16-cpu.json

One model (``throughput.py``'s small 3+3-layer Transformer by default) is copied into systems that differ only in
precision, and trained on the same batches in alternating blocks (``throughput.py``'s ``timed_training``):
``fp32``; ``bf16`` (``train.precision: bf16``, autocast, as nmtflow trains); with ``--old-attention`` also
``bf16_sdpa_in_bf16``, the same with attention left to PyTorch's bf16 CPU kernel (nmtflow before it computed CPU
attention in fp32 under bf16). Then both main systems train ``--loss-updates`` more updates on the same batches and
their validation loss (in fp32, on the first ``--valid-sentences`` pairs) is compared. Last, the fp32-trained model
translates the first ``--decode-sentences`` validation sentences with beam search in fp32 and under bf16 autocast
(which ``nmtflow translate`` does not offer yet), alternating batch by batch: sentences/s and the share of identical
outputs.

On a CPU without native bf16 (neither AMX nor AVX-512 BF16) bf16 is emulated and many times slower: the script
then records the machine and skips, unless ``--force``.
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

import nmtflow.nn.attention as attention
from nmtflow.config import load_config
from nmtflow.data.batching import Batch, TokenBatchSampler, collate
from nmtflow.data.bitext import open_bitext
from nmtflow.decode.search import beam_search
from nmtflow.decode.translate import batches_by_length
from nmtflow.models.base import EncoderDecoder, Vocabularies, build_model, count_parameters
from nmtflow.runtime import autocast, cpu_info, machine_info
from nmtflow.train.loss import label_smoothed_nll
from throughput import (Optimiser, add_common_args, default_work, prepared_data, timed_training, training_batches,
                        write_json)


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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, required=True, help="directory with train.LANG and val.LANG")
    p.add_argument("--work", type=Path, help="prepared-data cache (default runs/bench-data-SRC-TGT, as throughput.py)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/bf16-cpu.json"))
    p.add_argument("--preset", default="small", choices=["small", "base"])
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--old-attention", action="store_true", help="also time bf16 with attention in PyTorch's bf16 kernel")
    p.add_argument("--loss-updates", type=int, default=150, help="updates of both systems before the loss check")
    p.add_argument("--lr-warmup", type=int, default=100)
    p.add_argument("--valid-sentences", type=int, default=500)
    p.add_argument("--decode-sentences", type=int, default=200)
    p.add_argument("--decode-max-tokens", type=int, default=6000)
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--force", action="store_true", help="run even where the CPU has no native bf16")
    add_common_args(p, warmup=3, steps=24, rounds=4)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    result: dict[str, Any] = {"machine": machine_info(device, threads=torch.get_num_threads())}
    if not cpu_info()["native_bf16"] and not args.force:
        result["skipped"] = "this CPU has no native bf16 (AMX or AVX-512 BF16): bf16 is emulated here"
        write_json(args.out, result)
        print(result["skipped"])
        return result

    work = args.work or default_work(args)
    vocab = prepared_data(args, work)
    count = args.warmup + args.steps + args.loss_updates
    batches = training_batches(work, args, count, device)
    warm, timed = batches[:args.warmup], batches[args.warmup:args.warmup + args.steps]
    more = batches[args.warmup + args.steps:]
    valid = open_bitext(work, "valid", args.src, args.tgt)
    rows = list(range(min(args.valid_sentences, len(valid))))
    sampler = TokenBatchSampler(valid.src.sizes[rows], valid.tgt.sizes[rows], args.max_tokens, shuffle=False)
    valid_batches = [valid.batch(idx) for idx in sampler.batches(1)]

    def config(precision: str) -> Any:
        return load_config(data={
            "model": {"name": "transformer", "preset": args.preset, "encoder_layers": args.layers,
                      "decoder_layers": args.layers, "dropout": 0.1, "tie_embeddings": True},
            "train": {"seed": args.seed, "label_smoothing": 0.1, "clip_norm": 1.0, "precision": precision,
                      "warmup_updates": args.lr_warmup}})

    torch.manual_seed(args.seed)
    model = build_model(config("fp32").model, Vocabularies(vocab, vocab, joint=True))
    systems: dict[str, Optimiser] = {"fp32": Optimiser(model, config("fp32").train),
                                     "bf16": Optimiser(copy.deepcopy(model), config("bf16").train)}
    if args.old_attention:
        systems["bf16_sdpa_in_bf16"] = OldAttention(copy.deepcopy(model), config("bf16").train)

    # 1. training speed on the same batches, alternating blocks
    seconds, _, _ = timed_training(systems, warm, timed, args.rounds, device)
    tokens = sum(b.num_tgt_tokens for b in timed)
    train = {name: {"tgt_tokens_per_s": tokens / s, "seconds": s} for name, s in seconds.items()}
    for name in train:
        train[name]["speed_over_fp32"] = seconds["fp32"] / seconds[name]

    # 2. validation loss after the same updates
    for b in more:
        for name in ("fp32", "bf16"):
            systems[name].step(b)
    updates = len(warm) + len(timed) + len(more)
    loss = {name: valid_nll(systems[name].model, valid_batches) for name in ("fp32", "bf16")}

    # 3. beam search with the fp32-trained model, in fp32 and under bf16 autocast, alternating per batch
    decoder = systems["fp32"].model.eval()
    sources = [valid.src[i].tolist() for i in range(min(args.decode_sentences, len(valid)))]
    src_batches = [collate([sources[i] for i in r], [[]] * len(r)).src
                   for r in batches_by_length([len(s) for s in sources], args.decode_max_tokens)]
    dec_seconds = {"fp32": 0.0, "bf16": 0.0}
    outputs: dict[str, list[list[int]]] = {"fp32": [], "bf16": []}
    with torch.inference_mode():
        for src in src_batches:
            for name in ("fp32", "bf16"):
                start = time.perf_counter()
                with autocast(name, device):
                    hyps = beam_search(decoder, src, beam_size=args.beam, len_penalty=0.6, max_len_a=1.5,
                                       max_len_b=10)
                dec_seconds[name] += time.perf_counter() - start
                outputs[name] += [h[0].tokens for h in hyps]
    same = sum(a == b for a, b in zip(outputs["fp32"], outputs["bf16"])) / len(sources)

    result.update({
        "config": {"data": args.data.name, "src": args.src, "tgt": args.tgt, "vocab_size": vocab,
                   "preset": args.preset, "layers": args.layers, "parameters": count_parameters(model),
                   "max_tokens": args.max_tokens, "warmup_batches": len(warm), "timed_batches": len(timed),
                   "rounds": args.rounds, "timed_tgt_tokens": tokens, "loss_updates": updates,
                   "lr_warmup": args.lr_warmup, "valid_sentences": len(rows), "decode_sentences": len(sources),
                   "beam": args.beam, "seed": args.seed},
        "train": train,
        "valid_nll_after_updates": {**loss, "bf16_relative_difference": loss["bf16"] / loss["fp32"] - 1},
        "decode": {name: {"sentences_per_s": len(sources) / s, "seconds": s} for name, s in dec_seconds.items()},
    })
    result["decode"]["bf16"]["speed_over_fp32"] = dec_seconds["fp32"] / dec_seconds["bf16"]
    result["decode"]["identical_output_share"] = same
    write_json(args.out, result)
    return result



if __name__ == "__main__":
    r = main()
    if "train" in r:
        print(json.dumps({"train": r["train"], "valid_nll": r["valid_nll_after_updates"], "decode": r["decode"]},
                         indent=1))
