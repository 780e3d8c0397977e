"""Contrastive evaluation (Sennrich 2017): does the model score the correct translation above every
incorrect variant of it? Candidates file: TSV, one source per line, then its correct translation, then
one or more incorrect translations."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, NamedTuple

from nmtflow.data.corpus import CorpusError, is_blank, iter_tsv


class Candidates(NamedTuple):
    """One line of a candidates file."""

    line: int  # 1-based line number in the file
    source: str
    correct: str
    incorrect: list[str]


def field_name(field: int) -> str:
    """What field ``field`` (1-based) of a candidates line holds."""
    return {1: "the source", 2: "the correct translation"}.get(field, "an incorrect translation")


def read_candidates(path: str | Path) -> list[Candidates]:
    """The lines of a candidates file; a blank line, a line with fewer than three fields or an empty field (one
    with nothing SentencePiece would encode) is an error naming FILE:LINE."""
    rows = []
    for line_no, fields in iter_tsv(path, skip_blank=False):
        if len(fields) == 1 and is_blank(fields[0]):
            raise CorpusError(path, "blank line (expected SOURCE<TAB>CORRECT<TAB>INCORRECT…; every line is one "
                                    "test item)", line=line_no)
        if len(fields) < 3:
            raise CorpusError(path, f"expected SOURCE<TAB>CORRECT<TAB>INCORRECT…, got {len(fields)} field(s)",
                              line=line_no)
        empty = [k for k, text in enumerate(fields, 1) if is_blank(text)]
        if empty:
            raise CorpusError(path, f"malformed line: field {empty[0]} ({field_name(empty[0])}) is empty "
                                    "(expected SOURCE<TAB>CORRECT<TAB>INCORRECT…, no empty fields)", line=line_no)
        rows.append(Candidates(line_no, fields[0], fields[1], fields[2:]))
    if not rows:
        raise CorpusError(path, "no candidates")
    return rows


def contrastive_accuracy(translator: Any, path: str | Path, rows: list[Candidates] | None = None) -> dict[str, Any]:
    """Share of sources whose correct translation scores strictly above all its incorrect ones.

    A candidate that tokenises as its line's correct translation (the same string, or one differing in spacing
    only) ties with it, whatever batch each lands in: every distinct (source, target pieces) pair is scored once,
    so scores never differ by batch-composition noise. A NaN score is a ValueError naming FILE:LINE. ``rows``:
    :func:`read_candidates` of ``path``, if it was read already.
    """
    rows = read_candidates(path) if rows is None else rows
    sources, targets, origin = [], [], []  # origin: (line, field) of each scored pair's target
    for row in rows:
        for field, tgt in enumerate([row.correct, *row.incorrect], 2):
            sources.append(row.source)
            targets.append(tgt)
            origin.append((row.line, field))
    slot_of: dict[tuple[str, tuple[int, ...]], int] = {}  # (source, target ids) → its slot among the distinct
    unique: list[int] = []  # the first pair of each distinct one
    slot = []  # each pair's slot
    for n, (src, ids) in enumerate(zip(sources, translator.tgt_tokenizer.encode_batch(targets))):
        if (src, tuple(ids)) not in slot_of:
            slot_of[src, tuple(ids)] = len(unique)
            unique.append(n)
        slot.append(slot_of[src, tuple(ids)])

    def where(n: int, side: str) -> str:
        line, field = origin[unique[n]]
        field = 1 if side == "source" else field
        return f"{path}:{line}: field {field} ({field_name(field)})"

    distinct = translator.score([sources[n] for n in unique], [targets[n] for n in unique], where=where)
    scores = [distinct[s] for s in slot]
    correct, pos = 0, 0
    for row in rows:
        group = scores[pos: pos + 1 + len(row.incorrect)]
        if any(math.isnan(s) for s in group):
            field = 2 + next(k for k, s in enumerate(group) if math.isnan(s))
            raise ValueError(f"{path}:{row.line}: field {field} ({field_name(field)}): the model's score is NaN "
                             "(a diverged checkpoint, or one overflowing at this precision?)")
        correct += int(all(group[0] > s for s in group[1:]))
        pos += 1 + len(row.incorrect)
    return {"accuracy": correct / len(rows), "correct": correct, "total": len(rows), "file": str(path)}
