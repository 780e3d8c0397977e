"""Downstream tasks on sentence embeddings (Vázquez et al. 2020 §4, SentEval-style; SPEC §5).

* **classification**: a logistic-regression probe (multinomial, L2-regularised, full-batch L-BFGS on
  standardised features) trained on the embeddings of labelled sentences (TSV: ``sentence<TAB>label``) of
  one language and tested on another file, possibly in another language (cross-lingual transfer: the
  probe never sees the test language);
* **similarity**: cosine similarity of the embeddings of two sentences (TSV: ``sentence1<TAB>sentence2<TAB>gold``,
  each side in its own language) correlated with the gold scores: Pearson and Spearman (average ranks for ties).
No training of the translation model happens here: it is frozen.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from nmtflow.data.corpus import CorpusError, iter_tsv

# (sentences, language, name=FILE, line_numbers=[...]) → (N,D); the keywords locate warnings about long lines
Embed = Callable[..., np.ndarray]


def read_tsv(path: str | Path, columns: int) -> list[list[str]]:
    """Non-empty lines of a UTF-8 TSV with exactly ``columns`` non-empty fields; errors name the file and line."""
    return [fields for _, fields in read_numbered_tsv(path, columns)]


def read_numbered_tsv(path: str | Path, columns: int) -> list[tuple[int, list[str]]]:
    """:func:`read_tsv` with the line number of each row."""
    rows = []
    for line_no, fields in iter_tsv(path):
        if len(fields) != columns:
            raise CorpusError(path, f"expected {columns} tab-separated fields, got {len(fields)}", line=line_no)
        empty = [i + 1 for i, field in enumerate(fields) if not field.strip()]
        if empty:
            raise CorpusError(path, f"field {empty[0]} of {columns} is empty", line=line_no)
        rows.append((line_no, fields))
    if not rows:
        raise CorpusError(path, "no examples")
    return rows


def logistic_regression(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, *, l2: float = 1e-3,
                        max_iter: int = 200) -> tuple[np.ndarray, np.ndarray]:
    """Fit softmax(W x + b) on integer labels; → (train predictions, test predictions)."""
    mean, std = x_train.mean(0), x_train.std(0) + 1e-6  # standardise with the training statistics
    xtr = torch.from_numpy((x_train - mean) / std).double()
    xte = torch.from_numpy((x_test - mean) / std).double()
    y = torch.from_numpy(y_train).long()
    classes = int(y.max()) + 1
    weight = torch.zeros(xtr.size(1), classes, dtype=torch.float64, requires_grad=True)
    bias = torch.zeros(classes, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([weight, bias], max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(xtr @ weight + bias, y) + l2 * weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    with torch.no_grad():
        return (xtr @ weight + bias).argmax(1).numpy(), (xte @ weight + bias).argmax(1).numpy()


def classification(embed: Embed, train_path: str | Path, train_lang: str, test_path: str | Path,
                   test_lang: str | None = None, *, l2: float = 1e-3) -> dict[str, Any]:
    """Accuracy of a logistic-regression probe trained on ``train_path`` (``train_lang``), tested on
    ``test_path`` (``test_lang``, default ``train_lang``); ``l2`` must be a finite number >= 0."""
    if not (math.isfinite(l2) and l2 >= 0):
        raise ValueError(f"--l2: the L2 weight must be a finite number >= 0, got {l2}")
    train, test = read_numbered_tsv(train_path, 2), read_numbered_tsv(test_path, 2)
    labels = sorted({label for _, (_, label) in train})
    if len(labels) < 2:
        raise CorpusError(train_path, f"every example has the label {labels[0]!r}: a classifier needs at least "
                          "two classes")
    index = {label: i for i, label in enumerate(labels)}
    for line_no, (_, label) in test:
        if label not in index:
            raise CorpusError(test_path, f"label {label!r} does not occur in {train_path}", line=line_no)
    test_lang = test_lang or train_lang
    x_train = embed([s for _, (s, _) in train], train_lang, name=str(train_path),
                    line_numbers=[n for n, _ in train])
    x_test = embed([s for _, (s, _) in test], test_lang, name=str(test_path), line_numbers=[n for n, _ in test])
    y_train = np.array([index[label] for _, (_, label) in train])
    y_test = np.array([index[label] for _, (_, label) in test])
    pred_train, pred_test = logistic_regression(x_train, y_train, x_test, l2=l2)
    return {"task": "classification", "train_lang": train_lang, "test_lang": test_lang,
            "accuracy": float((pred_test == y_test).mean()), "train_accuracy": float((pred_train == y_train).mean()),
            "train_examples": len(train), "test_examples": len(test), "classes": len(labels),
            "dim": int(x_train.shape[1])}


def rank(x: np.ndarray) -> np.ndarray:
    """Ranks 1…n, ties sharing their average rank."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x), dtype=np.float64)
    ranks[order] = np.arange(1, len(x) + 1)
    _, inverse, counts = np.unique(x, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return sums[inverse] / counts[inverse]


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    a, b = a - a.mean(), b - b.mean()
    denom = np.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / denom) if denom > 0 else float("nan")


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    return pearson(rank(np.asarray(a)), rank(np.asarray(b)))


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of (N,D) arrays → (N,)."""
    num = (a * b).sum(1)
    return num / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-12)


def gold_score(path: str | Path, line_no: int, text: str) -> float:
    """The gold similarity of one line: a finite number, else a CorpusError naming FILE:LINE."""
    try:
        value = float(text)
    except ValueError:
        raise CorpusError(path, f"the third column must be a number, got {text!r}", line=line_no) from None
    if not math.isfinite(value):
        raise CorpusError(path, f"the gold score must be finite, got {text!r}", line=line_no)
    return value


def similarity(embed: Embed, path: str | Path, lang: str, lang2: str | None = None) -> dict[str, Any]:
    """Pearson/Spearman correlation of cos(emb(s1), emb(s2)) with the gold scores of ``path``; fewer than two
    pairs, or gold scores all equal, leave the correlation undefined: an error."""
    rows = read_numbered_tsv(path, 3)
    gold = np.array([gold_score(path, n, g) for n, (_, _, g) in rows])
    if len(rows) < 2:
        raise CorpusError(path, f"{len(rows)} sentence pair: a correlation needs at least two")
    if np.all(gold == gold[0]):
        raise CorpusError(path, f"every gold score is {gold[0]:g}: the correlation with them is undefined")
    lang2 = lang2 or lang
    where = {"name": str(path), "line_numbers": [n for n, _ in rows]}
    scores = cosine(embed([r[0] for _, r in rows], lang, **where), embed([r[1] for _, r in rows], lang2, **where))
    if np.ptp(scores) < 1e-6:  # e.g. every pair two equal sentences (cosines equal up to rounding)
        raise CorpusError(path, f"every pair's cosine is {scores[0]:g}: the correlation is undefined")
    return {"task": "similarity", "lang": lang, "lang2": lang2, "pearson": pearson(scores, gold),
            "spearman": spearman(scores, gold), "examples": len(rows)}
