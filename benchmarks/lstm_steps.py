"""The LSTMs' own steps against ``nn.LSTM``, in the attention-bridge model (its decoders and BiLSTM encoders).

Usage (see benchmarks/README.md)::

    python benchmarks/lstm_steps.py --data PREPARED --out benchmarks/results/lstm-steps.json

``PREPARED`` is a prepared multi-way directory with separate vocabularies, e.g. a Table 1 comparison's ``OUT/data``
(``nmtflow compare experiments/bridge-table1.yaml``) or ``nmtflow prepare --separate-vocab``; without ``--data``
the built-in synthetic corpus is prepared into ``--work``. System ``now`` is the model with its defaults: in CPU
training the decoders step with :meth:`~nmtflow.models.rnn.LuongDecoder.run_steps` and, under bf16 autocast, the
encoders with :meth:`~nmtflow.models.rnn.BiLSTMEncoder.run_steps`; in decoding both use ``nn.LSTM``. System
``before`` is the same model as nmtflow ran it before (``own_steps=False``): decoders calling ``nn.LSTM`` on each
step, encoders ``nn.LSTM`` over packed sequences. Both train from the same initial weights on the same batches of
``configs/bridge-m30k.yaml`` (``--pairs``), in alternating blocks (A, B, A, B, ...), per precision; then the weights
``now`` trained (or a trained ``--decode-checkpoint``, bilingual or multilingual, on ``--decode-src``) decode
``--decode-sentences`` sentences greedily and with beam ``--beam``, with ``decode.precision`` fp32 and bf16 (a bf16
copy of the weights), its decoders stepping by ``run_steps`` and by ``nn.LSTM`` in turn (``--decode-rounds``
times); the share of identical outputs is recorded.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import nmtflow
from nmtflow.config import load_config
from nmtflow.data.prepare import prepare
from nmtflow.data.synthetic import generate_corpus
from nmtflow.decode.precision import model_in_precision
from nmtflow.decode.translate import Translator
from nmtflow.models.rnn import BiLSTMEncoder, LuongDecoder
from nmtflow.runtime import machine_info
from nmtflow.train.multilingual import MultilingualTrainer
from bridge import time_in_blocks  # the sibling benchmarks' helpers
from throughput import device_option, prepare_once


def set_own_steps(model: torch.nn.Module, value: bool | None,
                  kinds: tuple[type, ...] = (LuongDecoder, BiLSTMEncoder)) -> None:
    """``own_steps`` of every module of ``kinds`` in ``model`` (None: the default)."""
    for m in model.modules():
        if isinstance(m, kinds):
            m.own_steps = value


def run_as_before(model: torch.nn.Module, before: bool, own_steps: bool = False) -> None:
    """Make ``model``'s LSTMs run as before (decoders calling nn.LSTM on each step, encoders nn.LSTM over packed
    sequences) or as now (the defaults: the decoders' own steps in CPU training, the encoders' under bf16 autocast
    too; nn.LSTM in decoding; with ``own_steps`` (``--own-steps``) the own steps everywhere)."""
    set_own_steps(model, False if before else (True if own_steps else None))


def prepared(args: argparse.Namespace) -> Path:
    if args.data is not None:
        return args.data
    langs = sorted({lang for pair in args.pairs for lang in pair.split("-")})
    work = args.work

    def make() -> None:
        raw = work.parent / f"{work.name}-raw"
        generate_corpus(raw, langs=langs, n_train=args.n_train, n_valid=200, n_test=10, seed=1)
        prepare({"train": str(raw / "train"), "valid": str(raw / "valid")}, langs, work, vocab_size=args.vocab_size,
                joint=False, progress=False)

    prepare_once(work, langs, make)
    return work


def trainer(args: argparse.Namespace, data: Path, precision: str, save_dir: Path) -> MultilingualTrainer:
    config = load_config("bridge-m30k", [
        f"data.path={data}", f"data.multilingual.pairs=[{', '.join(args.pairs)}]", f"train.save_dir={save_dir}",
        f"train.threads={args.threads}", f"train.device={args.device}", f"train.precision={precision}",
        "train.progress=false", "train.seed=1"])
    torch.manual_seed(1)
    return MultilingualTrainer(config, resume=False)


def train_both(args: argparse.Namespace, data: Path, precision: str, tmp: Path) -> tuple[dict[str, Any], Any]:
    trainers = {name: trainer(args, data, precision, tmp / f"{precision}-{name}") for name in ("now", "before")}
    run_as_before(trainers["before"].model, True)
    run_as_before(trainers["now"].model, False, args.own_steps)
    stream = trainers["now"].batches()
    batches = [next(stream)[2] for _ in range(args.warmup + args.steps)]
    results: dict[str, Any] = {name: {} for name in trainers}
    for name, t in trainers.items():
        for b in batches[:args.warmup]:
            t.train_step([b])
    time_in_blocks(trainers, {name: batches for name in trainers}, args, results)
    for r in results.values():
        r["train_tgt_tokens_per_s"] = r["tokens"] / max(r["seconds"], 1e-9)
    results["ratio_now_over_before"] = (results["now"]["train_tgt_tokens_per_s"]
                                        / results["before"]["train_tgt_tokens_per_s"])
    return results, trainers["now"]


@torch.no_grad()
def decode_both(args: argparse.Namespace, model: torch.nn.Module, translator: Translator, sources: list[list[int]],
                precision: str) -> dict[str, Any]:
    """Greedy and beam search over ``sources`` with ``decode.precision: precision``, the decoders stepping by
    ``run_steps`` (``own_steps``) and by ``nn.LSTM`` (``nn_lstm``, the default in decoding), in alternation."""
    model.eval()
    out: dict[str, Any] = {"sentences": len(sources)}
    for search, beam in (("greedy", 1), (f"beam{args.beam}", args.beam)):
        decoding = replace(translator, decode=replace(translator.decode, beam_size=beam, greedy=beam == 1, nbest=1,
                                                      precision=precision))
        seconds = {"own_steps": 0.0, "nn_lstm": 0.0}
        outputs: dict[str, list[list[int]]] = {}
        for _ in range(args.decode_rounds):
            for name in seconds:
                for m in (model, model_in_precision(model, precision)):
                    set_own_steps(m, name == "own_steps", kinds=(LuongDecoder,))
                start = time.perf_counter()
                hyps = decoding.translate_ids(sources)
                if args.device.startswith("cuda"):
                    torch.cuda.synchronize()
                seconds[name] += time.perf_counter() - start
                outputs[name] = [h[0].tokens for h in hyps]
        run_as_before(model, False, args.own_steps)
        same = sum(a == b for a, b in zip(outputs["own_steps"], outputs["nn_lstm"])) / len(sources)
        rate = {name: args.decode_rounds * len(sources) / s for name, s in seconds.items()}
        out[search] = {"sentences_per_s": rate, "ratio_own_steps_over_nn_lstm": rate["own_steps"] / rate["nn_lstm"],
                       "identical_outputs": same}
    return out


def trained_translator(args: argparse.Namespace) -> tuple[Translator, list[list[int]]]:
    """``--decode-checkpoint``'s translator of ``--decode-direction`` and the first ``--decode-sentences`` lines of
    ``--decode-src`` as ids."""
    src, tgt = args.decode_direction.split("-") if args.decode_direction else (None, None)
    translator = nmtflow.load(args.decode_checkpoint, device=args.device, src_lang=src,
                              tgt_lang=tgt).translator(src, tgt)
    lines = args.decode_src.read_text(encoding="utf-8").splitlines()[:args.decode_sentences]
    return translator, translator.src_tokenizer.encode_batch(lines)


def shown(path: Path) -> str:
    """A path as the JSON records it: as given where relative, else ``…/`` and its last three components (not the
    machine's directories)."""
    return str(path) if not path.is_absolute() else "…/" + "/".join(path.parts[-3:])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data", type=Path, help="prepared multi-way directory, separate vocabularies (see above)")
    p.add_argument("--work", type=Path, default=Path("runs/bench-lstm-steps"), help="synthetic data cache")
    p.add_argument("--n-train", type=int, default=5000, help="synthetic corpus size (without --data)")
    p.add_argument("--vocab-size", type=int, default=2000, help="per language (without --data)")
    p.add_argument("--pairs", nargs="+", default=["de-en", "en-de"])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/lstm-steps.json"))
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--warmup", type=int, default=3, help="untimed training batches per system")
    p.add_argument("--steps", type=int, default=24, help="timed training batches per system")
    p.add_argument("--rounds", type=int, default=4, help="alternating A/B blocks the timed steps are split into")
    p.add_argument("--decode-checkpoint", type=Path, help="decode with this trained bridge or rnn checkpoint "
                   "(default: the weights the timed steps trained, on the first pair's validation set)")
    p.add_argument("--decode-src", type=Path, help="source sentences for --decode-checkpoint, one per line")
    p.add_argument("--decode-direction", help="SRC-TGT of a multilingual --decode-checkpoint, e.g. de-en")
    p.add_argument("--decode-sentences", type=int, default=200)
    p.add_argument("--decode-rounds", type=int, default=3, help="decode the sentences this many times (alternating)")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu", type=device_option)
    p.add_argument("--own-steps", action="store_true", help="system now runs the own steps wherever it trains, not "
                   "the defaults (which keep nn.LSTM on a GPU): to measure them there")
    args = p.parse_args(argv)
    if bool(args.decode_checkpoint) != bool(args.decode_src):
        p.error("--decode-checkpoint and --decode-src go together")
    torch.set_num_threads(args.threads)
    machine = machine_info(args.device, threads=args.threads)
    if "bf16" in args.precisions and args.device == "cpu" and not machine["native_bf16"]:
        print("this CPU has no native bf16 (amx_bf16 / avx512_bf16): bf16 skipped")
        args.precisions = [x for x in args.precisions if x != "bf16"]
    data = prepared(args)
    report: dict[str, Any] = {"machine": machine, "systems": {
        "now": "the defaults: the decoders' own steps in CPU training, the encoders' in CPU training under bf16 "
               "autocast (run_steps); nn.LSTM in decoding",
        "before": "the decoders call nn.LSTM on each step, the encoders nn.LSTM over packed sequences "
                  "(own_steps=False)"},
                              "config": {k: (shown(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    trained = trained_translator(args) if args.decode_checkpoint else None
    with tempfile.TemporaryDirectory() as tmp:
        for precision in args.precisions:
            train, t = train_both(args, data, precision, Path(tmp))
            if trained is None:  # the weights just trained, the first pair's validation sources
                direction = t.valid_data.directions[0]
                bitext = t.valid_data.bitexts[0]
                n = min(args.decode_sentences, t.valid_data.limits[0])
                translator = t.translator(direction)
                sources = [bitext.src[i].tolist() for i in range(n)]
            else:
                translator, sources = trained
            report[precision] = {"train": train, "decode": decode_both(args, translator.model, translator, sources,
                                                                       precision)}
            r = report[precision]
            ratio = train["ratio_now_over_before"]
            print(f"{precision}: training {train['now']['train_tgt_tokens_per_s']:.0f} vs "
                  f"{train['before']['train_tgt_tokens_per_s']:.0f} tgt tok/s (×{ratio:.2f})"
                  + "".join(f"; {s} own steps ×{r['decode'][s]['ratio_own_steps_over_nn_lstm']:.2f} "
                            f"({100 * r['decode'][s]['identical_outputs']:.1f}% identical)"
                            for s in ("greedy", f"beam{args.beam}")))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
