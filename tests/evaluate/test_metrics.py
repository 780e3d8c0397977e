"""``nmtflow evaluate``'s metrics: several references, chrF++ and TER, sacreBLEU's tokenizers and lowercasing,
each equal to sacreBLEU called directly; the comparison's BLEU tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import sacrebleu

from nmtflow.cli import main
from nmtflow.config import ConfigError
from nmtflow.evaluate.experiment import load_experiment
from nmtflow.evaluate.significance import paired_bootstrap
from tests.evaluate.test_compare import TINY

HYP = ["The cat sat on the mat .", "a dog barks loudly", "她喜欢读书。"]
REF1 = ["the cat sat on a mat .", "A dog is barking", "她喜欢看书。"]
REF2 = ["The cat was sitting on the mat .", "a dog barks loudly", "她爱读书。"]


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    paths = {}
    for name, lines in (("hyp", HYP), ("ref1", REF1), ("ref2", REF2), ("short", REF1[:2])):
        (tmp_path / name).write_text("".join(line + "\n" for line in lines), encoding="utf-8")
        paths[name] = str(tmp_path / name)
    return paths


def scores(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, dict[str, float | str]]:
    assert main(["evaluate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_several_references_and_every_metric_equal_sacrebleu(files: dict[str, str],
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    got = scores(["--hyp", files["hyp"], "--ref", files["ref1"], files["ref2"], "--metrics", "bleu", "chrf",
                  "chrf++", "ter"], capsys)
    refs = [REF1, REF2]
    expected = {"BLEU": sacrebleu.metrics.BLEU().corpus_score(HYP, refs).score,
                "chrF2": sacrebleu.metrics.CHRF().corpus_score(HYP, refs).score,
                "chrF2++": sacrebleu.metrics.CHRF(word_order=2).corpus_score(HYP, refs).score,
                "TER": sacrebleu.metrics.TER().corpus_score(HYP, refs).score}
    assert list(got) == list(expected)
    for name, score in expected.items():
        assert got[name]["score"] == round(score, 2)
        assert "nrefs:2" in str(got[name]["signature"])
    one = scores(["--hyp", files["hyp"], "--ref", files["ref1"]], capsys)  # the default: BLEU and chrF, one ref
    assert list(one) == ["BLEU", "chrF2"] and one["BLEU"]["score"] < got["BLEU"]["score"]


@pytest.mark.parametrize("tokenize", ["zh", "char", "intl"])
def test_the_bleu_tokenizer_and_lowercasing_reach_sacrebleu(tokenize: str, files: dict[str, str],
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    got = scores(["--hyp", files["hyp"], "--ref", files["ref1"], "--tokenize", tokenize, "--lowercase"], capsys)
    metric = sacrebleu.metrics.BLEU(tokenize=tokenize, lowercase=True)
    assert got["BLEU"]["score"] == round(metric.corpus_score(HYP, [REF1]).score, 2)
    assert f"tok:{tokenize}" in str(got["BLEU"]["signature"]) and "case:lc" in str(got["BLEU"]["signature"])
    assert got["chrF2"]["score"] == round(sacrebleu.metrics.CHRF(lowercase=True).corpus_score(HYP, [REF1]).score, 2)


@pytest.mark.parametrize("extra, message", [
    (["--metrics", "meteor"], "--metrics: unknown 'meteor'"),
    (["--tokenize", "13b"], "--tokenize: unknown BLEU tokenizer '13b'"),
    (["--metrics", "chrf", "--tokenize", "zh"], "--tokenize: sets BLEU's tokenizer, but --metrics has no bleu"),
])
def test_bad_metric_options_are_one_line_errors(extra: list[str], message: str, files: dict[str, str],
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["evaluate", "--hyp", files["hyp"], "--ref", files["ref1"], *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_a_reference_not_in_nfc_is_warned_about(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                               caplog: pytest.LogCaptureFixture) -> None:
    """The same text decomposed (NFD, as macOS tools write it) scored BLEU 78.66 without a word."""
    import unicodedata

    text = ["Ein Mädchen läuft .", "zwei Hunde", "Čeština"]
    nfc, nfd = tmp_path / "nfc", tmp_path / "nfd"
    nfc.write_text("".join(line + "\n" for line in text), encoding="utf-8")
    nfd.write_text(unicodedata.normalize("NFD", nfc.read_text(encoding="utf-8")), encoding="utf-8")
    with caplog.at_level("WARNING", logger="nmtflow"):
        assert scores(["--hyp", str(nfc), "--ref", str(nfc)], capsys)["BLEU"]["score"] == 100
        assert not caplog.records
        assert scores(["--hyp", str(nfc), "--ref", str(nfd)], capsys)["BLEU"]["score"] < 100
    [record] = caplog.records
    assert record.getMessage().startswith(f"{nfd}: 2 of 3 lines are not in Unicode NFC (first: line 1); BLEU and chrF")


def test_a_reference_of_another_length_is_named(files: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["evaluate", "--hyp", files["hyp"], "--ref", files["ref1"], files["short"]]) == 2
    assert f"{files['hyp']} has 3 lines but {files['short']} has 2" in capsys.readouterr().err


def test_metric_options_do_not_apply_to_perplexity(capsys: pytest.CaptureFixture[str]) -> None:
    for extra in (["--metrics", "ter"], ["--tokenize", "zh"], ["--lowercase"]):
        assert main(["evaluate", "--perplexity", "CKPT", "--data", "DIR", *extra]) == 2
        assert f"{extra[0]}: does not apply to --perplexity" in capsys.readouterr().err


def test_the_comparison_scores_and_tests_with_its_bleu_tokenizer(tmp_path: Path) -> None:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY, encoding="utf-8")
    assert load_experiment(path, ["bleu_tokenize=zh"]).bleu_tokenize == "zh"
    with pytest.raises(ConfigError, match="override 'bleu_tokenize=13b': bleu_tokenize: unknown BLEU tokenizer"):
        load_experiment(path, ["bleu_tokenize=13b"])
    # the paired bootstrap's BLEU is the tokenizer's: Chinese without spaces is one 13a token per sentence
    base, other = ["她喜欢看书。", "我们去公园。"], ["她喜欢读书。", "我们去公园。"]
    refs = ["她喜欢读书。", "我们去公园散步。"]
    for tokenize in ("13a", "zh"):
        result = paired_bootstrap(base, {"other": other}, refs, samples=20, tokenize=tokenize)["other"]
        assert result["bleu"] == pytest.approx(sacrebleu.metrics.BLEU(tokenize=tokenize).corpus_score(other, [refs]).score)


def test_validation_bleu_uses_the_runs_tokenizer(copy_data: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from nmtflow.train import trainer as trainer_module
    from tests.conftest import tiny_config

    used: list[str] = []
    real = trainer_module.bleu

    def recording_bleu(hypotheses: list[str], references: list[str], tokenize: str = "13a") -> object:
        used.append(tokenize)
        return real(hypotheses, references, tokenize=tokenize)

    monkeypatch.setattr(trainer_module, "bleu", recording_bleu)
    config = tiny_config(copy_data, tmp_path / "run", max_updates=2, validate_every=2, valid_bleu_max_sentences=4,
                         valid_bleu_tokenize="char")
    trainer_module.Trainer(config).train()
    assert used and set(used) == {"char"}
    with pytest.raises(ConfigError, match="train.valid_bleu_tokenize: unknown BLEU tokenizer '13b'"):
        tiny_config(copy_data, tmp_path / "bad", valid_bleu_tokenize="13b")


def test_a_comparisons_bleu_tokenizer_reaches_its_runs_without_moving_earlier_fingerprints(tmp_path: Path) -> None:
    from nmtflow.evaluate.compare import PreparedData, fingerprint, run_config

    path = tmp_path / "tiny.yaml"
    path.write_text(TINY, encoding="utf-8")
    data = PreparedData(dir=tmp_path / "data")
    plain = run_config(load_experiment(path), 0, 1, data, tmp_path / "run").to_dict()
    zh = run_config(load_experiment(path, ["bleu_tokenize=zh"]), 0, 1, data, tmp_path / "run").to_dict()
    assert plain["train"]["valid_bleu_tokenize"] == "13a" and zh["train"]["valid_bleu_tokenize"] == "zh"
    before = {**plain, "train": {k: v for k, v in plain["train"].items() if k != "valid_bleu_tokenize"}}
    assert fingerprint(before) == fingerprint(plain) != fingerprint(zh)  # run.yaml of a version without the key
