"""Byte fallback: characters the training text never had round-trip as byte pieces instead of becoming <unk>."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from nmtflow.cli import main
from nmtflow.data.prepare import load_meta, load_tokenizer, prepare
from nmtflow.data.tokenizer import Tokenizer
from nmtflow.data.vocab import UNK
from tests.conftest import copy_sentences, write_split

# none of these characters is in copy_sentences' text (lower-case ASCII words and spaces)
UNSEEN = ["Zoë 😀", "漢字とかな", "q\u0307 x\u0301 alpha", "Ωmega — “quoted” ß"]


@pytest.fixture(scope="module")
def text(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bytes") / "train.txt"
    path.write_text("".join(s + "\n" for s in copy_sentences(300, 1)), encoding="utf-8")
    return path


def minimum(text: Path, byte_fallback: bool) -> int:
    """The smallest vocabulary of a model of ``text``, counted here: 4 special pieces, every distinct character
    (the space as ▁) and, with byte fallback, 256 bytes."""
    chars = set(text.read_text(encoding="utf-8").replace("\n", ""))
    return 4 + len(chars) + 256 * byte_fallback


@pytest.fixture(scope="module")
def toks(text: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Tokenizer]:
    out = tmp_path_factory.mktemp("models")
    return {bf: Tokenizer.train([text], out / f"spm{bf}", minimum(text, bf) + 20, byte_fallback=bf)
            for bf in (True, False)}


@pytest.mark.parametrize("line", UNSEEN)
def test_unseen_characters_round_trip_with_byte_fallback(toks: dict[bool, Tokenizer], line: str) -> None:
    tok = toks[True]
    ids = tok.encode(line)
    assert UNK not in ids and any(tok.piece(i).startswith("<0x") for i in ids)
    assert tok.decode(ids) == line and tok.decode_batch([ids, ids]) == [line, line]
    assert tok.unknown_surfaces(line) == []


@pytest.mark.parametrize("line", UNSEEN)
def test_a_tokenizer_without_byte_fallback_still_makes_unk(toks: dict[bool, Tokenizer], line: str) -> None:
    tok = toks[False]
    ids = tok.encode(line)
    assert UNK in ids and tok.decode(ids) != line
    assert tok.byte_fallback is False and toks[True].byte_fallback is True
    assert len(tok.unknown_surfaces(line)) == ids.count(UNK)
    assert all(s and s in line for s in tok.unknown_surfaces(line))


def test_text_comes_back_nfkc_normalised(toks: dict[bool, Tokenizer]) -> None:
    """SentencePiece's normalisation (NFKC) applies before the bytes: a decomposed é comes back composed."""
    assert toks[True].decode(toks[True].encode("caf\u0065\u0301 ﬁ")) == "caf\u00e9 fi"


def test_byte_pieces_are_labelled_as_characters_and_bad_bytes_do_not_crash(toks: dict[bool, Tokenizer]) -> None:
    tok = toks[True]
    ids = tok.encode("Zoë 😀")
    labels = tok.labels(ids)
    assert not any(label.startswith("<0x") for label in labels)
    assert labels[labels.index("ë[1/2]") + 1] == "ë[2/2]" and "😀[4/4]" in labels
    c3, ab, a = tok.id("<0xC3>"), tok.id("<0xAB>"), tok.id("a")
    assert tok.labels([c3, c3, ab, a]) == ["<0xC3>", "ë[1/2]", "ë[2/2]", "a"]  # a lead byte without its end
    assert tok.labels([ab, a]) == ["<0xAB>", "a"]  # a continuation byte alone
    assert tok.decode([c3, a]) == "\ufffda" and tok.decode([ab]) == "\ufffd"  # invalid UTF-8: replaced
    old = toks[False]  # no byte pieces: the labels are the pieces
    assert old.labels(old.encode("Zoë alpha")) == [old.piece(i) for i in old.encode("Zoë alpha")]


def test_a_translation_spelling_a_line_break_or_tab_in_bytes_stays_one_line(toks: dict[bool, Tokenizer]) -> None:
    """Byte pieces can spell LF, CR, tab, NEL or U+2028 (no training sentence holds one): a sampled translation
    of an undertrained model did, and translate wrote more lines than it read, nbest lines with extra fields."""
    tok = toks[True]
    a, b = tok.encode("a")[-1], tok.encode("b")[-1]
    for spelled in ("\n", "\r", "\r\n", "\t", "\x0b", "\x1c", "\x85", "\u2028"):
        ids = [a, *(tok.id(f"<0x{byte:02X}>") for byte in spelled.encode("utf-8")), b]
        assert tok.decode(ids) == "a b" and tok.decode_batch([ids, [b]]) == ["a b", "b"], repr(spelled)
    assert tok.decode(tok.encode("a  b")) == "a b" and tok.decode([tok.id("<0x20>"), a]) == " a"  # others unchanged


def test_whitespace_is_normalised_as_prepare_normalises_it(toks: dict[bool, Tokenizer], tmp_path: Path) -> None:
    """NEL (U+0085, cp1252 text read as Latin-1) and the separators U+001C-U+001F are whitespace to prepare's
    reader but not to SentencePiece: a sentence encoded them as bytes at inference and as a space in training."""
    from nmtflow.data.corpus import iter_parallel

    tok = toks[True]
    for line in ("a\x85b", "a\x1fb", "a\u2028 b", " a\u3000b "):
        path = tmp_path / "line.txt"
        path.write_text(line + "\n", encoding="utf-8")
        [(_, (read,))] = list(iter_parallel([path]))
        assert tok.encode(line) == tok.encode(read) == tok.encode("a b"), repr(line)
        assert tok.encode_batch([line, read]) == [tok.encode("a b")] * 2


@pytest.mark.parametrize("byte_fallback", [True, False])
def test_the_smallest_vocabulary_works_and_one_less_names_it(text: Path, tmp_path: Path, byte_fallback: bool) -> None:
    smallest = minimum(text, byte_fallback)
    tok = Tokenizer.train([text], tmp_path / "ok", smallest, byte_fallback=byte_fallback)
    assert tok.vocab_size == smallest
    assert tok.decode(tok.encode("Zoë alpha")) == ("Zoë alpha" if byte_fallback else " ⁇ o ⁇  alpha")
    with pytest.raises(ValueError, match=f"vocabulary size {smallest - 1} is too small: the minimum is {smallest} "):
        Tokenizer.train([text], tmp_path / "small", smallest - 1, byte_fallback=byte_fallback)
    with pytest.raises(ValueError, match=r"vocabulary size 99999999999 is too large: SentencePiece takes at most "
                                         r"2,147,483,647"):  # before: SentencePiece's "cannot parse ... as int"
        Tokenizer.train([text], tmp_path / "huge", 99_999_999_999, byte_fallback=byte_fallback)
    if byte_fallback:  # a vocabulary that is enough without the bytes: the error names that way out
        with pytest.raises(ValueError) as info:
            Tokenizer.train([text], tmp_path / "small", 100)
        assert str(text) in str(info.value)
        assert f"(--no-byte-fallback, byte_fallback=False), which needs {smallest - 256}" in str(info.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ok.model", "ok.vocab"]  # nothing left by the failures


def test_prepare_records_the_setting_and_uses_it(tmp_path: Path) -> None:
    rows = copy_sentences(60, 2)
    write_split(tmp_path / "raw" / "train", rows, rows, ("en", "de"))
    size = 4 + len(set("".join(rows))) + 256 + 10
    for byte_fallback in (True, False):
        out = tmp_path / f"out{byte_fallback}"
        meta = prepare({"train": str(tmp_path / "raw" / "train")}, ["en", "de"], out, vocab_size=size, joint=False,
                       progress=False, byte_fallback=byte_fallback)
        assert meta["byte_fallback"] is byte_fallback
        assert json.loads((out / "meta.json").read_text(encoding="utf-8"))["byte_fallback"] is byte_fallback
        if byte_fallback:  # the bytes are part of the size asked for (without them, 60 lines hold fewer merges)
            assert meta["vocab_size"] == {"en": size, "de": size}
        for lang in ("en", "de"):
            tok = load_tokenizer(out, lang)
            assert tok.byte_fallback is byte_fallback
            assert (tok.decode(tok.encode("Zoë 😀")) == "Zoë 😀") is byte_fallback


def test_the_command_line_option(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows = copy_sentences(40, 3)
    write_split(tmp_path / "raw" / "train", rows, rows, ("en", "de"))
    base = ["prepare", "--train", str(tmp_path / "raw" / "train"), "--langs", "en", "de"]
    assert main([*base, "--out", str(tmp_path / "off"), "--vocab-size", "60", "--no-byte-fallback"]) == 0
    assert load_meta(tmp_path / "off")["byte_fallback"] is False
    assert load_tokenizer(tmp_path / "off", "en").byte_fallback is False
    capsys.readouterr()
    assert main([*base, "--out", str(tmp_path / "on"), "--vocab-size", "60"]) == 2  # too small with the bytes
    err = capsys.readouterr().err
    smallest = 4 + len(set("".join(rows))) + 256
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert f"vocabulary size 60 is too small: the minimum is {smallest} " in err and "--no-byte-fallback" in err
    assert not (tmp_path / "on").exists()
    assert main([*base, "--out", str(tmp_path / "on"), "--vocab-size", str(smallest)]) == 0
    assert load_meta(tmp_path / "on")["byte_fallback"] is True
    assert main(["prepare", "--out", str(tmp_path / "on"), "--add", f"test={tmp_path / 'raw' / 'train'}",
                 "--no-byte-fallback"]) == 2
    assert "--no-byte-fallback belong to a new preparation" in capsys.readouterr().err
