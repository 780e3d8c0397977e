"""Corpus metrics through sacreBLEU (Post 2018), with their reproducibility signatures."""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sacrebleu

from nmtflow.config import BLEU_TOKENIZER


@dataclass
class Score:
    name: str
    score: float
    signature: str

    def __str__(self) -> str:
        return f"{self.name} = {self.score:.2f}  ({self.signature})"


BLEU_TOKENIZERS: tuple[str, ...] = tuple(sacrebleu.metrics.BLEU.TOKENIZERS)  # 13a, intl, zh, ja-mecab, char, ...
METRICS = ("bleu", "chrf", "chrf++", "ter")
DEFAULT_METRICS = ("bleu", "chrf")


def _bleu_metric(tokenize: str, lowercase: bool = False) -> sacrebleu.metrics.BLEU:
    """sacreBLEU's BLEU, or a one-line error when its tokenizer cannot be set up here (ja-mecab without its
    package, flores200 without the network)."""
    try:
        return sacrebleu.metrics.BLEU(tokenize=tokenize, lowercase=lowercase)
    except Exception as exc:  # noqa: BLE001 - sacreBLEU raises anything from ImportError to HTTP errors
        raise ValueError(f"BLEU tokenizer {tokenize!r}: sacreBLEU cannot set it up here ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())})") from None


def check_tokenizer(tokenize: str) -> None:
    """A ValueError now, before anything is translated, for a BLEU tokenizer sacreBLEU lacks or cannot set up."""
    if tokenize not in BLEU_TOKENIZERS:
        raise ValueError(f"unknown BLEU tokenizer {tokenize!r} (sacreBLEU's: {', '.join(BLEU_TOKENIZERS)})")
    _bleu_metric(tokenize)


def check_metrics(metrics: Sequence[str]) -> None:
    """A ValueError naming the first of ``metrics`` that is not in :data:`METRICS`."""
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"unknown {unknown[0]!r} (known: {', '.join(METRICS)})")


def bleu(hypotheses: list[str], *references: list[str], tokenize: str = BLEU_TOKENIZER,
         lowercase: bool = False) -> Score:
    """Detokenised corpus BLEU against one or more reference streams (cased, 13a tokenisation by default)."""
    metric = _bleu_metric(tokenize, lowercase)
    result = metric.corpus_score(hypotheses, list(references))
    return Score("BLEU", result.score, str(metric.get_signature()))


def chrf(hypotheses: list[str], *references: list[str], word_order: int = 0, lowercase: bool = False) -> Score:
    """chrF2 (character n-gram F-score, β = 2); ``word_order=2``: chrF++ (word uni- and bigrams too)."""
    metric = sacrebleu.metrics.CHRF(word_order=word_order, lowercase=lowercase)
    result = metric.corpus_score(hypotheses, list(references))
    return Score("chrF2" + "+" * word_order, result.score, str(metric.get_signature()))


def ter(hypotheses: list[str], *references: list[str]) -> Score:
    """Translation edit rate (Snover et al. 2006), in percent, lower is better; case-insensitive, as sacreBLEU's
    default (its signature says ``case:lc``)."""
    metric = sacrebleu.metrics.TER()
    result = metric.corpus_score(hypotheses, list(references))
    return Score("TER", result.score, str(metric.get_signature()))


def corpus_scores(hypotheses: list[str], references: list[list[str]], metrics: Sequence[str] = DEFAULT_METRICS, *,
                  tokenize: str = BLEU_TOKENIZER, lowercase: bool = False) -> list[Score]:
    """``metrics`` (names from METRICS) of ``hypotheses`` against every stream in ``references``."""
    try:
        check_metrics(metrics)
    except ValueError as exc:
        raise ValueError(f"metric: {exc}") from None
    make = {"bleu": lambda: bleu(hypotheses, *references, tokenize=tokenize, lowercase=lowercase),
            "chrf": lambda: chrf(hypotheses, *references, lowercase=lowercase),
            "chrf++": lambda: chrf(hypotheses, *references, word_order=2, lowercase=lowercase),
            "ter": lambda: ter(hypotheses, *references)}
    return [make[m]() for m in dict.fromkeys(metrics)]


def perplexity(nll_sum: float, tokens: int) -> float:
    """exp(Σ NLL / N) with natural-log NLL; inf where that overflows a float (a diverged model), not an error."""
    try:
        return math.exp(nll_sum / max(tokens, 1))
    except OverflowError:
        return math.inf


def json_safe(obj: Any) -> Any:
    """``obj`` with every NaN or infinite float as None: strict JSON (``json.dumps`` would write NaN, Infinity)."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
