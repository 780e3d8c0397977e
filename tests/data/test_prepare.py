import json
from pathlib import Path

import pytest

from nmtflow.data.binarize import IndexedDataset
from nmtflow.data.corpus import CleanConfig, CorpusError, keep_row, normalize_line
from nmtflow.data.prepare import load_meta, load_split, load_tokenizer, prepare
from nmtflow.data.tokenizer import Tokenizer

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def read(lang):
    return (FIXTURES / f"tiny.{lang}").read_text(encoding="utf-8").splitlines()


def write_split(dirpath: Path, name: str, en: list[str], de: list[str]) -> str:
    (dirpath / f"{name}.en").write_text("".join(l + "\n" for l in en), encoding="utf-8")
    (dirpath / f"{name}.de").write_text("".join(l + "\n" for l in de), encoding="utf-8")
    return str(dirpath / name)


@pytest.fixture()
def corpus(tmp_path):
    en, de = read("en"), read("de")
    raw = tmp_path / "raw"
    raw.mkdir()
    return {
        "train": str(FIXTURES / "tiny"),
        "valid": write_split(raw, "valid", en[:20], de[:20]),
        "test": write_split(raw, "test", en[20:35], de[20:35]),
    }


def test_prepare_end_to_end(tmp_path, corpus):
    out = tmp_path / "prepared"
    meta = prepare(corpus, ["en", "de"], out, vocab_size=300, byte_fallback=False)
    assert meta == json.loads((out / "meta.json").read_text()) == load_meta(out)
    assert meta["langs"] == ["en", "de"] and meta["joint"] is True
    assert meta["tokenizers"] == {"en": "spm.model", "de": "spm.model"}
    assert meta["vocab_size"] == {"en": 300, "de": 300}
    assert meta["splits"]["valid"] == {"rows": 20, "dropped": 0, "lines": 20}
    assert meta["splits"]["test"]["rows"] == 15
    train = meta["splits"]["train"]
    assert train["lines"] == 200 and train["rows"] + train["dropped"] == 200
    assert meta["source_files"]["train"]["de"] == str((FIXTURES / "tiny.de").resolve())
    for split, info in meta["splits"].items():
        en, de = IndexedDataset(out / f"{split}.en"), IndexedDataset(out / f"{split}.de")
        assert len(en) == len(de) == info["rows"]
    # rows stay aligned and decode back to the source text
    tok = load_tokenizer(out, "de")
    valid_de = load_split(out, "valid", "de")
    valid_en = load_split(out, "valid", "en")
    for i, (e, d) in enumerate(zip(read("en")[:20], read("de")[:20])):
        assert tok.decode(valid_de[i]) == d
        assert tok.decode(valid_en[i]) == e
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temp files left


def test_cleaning_drops_exactly_the_failing_rows(tmp_path):
    en, de = read("en"), read("de")
    en[3], de[7] = "", "   "  # empty sides
    en[10] = "Yes."
    de[10] = " ".join(read("de")[10:16])  # far too long for its source
    en[12] = " ".join(read("en")[:40])  # over max_len
    de[12] = " ".join(read("de")[:40])
    prefix = write_split(tmp_path, "train", en, de)
    cfg = CleanConfig(max_len=120, max_ratio=2.5)
    out = tmp_path / "out"
    meta = prepare({"train": prefix}, ["en", "de"], out, vocab_size=300, byte_fallback=False, clean=cfg)

    tok = Tokenizer(out / "spm.model")
    enc_en = tok.encode_batch([normalize_line(l) for l in en])
    enc_de = tok.encode_batch([normalize_line(l) for l in de])
    kept = [i for i in range(len(en)) if keep_row([len(enc_en[i]), len(enc_de[i])], cfg)]
    for i in (3, 7, 10, 12):
        assert i not in kept
    assert meta["splits"]["train"] == {"rows": len(kept), "dropped": 200 - len(kept), "lines": 200}
    ds_en, ds_de = IndexedDataset(out / "train.en"), IndexedDataset(out / "train.de")
    assert [ds_en[j].tolist() for j in range(len(ds_en))] == [enc_en[i] for i in kept]
    assert [ds_de[j].tolist() for j in range(len(ds_de))] == [enc_de[i] for i in kept]


def test_empty_line_in_valid_split_is_an_error(tmp_path, corpus):
    en, de = read("en")[:5], read("de")[:5]
    de[2] = ""
    corpus["valid"] = write_split(tmp_path, "bad", en, de)
    out = tmp_path / "out"
    with pytest.raises(CorpusError) as err:
        prepare(corpus, ["en", "de"], out, vocab_size=300, byte_fallback=False)
    assert str(err.value).startswith(f"{tmp_path / 'bad.de'}:3: ")
    assert not (out / "meta.json").exists() and not (out / "spm.model").exists()


def test_mismatched_training_files_fail_before_training(tmp_path):
    prefix = write_split(tmp_path, "train", read("en"), read("de")[:-1])
    out = tmp_path / "out"
    with pytest.raises(CorpusError, match="has 199 lines"):
        prepare({"train": prefix}, ["en", "de"], out, vocab_size=300, byte_fallback=False)
    assert not (out / "spm.model").exists()


def test_separate_vocabularies_with_language_tags(tmp_path, corpus):
    out = tmp_path / "sep"
    meta = prepare({"train": corpus["train"]}, ["en", "de"], out, vocab_size=250, byte_fallback=False, joint=False,
                   lang_tags=True, progress=False)
    assert meta["tokenizers"] == {"en": "spm.en.model", "de": "spm.de.model"}
    for lang in ("en", "de"):
        tok = Tokenizer(out / f"spm.{lang}.model")
        assert tok.id("<2en>") in tok.encode("<2en> x") and "<2de>" in tok
        assert meta["vocab_size"][lang] == tok.vocab_size
    assert len(IndexedDataset(out / "train.en")) == len(IndexedDataset(out / "train.de"))


def test_load_meta_on_unprepared_directory(tmp_path):
    with pytest.raises(ValueError, match="not a prepared data directory"):
        load_meta(tmp_path)
    with pytest.raises(ValueError, match="not found"):
        load_meta(tmp_path / "nowhere")
    (tmp_path / "meta.json").write_text("{broken")
    with pytest.raises(ValueError, match="meta.json"):
        load_meta(tmp_path)


def test_missing_train_split_is_rejected(tmp_path, corpus):
    with pytest.raises(ValueError, match="train"):
        prepare({"valid": corpus["valid"]}, ["en", "de"], tmp_path / "o")


def test_workers_encode_in_order_and_write_identical_output(tmp_path, corpus):
    outs = {}
    for workers in (1, 2):  # small chunks: many of them in flight, each encoded by whichever worker is free
        outs[workers] = tmp_path / f"w{workers}"
        prepare(corpus, ["en", "de"], outs[workers], vocab_size=200, byte_fallback=False, joint=False, chunk_size=16,
                workers=workers,
                progress=False)
    files = sorted(p.name for p in outs[1].iterdir())
    assert files == sorted(p.name for p in outs[2].iterdir()) and "train.de.bin" in files
    for name in files:  # a .model also records where it was trained (its path); its pieces are in the .vocab
        if not name.endswith(".model"):
            assert (outs[1] / name).read_bytes() == (outs[2] / name).read_bytes(), name
    with pytest.raises(ValueError, match="workers"):
        prepare(corpus, ["en", "de"], tmp_path / "w0", workers=0)


def test_ordered_map_keeps_order_and_reads_ahead_boundedly():
    from concurrent.futures import Future

    from nmtflow.data.prepare import _ordered_map

    read = []

    def items():
        for i in range(20):
            read.append(i)
            yield i

    def submit(x):
        f = Future()
        f.set_result(x * x)
        return f

    out = []
    for y in _ordered_map(submit, items(), 3):
        out.append(y)
        assert len(read) - len(out) <= 3  # never more than the window ahead of the consumer
    assert out == [i * i for i in range(20)]


def test_empty_valid_split_is_an_error(tmp_path, corpus):
    corpus["valid"] = write_split(tmp_path, "empty", [], [])
    with pytest.raises(CorpusError) as err:
        prepare(corpus, ["en", "de"], tmp_path / "out", vocab_size=300, byte_fallback=False)
    assert str(err.value).startswith(f"{tmp_path / 'empty.en'}: the valid split is empty")


def test_a_training_split_without_a_row_of_text_is_an_error(tmp_path, corpus):
    """Blank lines only, or text on one side at a time: SentencePiece failed with its internal error."""
    for name, en, de, blamed in (("blank", ["", " "], ["", "\t"], "en: ... 2 of its 2"),
                                 ("apart", ["a b", "", ""], ["", "c d", ""], "en: ... 2 of its 3"),
                                 ("one", ["a b", "c d"], ["", " \u200b"], "de: ... 2 of its 2")):
        corpus["train"] = write_split(tmp_path, name, en, de)
        with pytest.raises(CorpusError) as err:
            prepare(corpus, ["en", "de"], tmp_path / "out", vocab_size=300, byte_fallback=False)
        side, count = blamed.split(": ... ")
        assert str(err.value) == (f"{tmp_path / name}.{side}: the training split has no row with text in every file: "
                                  f"{count} lines are blank")
    assert not (tmp_path / "out").exists()


def test_a_failed_check_leaves_a_prepared_directory_usable(tmp_path, corpus):
    out = tmp_path / "prepared"
    meta = prepare(corpus, ["en", "de"], out, vocab_size=300, byte_fallback=False)
    model = (out / "spm.model").read_bytes()
    with pytest.raises(CorpusError, match="file not found"):
        prepare(corpus, ["en", "dee"], out, vocab_size=300, byte_fallback=False)  # a typo in the languages
    assert load_meta(out) == meta and (out / "spm.model").read_bytes() == model
    again = prepare(corpus, ["en", "de"], out, vocab_size=300, byte_fallback=False)
    assert again == meta  # and preparing again is byte-identical
    assert (out / "spm.model").read_bytes() == model
