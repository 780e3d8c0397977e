"""Contrastive evaluation (Sennrich 2017): does the model score the correct translation above every
incorrect variant of it? Candidates file: TSV, one source per line, then its correct translation, then
one or more incorrect translations."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from nmtflow.data.corpus import CorpusError, iter_tsv


def read_candidates(path: str | Path) -> list[tuple[str, str, list[str]]]:
    rows = []
    for line_no, fields in iter_tsv(path):
        if len(fields) < 3:
            raise CorpusError(path, f"expected SOURCE<TAB>CORRECT<TAB>INCORRECT…, got {len(fields)} field(s)",
                              line=line_no)
        rows.append((fields[0], fields[1], fields[2:]))
    if not rows:
        raise CorpusError(path, "no candidates")
    return rows


def contrastive_accuracy(translator: Any, path: str | Path) -> dict[str, Any]:
    """Share of sources whose correct translation scores strictly above all its incorrect ones."""
    rows = read_candidates(path)
    sources, targets, owner = [], [], []
    for i, (src, good, bad) in enumerate(rows):
        for tgt in [good, *bad]:
            sources.append(src)
            targets.append(tgt)
            owner.append(i)
    scores = translator.score(sources, targets)
    correct, pos = 0, 0
    for _, _, bad in rows:
        group = scores[pos: pos + 1 + len(bad)]
        correct += int(all(group[0] > s for s in group[1:]))
        pos += 1 + len(bad)
    return {"accuracy": correct / len(rows), "correct": correct, "total": len(rows), "file": str(path)}
