"""Corpus metrics through sacreBLEU (Post 2018), with their reproducibility signatures."""
from __future__ import annotations

import logging
import math
import unicodedata
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sacrebleu

from nmtflow.config import BLEU_TOKENIZER, bleu_metric, bleu_tokenizers

log = logging.getLogger(__name__)


@dataclass
class Score:
    name: str
    score: float
    signature: str

    def __str__(self) -> str:
        return f"{self.name} = {self.score:.2f}  ({self.signature})"


BLEU_TOKENIZERS: tuple[str, ...] = bleu_tokenizers()  # 13a, intl, zh, ja-mecab, char, ...
METRICS = ("bleu", "chrf", "chrf++", "ter")
DEFAULT_METRICS = ("bleu", "chrf")


def warn_not_nfc(lines: Sequence[str], name: str) -> int:
    """Warn when lines of the file ``name`` are not in Unicode NFC (e.g. decomposed accents, as macOS tools write
    them): BLEU and chrF count a composed and a decomposed character as different, and nmtflow's translations are
    composed (NFKC). Returns the number of such lines."""
    bad = [n for n, line in enumerate(lines, 1) if not line.isascii() and not unicodedata.is_normalized("NFC", line)]
    if bad:
        log.warning("%s: %d of %d lines are not in Unicode NFC (first: line %d); BLEU and chrF count a decomposed "
                    "character as different from the composed one nmtflow writes: normalise the file to NFC (e.g. "
                    "uconv -x any-nfc, or Python's unicodedata.normalize)", name, len(bad), len(lines), bad[0])
    return len(bad)


def check_metrics(metrics: Sequence[str]) -> None:
    """A ValueError naming the first of ``metrics`` that is not in :data:`METRICS`."""
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"unknown {unknown[0]!r} (known: {', '.join(METRICS)})")


def bleu(hypotheses: list[str], *references: list[str], tokenize: str = BLEU_TOKENIZER,
         lowercase: bool = False) -> Score:
    """Detokenised corpus BLEU against one or more reference streams (cased, 13a tokenisation by default)."""
    metric = bleu_metric(tokenize, lowercase)
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
