"""Input the source vocabulary lacks: one warning per translation with counts (old tokenizers); byte pieces in the
output (byte fallback) come back as characters, never as ``<0x..>``."""
from __future__ import annotations

import logging
from pathlib import Path

import pytest

from nmtflow.cli import main
from nmtflow.data.vocab import UNK
from nmtflow.decode.translate import Translator
from tests.conftest import copy_sentences, tiny_config, write_split

pytestmark = pytest.mark.usefixtures("one_thread")

LINES = ["alpha Zoë bravo", "charlie delta", "😀 echo 漢字", "golf", "kilo Ωmega"]
LOGGER = "nmtflow.decode.unknowns"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    """A 1-update model per setting, on a copy task whose text has none of the characters of ``LINES``' other
    words (ë, 😀, 漢字, Ω)."""
    from nmtflow.data.prepare import prepare
    from nmtflow.train.trainer import Trainer

    root = tmp_path_factory.mktemp("unknowns")
    rows = copy_sentences(200, 1)
    write_split(root / "raw" / "train", rows, rows)
    write_split(root / "raw" / "valid", rows[:5], rows[:5])
    out = {}
    for byte_fallback in (True, False):
        data = root / f"data{byte_fallback}"
        prepare({"train": str(root / "raw" / "train"), "valid": str(root / "raw" / "valid")}, ["src", "tgt"], data,
                progress=False,
                vocab_size=4 + len(set("".join(rows))) + 256 * byte_fallback + 20, byte_fallback=byte_fallback)
        config = tiny_config(data, root / f"model{byte_fallback}", max_updates=1, validate_every=0, save_every=1,
                             valid_bleu=False)
        Trainer(config).train()
        out[byte_fallback] = root / f"model{byte_fallback}" / "checkpoint_last.pt"
    return out


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.WARNING]


def test_one_warning_per_call_with_the_counts(checkpoints: dict[bool, Path],
                                              caplog: pytest.LogCaptureFixture) -> None:
    translator = Translator.from_checkpoint(checkpoints[False])
    translator.decode.beam_size = 1
    tok = translator.src_tokenizer
    ids = [tok.encode(line) for line in LINES]  # the count, reckoned here from the ids
    sentences, pieces = sum(UNK in seq for seq in ids), sum(seq.count(UNK) for seq in ids)
    assert sentences == 3 and pieces == 5  # Z, ë, 😀, 漢字 (one piece: unknown characters side by side), Ω
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        translator.translate(LINES, name="in.txt")
    assert warnings_of(caplog) == [
        f"in.txt: 3 of 5 input sentences contain pieces unknown to the source vocabulary ({pieces} pieces: 'Z', "
        "'ë', '😀', '漢字', 'Ω'); they are translated as <unk>; the source tokenizer has no byte fallback: one prepared "
        "with it spells unseen characters as bytes"]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=LOGGER):  # a stream of one-line chunks: one warning at its end
        assert len(list(translator.translate_stream(LINES * 2, chunk=1))) == 10
        translator.translate(LINES[1:2])  # nothing unknown: no warning
    assert len(warnings_of(caplog)) == 1 and warnings_of(caplog)[0].startswith("6 of 10 input sentences")
    assert f"({2 * pieces} pieces:" in warnings_of(caplog)[0] and translator.unknowns is None


def test_no_warning_with_byte_fallback(checkpoints: dict[bool, Path], caplog: pytest.LogCaptureFixture) -> None:
    translator = Translator.from_checkpoint(checkpoints[True])
    translator.decode.beam_size = 1
    assert all(UNK not in translator.src_tokenizer.encode(line) for line in LINES)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        translator.translate(LINES)
        list(translator.translate_stream(LINES, chunk=2))
    assert warnings_of(caplog) == []


def test_translate_command_output_has_characters_not_byte_pieces(
        checkpoints: dict[bool, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An untrained model's output is mostly byte pieces (256 of its ~300); they are detokenised as characters, and
    a sequence of them that is no UTF-8 becomes U+FFFD, without a crash. A model that copies its input (search
    replaced by the source's ids) gives back the unseen characters."""
    src = tmp_path / "in.txt"
    src.write_text("".join(line + "\n" for line in LINES), encoding="utf-8")
    searched = []
    real_search = Translator.search

    def recording(self: Translator, batch, **options):  # the hypotheses' ids, to check that bytes were produced
        hyps = real_search(self, batch, **options)
        searched.extend(h.tokens for nbest in hyps for h in nbest)
        return hyps

    monkeypatch.setattr(Translator, "search", recording)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert main(["translate", str(checkpoints[True]), "-i", str(src), "-o", str(tmp_path / "out.txt"),
                     "--greedy", "--max-len-b", "8", "--device", "cpu"]) == 0
    tok = Translator.from_checkpoint(checkpoints[True]).tgt_tokenizer
    assert any(tok.piece(i).startswith("<0x") for seq in searched for i in seq)
    out = (tmp_path / "out.txt").read_text(encoding="utf-8").splitlines()
    assert len(out) == len(LINES) and "<0x" not in "".join(out) and warnings_of(caplog) == []

    def copying(self: Translator, batch, **options):
        from nmtflow.decode.search import Hypothesis
        from nmtflow.data.vocab import EOS, PAD

        return [[Hypothesis([i for i in row if i not in (PAD, EOS)], 0.0, 0.0)] for row in batch.tolist()]

    monkeypatch.setattr(Translator, "search", copying)
    assert main(["translate", str(checkpoints[True]), "-i", str(src), "-o", str(tmp_path / "copy.txt"),
                 "--device", "cpu"]) == 0
    assert (tmp_path / "copy.txt").read_text(encoding="utf-8").splitlines() == LINES


def test_translate_command_warns_once_for_an_old_tokenizer(checkpoints: dict[bool, Path], tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    src = tmp_path / "in.txt"
    src.write_text("".join(line + "\n" for line in LINES * 3), encoding="utf-8")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        assert main(["translate", str(checkpoints[False]), "-i", str(src), "-o", str(tmp_path / "out.txt"),
                     "--greedy", "--max-len-b", "4", "--device", "cpu"]) == 0
    assert len(warnings_of(caplog)) == 1
    assert warnings_of(caplog)[0].startswith(f"{src}: 9 of 15 input sentences contain pieces unknown")
