"""Perplexity of a model on a prepared split: exp(mean NLL per target token, EOS included, natural log).

For a language model (``nmtflow.models.lm``) this is its corpus perplexity; for a translation model the
conditional perplexity of the references given the sources.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from nmtflow.data.batching import TokenBatchSampler
from nmtflow.data.bitext import Bitext, check_sentence_lengths, open_bitext
from nmtflow.data.prepare import load_meta
from nmtflow.data.tokenizer import same_model
from nmtflow.decode.translate import Translator
from nmtflow.evaluate.metrics import perplexity
from nmtflow.models.base import EncoderDecoder, device_of, position_limits
from nmtflow.train.loss import label_smoothed_nll


@dataclass
class PerplexityResult:
    nll: float  # mean negative log-likelihood per target token (nats)
    ppl: float
    tokens: int  # target tokens scored (EOS included)
    sentences: int


@torch.no_grad()
def corpus_perplexity(model: EncoderDecoder, data: Bitext, max_tokens: int = 4096) -> PerplexityResult:
    """Teacher-forced NLL of every target token of ``data`` under ``model`` (in eval mode)."""
    model.eval()
    device = device_of(model)
    sampler = TokenBatchSampler(data.src.sizes, data.tgt.sizes, max_tokens, shuffle=False,
                                src_prefix_len=int(data.src_prefix is not None))
    nll_sum, tokens = 0.0, 0
    for idx in sampler.batches(1):
        b = data.batch(idx).to(device)
        _, nll = label_smoothed_nll(model(b.src, b.tgt_in), b.tgt_out, 0.0)
        nll_sum += float(nll)
        tokens += b.num_tgt_tokens
    return PerplexityResult(nll_sum / max(tokens, 1), perplexity(nll_sum, tokens), tokens, len(data))


def checkpoint_perplexity(checkpoint: str | Path | list[str | Path], data_dir: str | Path, split: str = "valid", *,
                          max_tokens: int | None = None, device: str | torch.device = "cpu",
                          src_lang: str | None = None, tgt_lang: str | None = None) -> dict[str, Any]:
    """Perplexity of a checkpoint on ``data_dir``'s ``split``, in the checkpoint's language direction, or in
    ``src_lang → tgt_lang`` (a direction of a multilingual checkpoint; a bilingual one accepts its own).

    The data must be tokenised with the checkpoint's own SentencePiece model (else the ids mean other pieces).
    Several checkpoints: the perplexity of their ensemble (:mod:`nmtflow.decode.ensemble`).
    """
    from nmtflow.decode.ensemble import open_translators

    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"--batch-tokens {max_tokens}: must be >= 1")
    paths = checkpoint if isinstance(checkpoint, list) else [checkpoint]
    translator = open_translators(paths, device, src_lang, tgt_lang)
    direction = translator_direction(translator)
    data = open_checkpoint_data(translator, data_dir, split, checkpoint=paths[0])
    check_positions(translator, data, data_dir, split)
    cfg = translator.config
    assert cfg is not None
    result = corpus_perplexity(translator.model, data, cfg.data.max_tokens if max_tokens is None else max_tokens)
    return {"split": split, "direction": "-".join(direction), **asdict(result)}


def translator_direction(translator: Translator) -> tuple[str, str]:
    """(source, target) language of a translator: its direction of a multilingual model, else its config's."""
    src, tgt = getattr(translator.model, "src_lang", None), getattr(translator.model, "tgt_lang", None)
    if src and tgt:
        return src, tgt
    cfg = translator.config
    assert cfg is not None
    return cfg.data.src_lang, cfg.data.tgt_lang


def check_positions(translator: Translator, data: Bitext, data_dir: str | Path, split: str) -> None:
    """A sentence longer than the model's positions is an error naming its line or row (perplexity never
    truncates)."""
    src_limit, tgt_limit = position_limits(translator.model.config)
    src_lang, tgt_lang = translator_direction(translator)
    for lang, sizes, extra, limit in ((src_lang, data.src.sizes, 1 + (data.src_prefix is not None), src_limit),
                                      (tgt_lang, data.tgt.sizes, 1, tgt_limit)):
        check_sentence_lengths(data_dir, split, lang, sizes, extra, limit, cleaned=False)


def open_checkpoint_data(translator: Translator, data_dir: str | Path, split: str, *,
                         checkpoint: str | Path = "the checkpoint") -> Bitext:
    """``split`` of ``data_dir`` in the translator's direction, after checking it shares its tokenizers; sources
    start with the translator's ``src_prefix`` (a language-label model's tag), if any."""
    meta = load_meta(data_dir)
    src, tgt = translator_direction(translator)
    data = open_bitext(data_dir, split, src, tgt)
    data.src_prefix = translator.src_prefix
    for lang, tok in ((src, translator.src_tokenizer), (tgt, translator.tgt_tokenizer)):
        if not same_model((Path(data_dir) / meta["tokenizers"][lang]).read_bytes(), tok.model_proto):
            raise ValueError(f"{data_dir}: its {lang} vocabulary ({meta['tokenizers'][lang]}) is not the one "
                             f"{checkpoint} was trained with; give the data directory prepared for that run")
    return data
