"""Beam-search translation speed of nmtflow against the same model exported to CTranslate2 (float32 and int8), CPU.

Usage (see benchmarks/README.md)::

    python benchmarks/ct2_export.py CHECKPOINT --src DATA/val.en --ref DATA/val.de \\
        --out benchmarks/results/ctranslate2.json

The checkpoint is exported with ``nmtflow export --to ctranslate2`` (float32 and int8) into ``--work``. Every system
translates the same SentencePiece-encoded sentences with the same search: beam ``--beam``, no length penalty
(nmtflow's GNMT penalty and CTranslate2's |y|^α agree only at α = 0), at most ``--max-len`` output tokens, no
minimum length, batches of ``--batch-tokens`` source tokens, ``--threads`` intra-op threads. Timed: ids in, ids out
(SentencePiece encoding and decoding, the same for all, are not). The systems run in turn, in an order that rotates
each round (A B C, B C A, C A B, ...), so that load from other processes hits all alike; sentences/s is the number
of sentences over the median of a system's round times. Also reported: the share of each CTranslate2 system's
outputs identical to nmtflow's, and the cased sacreBLEU of every system against ``--ref``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from nmtflow.config import DecodeConfig
from nmtflow.decode.export import export_ctranslate2, import_ctranslate2
from nmtflow.decode.translate import Translator
from nmtflow.evaluate.metrics import bleu
from nmtflow.runtime import keep_freed_memory, machine_info
from throughput import write_json


def ct2_system(out: Path, translator: Translator, args: argparse.Namespace) -> Callable[[list[list[int]]], list]:
    """A function: source ids → output ids, with CTranslate2 model ``out`` and nmtflow's search settings."""
    ct2 = import_ctranslate2().Translator(str(out), device="cpu", inter_threads=1, intra_threads=args.threads)
    src_piece = translator.src_tokenizer.piece
    tgt_id = {translator.tgt_tokenizer.piece(i): i for i in range(translator.tgt_tokenizer.vocab_size)}

    def run(sources: list[list[int]]) -> list[list[int]]:
        results = ct2.translate_batch([[src_piece(i) for i in s] for s in sources], beam_size=args.beam,
                                      length_penalty=0.0, max_decoding_length=args.max_len, min_decoding_length=0,
                                      max_batch_size=args.batch_tokens, batch_type="tokens")
        return [[tgt_id[p] for p in r.hypotheses[0]] for r in results]

    return run


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("checkpoint", type=Path, help="a bilingual nmtflow Transformer checkpoint")
    p.add_argument("--src", type=Path, required=True, help="raw source sentences, one per line")
    p.add_argument("--ref", type=Path, required=True, help="their references, for BLEU")
    p.add_argument("--limit", type=int, help="translate only the first N sentences")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--max-len", type=int, default=100, help="most output tokens (EOS not counted), both systems")
    p.add_argument("--batch-tokens", type=int, default=6000, help="source tokens per batch, both systems")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--work", type=Path, help="where the exports go (default: a temporary directory)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/ctranslate2.json"))
    args = p.parse_args(argv)
    keep_freed_memory()
    torch.set_num_threads(args.threads)
    lines = args.src.read_text(encoding="utf-8").splitlines()[:args.limit]
    refs = args.ref.read_text(encoding="utf-8").splitlines()[:args.limit]

    translator = Translator.from_checkpoint(args.checkpoint, decode=DecodeConfig(
        beam_size=args.beam, len_penalty=0.0, max_len_a=0.0, max_len_b=args.max_len, max_tokens=args.batch_tokens))
    sources = translator.encode_source(lines)
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        systems: dict[str, Callable[[list[list[int]]], list]] = {
            "nmtflow": lambda s: [h[0].tokens for h in translator.translate_ids(s)]}
        for quantization in ("float32", "int8"):
            out = export_ctranslate2(args.checkpoint, work / f"ct2-{quantization}", quantization=quantization,
                                     force=True)
            systems[f"ctranslate2-{quantization}"] = ct2_system(out, translator, args)
        names = list(systems)
        for name in names:  # untimed warm-up
            systems[name](sources[:8])
        seconds: dict[str, list[float]] = {name: [] for name in names}
        outputs: dict[str, list[list[int]]] = {}
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                start = time.perf_counter()
                outputs[name] = systems[name](sources)
                seconds[name].append(time.perf_counter() - start)
                print(f"round {r + 1} {name}: {seconds[name][-1]:.1f} s", file=sys.stderr)

    texts = {name: [translator.tgt_tokenizer.decode(o) for o in out] for name, out in outputs.items()}
    result: dict[str, Any] = {
        "machine": machine_info("cpu", threads=args.threads, ctranslate2=import_ctranslate2().__version__),
        "config": {"checkpoint": args.checkpoint.name, "src": args.src.name, "ref": args.ref.name,
                   "sentences": len(sources), "beam": args.beam, "len_penalty": 0.0, "max_len": args.max_len,
                   "batch_tokens": args.batch_tokens, "rounds": args.rounds},
    }
    for name in names:
        result[name] = {
            "sentences_per_s": len(sources) / statistics.median(seconds[name]),
            "seconds_per_round": [round(s, 3) for s in seconds[name]],
            "bleu": round(bleu(texts[name], refs).score, 2),
            "identical_to_nmtflow": sum(a == b for a, b in zip(outputs[name], outputs["nmtflow"])) / len(sources),
            "mean_output_tokens": sum(map(len, outputs[name])) / len(sources),
            "share_at_max_len": sum(len(o) >= args.max_len for o in outputs[name]) / len(sources),
        }
    for name in names[1:]:
        result[name]["speedup_over_nmtflow"] = result[name]["sentences_per_s"] / result["nmtflow"]["sentences_per_s"]
    write_json(args.out, result)
    print(f"{'':22}{'sent/s':>9}{'×nmtflow':>10}{'BLEU':>7}{'identical':>11}")
    for name in names:
        r = result[name]
        print(f"{name:22}{r['sentences_per_s']:9.2f}{r.get('speedup_over_nmtflow', 1.0):10.2f}{r['bleu']:7.2f}"
              f"{r['identical_to_nmtflow']:11.3f}")
    return result


if __name__ == "__main__":
    main()
