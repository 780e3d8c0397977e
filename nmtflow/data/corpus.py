"""Streaming access to line-aligned parallel text files, and row cleaning.

A parallel corpus is one plain-text file per language (``PREFIX.LANG``), one sentence per
line, line ``n`` of every file being translations of each other. :func:`iter_parallel` reads
the files in lockstep without holding them in memory and reports every problem as a
:class:`CorpusError` whose message starts with ``FILE:LINE:``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator, Sequence

import numpy as np

_READ_CHUNK = 1 << 20


class CorpusError(ValueError):
    """A problem in a corpus file; the message is ``"FILE:LINE: problem"`` (or ``"FILE: problem"``)."""

    def __init__(self, file: str | Path, problem: str, line: int | None = None) -> None:
        self.file = str(file)
        self.problem = problem
        self.line = line
        where = self.file if line is None else f"{self.file}:{line}"
        super().__init__(f"{where}: {problem}")

    def __reduce__(self):  # keep the structured fields across pickling (e.g. worker processes)
        return (type(self), (self.file, self.problem, self.line))


def cr_ended(text: str) -> bool:
    """True when ``text`` (a whole file, or its only line) holds carriage returns and no line feed before its end:
    lines ended by CR alone, as classic Mac OS wrote them, which every reader here would take as one line."""
    body = text.rstrip("\r\n")
    return "\r" in body and "\n" not in body


def cr_ended_error(path: str | Path, text: str) -> CorpusError:
    """The error for a :func:`cr_ended` file ``path`` (``text`` its content): what it is and how to convert it."""
    n = text.count("\r")
    return CorpusError(path, f"lines ended by CR alone (classic Mac; {n} carriage return{'s' * (n != 1)}, no line "
                             "feed): convert them with tr '\\r' '\\n'")


def read_lines(path: str | Path) -> list[str]:
    """The lines of a UTF-8 text file, without line ends (CRLF or LF) or a byte-order mark; errors are
    :class:`CorpusError` naming the file, and for invalid UTF-8 the line and byte offset within it."""
    try:
        data = Path(path).read_bytes()
        text = data.decode("utf-8")
    except FileNotFoundError:
        raise CorpusError(path, "file not found") from None
    except IsADirectoryError:
        raise CorpusError(path, "not a regular file") from None
    except UnicodeDecodeError as exc:  # binary garbage, another encoding
        start = data.rfind(b"\n", 0, exc.start) + 1
        raise CorpusError(path, f"invalid UTF-8 at byte offset {exc.start - start} of the line ({exc.reason})",
                          line=data.count(b"\n", 0, exc.start) + 1) from None
    if cr_ended(text):  # one "line" of several: translate would give one output
        raise cr_ended_error(path, text)
    lines = text.removeprefix("\ufeff").split("\n")  # a byte-order mark, as `prepare` tolerates it
    if lines and lines[-1] == "":
        lines.pop()
    return [ln.rstrip("\r") for ln in lines]


#: Characters that are not whitespace to Python but that SentencePiece's normalisation (nmt_nfkc) drops or turns
#: into a space: C0/C1 controls, zero-width space and non-joiner, direction marks, the Arabic letter mark, the
#: piece separator U+2581, a byte-order mark (U+FEFF) and U+FFFD. A line of only these encodes to no tokens.
INVISIBLE = "".join(map(chr, [*range(0x01, 0x09), *range(0x0E, 0x1C), 0x7F, 0x8F, 0x9F, 0x061C,
                              0x200B, 0x200C, 0x200E, 0x200F, 0x2581, 0xFEFF, 0xFFFD]))


def is_blank(text: str) -> bool:
    """True when ``text`` has nothing SentencePiece would encode: only whitespace and :data:`INVISIBLE` characters."""
    return not "".join(text.split()).strip(INVISIBLE)


def normalize_line(text: str) -> str:
    """Collapse every run of whitespace to one space and strip both ends."""
    return " ".join(text.split())


def _check_file(path: Path) -> None:
    if not path.exists():
        raise CorpusError(path, "file not found")
    if not path.is_file():
        raise CorpusError(path, "not a regular file")


def _count_rest(fh: IO[bytes]) -> int:
    """Number of lines left in a binary file handle (a last line without newline counts)."""
    n, last = 0, b"\n"
    while chunk := fh.read(_READ_CHUNK):
        n += chunk.count(b"\n")
        last = chunk[-1:]
    return n + (last != b"\n")


def count_lines(path: str | Path) -> int:
    """Count lines the way :func:`iter_parallel` does (a final line without newline counts)."""
    path = Path(path)
    _check_file(path)
    with open(path, "rb") as fh:
        return _count_rest(fh)


def _iter_lines(path: Path, block_size: int = _READ_CHUNK) -> Iterator[str]:
    """Normalised lines of one file, decoded block by block (no per-line Python code).

    A decoding error is raised lazily, after every line before the bad one has been yielded.
    """
    line_no = 0
    with open(path, "rb") as fh:
        while block := fh.read(block_size):
            if not block.endswith(b"\n"):
                block += fh.readline()  # complete the last line of the block
            try:
                text = block.decode("utf-8")
                error = None
            except UnicodeDecodeError as e:
                line_start = block.rfind(b"\n", 0, e.start) + 1
                text = block[:line_start].decode("utf-8")
                bad_line = line_no + block.count(b"\n", 0, line_start) + 1
                error = CorpusError(
                    path, f"invalid UTF-8 at byte offset {e.start - line_start} of the line ({e.reason})", bad_line
                )
            if line_no == 0 and text.startswith("\ufeff"):  # tolerate a byte-order mark
                text = text[1:]
            if line_no == 0 and cr_ended(text):  # a first block without a line feed is the whole file
                raise cr_ended_error(path, text)
            lines = text.split("\n")
            if text.endswith("\n") or not text:
                lines.pop()
            line_no += len(lines)
            yield from map(" ".join, map(str.split, lines))
            if error is not None:
                raise error


def iter_tsv(path: str | Path, *, skip_blank: bool = True) -> Iterator[tuple[int, list[str]]]:
    """(line number, tab-separated fields) of the lines of a UTF-8 file (a byte-order mark dropped, as
    :func:`read_lines` does), blank ones skipped unless ``skip_blank`` is False; errors name the file and line."""
    _check_file(Path(path))
    with open(path, "rb") as fh:
        for line_no, raw in enumerate(fh, 1):
            try:
                text = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as exc:
                raise CorpusError(path, f"invalid UTF-8 at byte offset {exc.start} of the line ({exc.reason})",
                                  line=line_no) from None
            if line_no == 1:
                text = text.removeprefix("\ufeff")
                if cr_ended(text) and not fh.peek(1):  # the whole file is one line
                    raise cr_ended_error(path, raw.decode("utf-8"))
            if text.strip() or not skip_blank:
                yield line_no, text.split("\t")

def iter_parallel(
    paths: Sequence[str | Path], *, allow_empty: bool = True
) -> Iterator[tuple[int, tuple[str, ...]]]:
    """Yield ``(line_no, (text_file0, text_file1, ...))`` for aligned files, 1-based line numbers.

    Lines are decoded as strict UTF-8, their line ending removed and whitespace normalised
    (:func:`normalize_line`). Raises :class:`CorpusError` for a missing file, invalid UTF-8
    (file, line and byte offset), files with different line counts (when the shorter one ends)
    and, with ``allow_empty=False``, a line that is empty after normalisation or holds only
    :data:`INVISIBLE` characters (it would encode to no tokens). Files are read
    in blocks; memory use does not depend on the corpus size.
    """
    paths = [Path(p) for p in paths]
    if not paths:
        raise ValueError("iter_parallel needs at least one file")
    for p in paths:
        _check_file(p)
    rows = enumerate(zip(*map(_iter_lines, paths), strict=True), 1)
    try:
        if allow_empty:
            yield from rows
        else:
            for line_no, texts in rows:
                # normalised lines are stripped, so a blank one is empty or starts with an invisible character
                blank = [i for i, t in enumerate(texts) if not t or (t[0] in INVISIBLE and is_blank(t))]
                if blank:
                    text = texts[blank[0]]
                    codes = ", ".join(f"U+{ord(c):04X}" for c in sorted(set(text) - {" "}))
                    what = f"line of only invisible characters ({codes})" if text else "empty line"
                    raise CorpusError(paths[blank[0]], f"{what} (not allowed outside the training split)", line_no)
                yield line_no, texts
    except ValueError as e:
        if type(e) is not ValueError or "zip()" not in str(e):
            raise
        _raise_mismatch(paths)


def _bare_carriage_returns(path: Path, block_size: int = 1 << 20) -> int:
    """Carriage returns not followed by a line feed: line ends of a file written with classic-Mac CR endings."""
    n, after_cr = 0, False
    with open(path, "rb") as fh:
        while block := fh.read(block_size):
            if after_cr and block.startswith(b"\n"):  # the previous block's last CR began a CRLF
                n -= 1
            n += block.count(b"\r") - block.count(b"\r\n")
            after_cr = block.endswith(b"\r")
    return n


def _raise_mismatch(paths: list[Path]) -> None:
    counts = [count_lines(p) for p in paths]
    short = int(np.argmin(counts))
    long = int(np.argmax(counts))
    cr = _bare_carriage_returns(paths[short])
    hint = (f"; it has {cr} carriage returns not followed by a line feed: lines ended by CR alone (classic Mac)? "
            f"convert them with tr '\\r' '\\n'" if cr else "")
    raise CorpusError(
        paths[short],
        f"has {counts[short]} lines but {paths[long]} has {counts[long]} lines (files must be line-aligned){hint}",
    ) from None


@dataclass
class CleanConfig:
    """Training-data filters, applied to subword token counts of every side of a row.

    A row is kept when every side has ``min_len <= n <= max_len`` tokens and the ratio of the
    longest to the shortest side is at most ``max_ratio``. Empty sides are always dropped.
    """

    max_len: int = 250
    max_ratio: float = 3.0
    min_len: int = 1

    def __post_init__(self) -> None:
        if self.min_len < 1:
            raise ValueError(f"CleanConfig.min_len must be >= 1, got {self.min_len}")
        if self.max_len < self.min_len:
            raise ValueError(f"CleanConfig.max_len ({self.max_len}) must be >= min_len ({self.min_len})")
        if not self.max_ratio >= 1.0:
            raise ValueError(f"CleanConfig.max_ratio must be >= 1, got {self.max_ratio}")


def keep_row(lengths: Sequence[int], cfg: CleanConfig) -> bool:
    """True when a row with these per-side token counts passes the filters of ``cfg``."""
    lo, hi = min(lengths), max(lengths)
    return lo >= cfg.min_len and hi <= cfg.max_len and hi <= cfg.max_ratio * lo


#: Name used in the design notes.
clean_row = keep_row


def keep_mask(lengths: np.ndarray, cfg: CleanConfig) -> np.ndarray:
    """Vectorised :func:`keep_row`: ``lengths`` is ``(rows, sides)``; returns a bool mask of rows."""
    lengths = np.asarray(lengths)
    if lengths.ndim != 2:
        raise ValueError(f"keep_mask expects a (rows, sides) array, got shape {lengths.shape}")
    if lengths.shape[0] == 0 or lengths.shape[1] == 0:
        return np.ones(lengths.shape[0], dtype=bool)
    lo = lengths.min(axis=1)
    hi = lengths.max(axis=1)
    return (lo >= cfg.min_len) & (hi <= cfg.max_len) & (hi <= cfg.max_ratio * lo)


__all__ = [
    "CorpusError", "iter_parallel", "count_lines", "normalize_line", "is_blank", "INVISIBLE",
    "CleanConfig", "keep_row", "clean_row", "keep_mask",
]
