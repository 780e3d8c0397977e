"""Corpus metrics through sacreBLEU (Post 2018), with their reproducibility signatures."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import sacrebleu


@dataclass
class Score:
    name: str
    score: float
    signature: str

    def __str__(self) -> str:
        return f"{self.name} = {self.score:.2f}  ({self.signature})"


def bleu(hypotheses: list[str], references: list[str], *, tokenize: str = "13a", lowercase: bool = False) -> Score:
    """Cased, detokenised corpus BLEU (13a tokenisation by default)."""
    metric = sacrebleu.metrics.BLEU(tokenize=tokenize, lowercase=lowercase)
    result = metric.corpus_score(hypotheses, [references])
    return Score("BLEU", result.score, str(metric.get_signature()))


def chrf(hypotheses: list[str], references: list[str]) -> Score:
    """chrF2 (character n-gram F-score, β = 2)."""
    metric = sacrebleu.metrics.CHRF()
    result = metric.corpus_score(hypotheses, [references])
    return Score("chrF2", result.score, str(metric.get_signature()))


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
