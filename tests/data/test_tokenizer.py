import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from nmtflow.data.corpus import normalize_line
from nmtflow.data.tokenizer import Tokenizer, same_model
from nmtflow.data.vocab import BOS, EOS, PAD, UNK, lang_tag

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
TEXTS = [FIXTURES / "tiny.en", FIXTURES / "tiny.de"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    out = tmp_path_factory.mktemp("spm") / "spm"
    return Tokenizer.train(TEXTS, out, vocab_size=300, byte_fallback=False,
                           user_symbols=[lang_tag("en"), lang_tag("de")])


def fixture_lines():
    return [normalize_line(l) for p in TEXTS for l in p.read_text(encoding="utf-8").splitlines()]


def test_special_ids(tok):
    assert (PAD, UNK, BOS, EOS) == (0, 1, 2, 3)
    assert [tok.piece(i) for i in range(4)] == ["<pad>", "<unk>", "<s>", "</s>"]
    assert [tok.id(p) for p in ["<pad>", "<unk>", "<s>", "</s>"]] == [0, 1, 2, 3]
    assert tok.vocab_size == 300
    assert tok.path.name == "spm.model" and tok.path.is_file()


def test_round_trip_on_fixtures(tok):
    lines = fixture_lines()
    assert len(lines) == 400
    encoded = tok.encode_batch(lines)
    assert encoded == [tok.encode(l) for l in lines]
    for line, ids in zip(lines, encoded):
        assert ids and min(ids) > EOS  # plain subwords: no specials added
        assert tok.decode(ids) == line
    assert tok.decode_batch(encoded[:5]) == lines[:5]


def test_decode_stops_at_eos_and_skips_pad_bos(tok):
    ids = tok.encode("Das Wetter ist heute schön.")
    other = tok.encode("The dog barks.")
    raw = [BOS] + ids + [EOS] + other + [PAD, PAD]
    assert tok.decode(raw) == "Das Wetter ist heute schön."
    assert tok.decode(np.array(raw, dtype=np.uint16)) == "Das Wetter ist heute schön."
    assert tok.decode(torch.tensor(raw)) == "Das Wetter ist heute schön."
    assert tok.decode([EOS] + ids) == ""
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size + 5])


def test_language_tags_are_single_pieces(tok):
    tag = tok.id("<2de>")
    assert tag > EOS
    # the tag is never split (SentencePiece may emit a separate word-boundary piece before it)
    assert tok.encode("<2de>")[-1] == tag
    ids = tok.encode("<2de> Hallo Welt")
    assert ids.count(tag) == 1 and tok.decode(ids) == "<2de> Hallo Welt"
    assert "<2en>" in tok and "<2xx>" not in tok
    with pytest.raises(KeyError):
        tok.id("<2xx>")
    with pytest.raises(IndexError):
        tok.piece(tok.vocab_size)


def test_oversized_vocab_is_retried_with_soft_limit(tmp_path):
    t = Tokenizer.train([FIXTURES / "tiny.en"], tmp_path / "big", vocab_size=50_000)
    assert 4 < t.vocab_size < 50_000
    line = "The weather is nice today."
    assert t.decode(t.encode(line)) == line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.model", "big.vocab"]  # no temp files left


def test_missing_and_corrupt_models(tmp_path):
    with pytest.raises(ValueError, match="missing.model"):
        Tokenizer(tmp_path / "missing.model")
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"this is not a sentencepiece model")
    with pytest.raises(ValueError, match="bad.model"):
        Tokenizer(bad)


def test_missing_training_file(tmp_path):
    with pytest.raises(ValueError, match="nope.txt"):
        Tokenizer.train([tmp_path / "nope.txt"], tmp_path / "m", 100)


def test_pickle_reloads(tok):
    t2 = pickle.loads(pickle.dumps(tok))
    assert t2.vocab_size == tok.vocab_size
    assert t2.encode("Guten Morgen") == tok.encode("Guten Morgen")


def test_training_again_elsewhere_writes_the_same_model(tok, tmp_path):
    # the trainer's temporary output name and the input paths are not kept: same data, same bytes
    copies = [tmp_path / "copy.en", tmp_path / "copy.de"]
    for src, dst in zip(TEXTS, copies):
        dst.write_bytes(src.read_bytes())
    again = Tokenizer.train(copies, tmp_path / "other" / "spm", vocab_size=300, byte_fallback=False,
                            user_symbols=[lang_tag("en"), lang_tag("de")])
    assert again.path.read_bytes() == tok.path.read_bytes()
    assert b".tmp" not in again.path.read_bytes() and str(tmp_path).encode() not in again.path.read_bytes()


def test_same_model_ignores_file_names_only(tok, tmp_path):
    from sentencepiece import sentencepiece_model_pb2

    data = tok.path.read_bytes()
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(data)
    proto.trainer_spec.model_prefix = "/somewhere/.spm.tmp1234"  # as models written before were
    proto.trainer_spec.input.append("corpus/train.en")
    renamed = proto.SerializeToString()
    assert renamed != data and same_model(renamed, data)
    proto.pieces[10].piece += "x"  # a different vocabulary
    assert not same_model(proto.SerializeToString(), data)


def test_a_checkpoints_tokenizer_is_loaded_from_its_bytes(tok: Tokenizer, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: it was written to a shared temporary file (a stale file under that name was a hazard) and a corrupt
    one was reported under that file's name, not the checkpoint's."""
    import tempfile

    from nmtflow.data.corpus import CorpusError
    from nmtflow.decode.translate import tokenizer_from_bytes

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    data = Path(tok.path).read_bytes()
    loaded = tokenizer_from_bytes(data, "run/checkpoint_best.pt", "src")
    assert loaded.encode("hello world") == tok.encode("hello world") and loaded.model_proto == data
    assert loaded.path is None and not list(tmp_path.iterdir())  # no file written
    again = pickle.loads(pickle.dumps(loaded))  # data-loader workers: the bytes travel, no file is read
    assert again.encode("hello world") == tok.encode("hello world") and again.name == "run/checkpoint_best.pt"
    with pytest.raises(CorpusError) as caught:
        tokenizer_from_bytes(data[: len(data) // 2], "run/checkpoint_best.pt", "tgt")
    assert str(caught.value) == ("run/checkpoint_best.pt: cannot load its tgt SentencePiece model (not a "
                                 "SentencePiece model, or a corrupted one)")
    assert not list(tmp_path.iterdir())