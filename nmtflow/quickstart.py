"""``nmtflow quickstart``: the main job, end to end on the built-in corpus, on a laptop CPU.

generate the synthetic en/de/fr corpus → prepare en→de (joint SentencePiece) → train a small
Transformer for a wall-clock budget → beam-search the test split → print sacreBLEU, chrF and examples.
"""
from __future__ import annotations

import copy
import logging
import math
import time
from pathlib import Path

from nmtflow.config import load_config
from nmtflow.data.corpus import CleanConfig

log = logging.getLogger("nmtflow.quickstart")

QUICKSTART_CONFIG = {
    "model": {"name": "transformer", "preset": "small", "encoder_layers": 3, "decoder_layers": 3},
    "data": {"src_lang": "en", "tgt_lang": "de", "max_tokens": 2048},
    "train": {"lr": 1e-3, "warmup_updates": 150, "max_updates": 100_000, "validate_every": 150,
              "valid_bleu_max_sentences": 200, "save_every": 150, "log_every": 50, "label_smoothing": 0.1},
    "decode": {"beam_size": 5},
}


def check_options(minutes: float, threads: int | None) -> None:
    """A ``ValueError`` naming the option for a budget that is not a positive finite number of minutes, or a
    thread count below 1."""
    if not (isinstance(minutes, (int, float)) and math.isfinite(minutes) and minutes > 0):
        raise ValueError(f"--minutes: the training budget must be a positive number of minutes, got {minutes}")
    if threads is not None and threads < 1:
        raise ValueError(f"--threads: must be >= 1 (or left out for the default), got {threads}")


def quickstart_config(workdir: Path, minutes: float, threads: int | None) -> dict:
    """:data:`QUICKSTART_CONFIG` with the paths under ``workdir`` and the budget set as values, not as
    ``KEY=VALUE`` overrides, which would read a directory name as YAML (``#`` starts a comment there)."""
    raw = copy.deepcopy(QUICKSTART_CONFIG)
    raw["data"]["path"] = str(workdir / "data-en-de")
    raw["train"].update(save_dir=str(workdir / "model"), max_minutes=float(minutes))
    if threads is not None:
        raw["train"]["threads"] = int(threads)
    return raw


def run_quickstart(workdir: Path, minutes: float = 6.0, threads: int | None = None) -> float:
    """Run the whole pipeline in ``workdir``; returns the test BLEU. Reruns reuse finished steps.

    The options are checked, and the training config built, before any data is generated or prepared.
    """
    from nmtflow.data.prepare import prepare
    from nmtflow.data.synthetic import generate_corpus
    from nmtflow.decode.translate import Translator
    from nmtflow.evaluate.metrics import bleu, chrf
    from nmtflow.train.trainer import Trainer

    check_options(minutes, threads)
    t0 = time.perf_counter()
    corpus, data = workdir / "corpus", workdir / "data-en-de"
    config = load_config(data=quickstart_config(workdir, minutes, threads))
    if not (corpus / "test.de").is_file():
        counts = generate_corpus(corpus)
        log.info("generated the built-in corpus in %s: %s", corpus, counts)
    if not (data / "meta.json").is_file():
        prepare({"train": str(corpus / "train"), "valid": str(corpus / "valid"), "test": str(corpus / "test")},
                ["en", "de"], data, vocab_size=2000, joint=True, clean=CleanConfig())
    stopped = Trainer(config).train().progress.stopped
    if stopped.startswith("interrupted"):  # Ctrl-C: the checkpoint is saved; the same command continues
        raise KeyboardInterrupt

    translator = Translator.from_checkpoint(workdir / "model" / "checkpoint_best.pt")
    sources = (corpus / "test.en").read_text(encoding="utf-8").splitlines()
    refs = (corpus / "test.de").read_text(encoding="utf-8").splitlines()
    t1 = time.perf_counter()
    hyps = [nb[0][0] for nb in translator.translate(sources)]
    decode_s = time.perf_counter() - t1
    (workdir / "test.hyp.de").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    b, c = bleu(hyps, refs), chrf(hyps, refs)
    print("\nExample translations (test split, en→de):")
    for src, hyp, ref in list(zip(sources, hyps, refs))[:5]:
        print(f"  SRC {src}\n  HYP {hyp}\n  REF {ref}\n")
    print(f"test set: {len(sources)} sentences, beam {translator.decode.beam_size}, "
          f"{len(sources) / decode_s:.1f} sentences/s")
    print(b)
    print(c)
    print(f"quickstart finished in {(time.perf_counter() - t0) / 60:.1f} min; model in {workdir / 'model'}")
    return b.score
