"""A `score --candidates` file: every line is one test item, so a blank line is an error naming the file and line
(as an empty field is), found before the model is loaded."""
from __future__ import annotations

from pathlib import Path

import pytest

from nmtflow.cli import main
from nmtflow.data.corpus import CorpusError, iter_tsv
from nmtflow.decode.contrastive import read_candidates


@pytest.mark.parametrize("text, line, problem", [
    ("alpha\talpha\tbravo\n\ndelta\tdelta\techo\n", 2, "blank line"),
    ("alpha\talpha\tbravo\n \t \t\n", 2, "field 1 (the source) is empty"),
    ("alpha\talpha\tbravo\n  \r\n", 2, "blank line"),
    ("alpha\talpha\tbravo\n\n", 2, "blank line"),  # a trailing one too
    ("\nalpha\talpha\tbravo\n", 1, "blank line"),
    ("alpha\talpha\tbravo\ncharlie\tcharlie\t\u200b\n", 2, "field 3 (an incorrect translation) is empty"),
])
def test_a_blank_line_or_field_is_an_error_naming_the_line(tmp_path: Path, text: str, line: int,
                                                           problem: str) -> None:
    """Before: blank lines were skipped, and a field of only invisible characters (no pieces) was scored."""
    cands = tmp_path / "cands.tsv"
    cands.write_text(text, encoding="utf-8")
    with pytest.raises(CorpusError) as err:
        read_candidates(cands)
    assert str(err.value).startswith(f"{cands}:{line}: ") and problem in str(err.value)


def test_score_reports_a_blank_line_before_loading_the_model(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    cands = tmp_path / "cands.tsv"
    cands.write_text("alpha\talpha\tbravo\n\ndelta\tdelta\techo\n", encoding="utf-8")
    code = main(["score", str(tmp_path / "missing.pt"), "--candidates", str(cands), "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(f"nmtflow score: error: {cands}:2: blank line") and len(err.splitlines()) == 1


def test_invalid_utf8_names_the_byte_offset_within_the_line(tmp_path: Path) -> None:
    """Before: "invalid UTF-8 at byte 3", unlike the FILE:LINE: invalid UTF-8 at byte offset N of the line (REASON)
    of every other input."""
    cands = tmp_path / "cands.tsv"
    cands.write_bytes(b"alpha\talpha\tbravo\nabc\xff\talpha\tbravo\n")
    with pytest.raises(CorpusError) as err:
        list(iter_tsv(cands))  # as read_candidates reads it
    assert str(err.value) == f"{cands}:2: invalid UTF-8 at byte offset 3 of the line (invalid start byte)"
