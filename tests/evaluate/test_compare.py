"""``nmtflow compare``: a tiny two-config comparison end to end, resumable reruns, strict experiment files."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from nmtflow.cli import main
from nmtflow.config import ConfigError
from nmtflow.evaluate import compare
from nmtflow.evaluate.compare import PreparedData, run_comparison, run_config
from nmtflow.evaluate.compare_job import load_texts, read_lines
from nmtflow.evaluate.experiment import load_experiment
from nmtflow.models.base import Vocabularies, build_model, count_parameters
from nmtflow.models.multilingual import LanguageVocabularies

REPO = Path(__file__).resolve().parents[2]

TINY = """\
name: tiny
data:
  synthetic: {n_train: 300, n_valid: 20, n_test: 20, langs: [en, de]}
  directions: [en-de]
  vocab_size: 200
overrides: [model.d_model=32, model.ffn_dim=64, model.heads=2, model.encoder_layers=1, model.decoder_layers=1,
            data.max_tokens=1000, train.warmup_updates=5, train.validate_every=5, train.save_every=5,
            train.log_every=1, train.progress=false, train.valid_bleu_max_sentences=10]
runs:
  - {name: baseline, config: transformer-small}
  - {name: shortcuts, config: shortcuts-small, overrides: [train.warmup_updates=5]}
budget: {updates: 10}
seeds: [1]
average_last: 2
decode: {beam_size: 2, max_len_a: 1.2, max_len_b: 4}
test_sets: [test]
threads: 1
"""


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, compare.ComparisonResult]:
    root = tmp_path_factory.mktemp("compare")
    (root / "tiny.yaml").write_text(TINY, encoding="utf-8")
    result = run_comparison(root / "tiny.yaml", out=root / "out")
    return root / "tiny.yaml", root / "out", result


def table_rows(md: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip().strip("|").split("|")] for line in md.splitlines() if line.startswith("|")]


def test_two_config_comparison_writes_table_json_and_plots(compared) -> None:
    _, out, result = compared
    assert not result.failed
    md = (out / "results.md").read_text(encoding="utf-8")
    assert "- command: `nmtflow compare" in md and "- budget: 10 updates per run" in md and "- machine:" in md
    rows = table_rows(md)
    head, sep, body = rows[0], rows[1], rows[2:]
    assert head == ["run", "BLEU", "chrF", "parameters", "train tok/s", "decode sent/s", "peak memory", "wall time"]
    assert set(sep) <= {"---", "---:"}
    assert [r[0] for r in body] == ["baseline", "shortcuts"]
    assert all(len(r) == len(head) and "–" not in r for r in body)

    data = json.loads((out / "results.json").read_text(encoding="utf-8"))
    runs = {r["name"]: r for r in data["runs"]}
    assert set(runs) == {"baseline", "shortcuts"}
    for r in runs.values():
        assert r["status"] == "done" and r["updates"] == 10
        assert 0.0 <= r["scores"]["test en-de"]["bleu"]["mean"] <= 100.0
        assert r["train_tokens_per_s"] > 0 and r["decode_sentences_per_s"] > 0 and r["peak_memory_mb"] > 0
        assert r["seeds"][0]["result"]["checkpoint"] == "averaged.pt"
        assert r["seeds"][0]["result"]["averaged_from"] == ["checkpoint_5.pt", "checkpoint_10.pt"]
    assert runs["shortcuts"]["parameters"] > runs["baseline"]["parameters"]  # the gated E → K/V projections
    for name in ("valid_bleu.png", "valid_loss.png", "train_loss.png", "bleu_vs_parameters.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    hyp = out / "runs" / "baseline" / "seed-1" / "hyp.test.en-de.txt"
    assert len(hyp.read_text(encoding="utf-8").splitlines()) == 20


def test_rerun_skips_finished_runs(compared, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    experiment, out, _ = compared
    watched = [out / "runs" / n / "seed-1" / f for n in ("baseline", "shortcuts")
               for f in ("checkpoint_last.pt", "log.jsonl", "finished.json")]
    before = [p.stat().st_mtime_ns for p in watched]

    def no_training(*args, **kwargs):
        raise AssertionError("a finished run was started again")

    monkeypatch.setattr(compare, "execute", no_training)
    with caplog.at_level(logging.INFO, logger="nmtflow.compare"):
        result = run_comparison(experiment, out=out)
    assert [p.stat().st_mtime_ns for p in watched] == before
    assert sum("finished earlier, skipped" in r.getMessage() for r in caplog.records) == 2
    assert [r["status"] for r in result.runs] == ["done", "done"]


def test_new_decode_settings_decode_again_without_training(compared) -> None:
    experiment, out, _ = compared
    ckpt = out / "runs" / "baseline" / "seed-1" / "checkpoint_last.pt"
    before = ckpt.stat().st_mtime_ns
    result = run_comparison(experiment, out=out, overrides=["decode.beam_size=1", "isolate=false",
                                                            "decode.max_sentences=5"])
    assert ckpt.stat().st_mtime_ns == before
    assert all(r["scores"]["test en-de"]["bleu"]["n"] == 1 for r in result.runs)
    done = json.loads((out / "runs" / "shortcuts" / "seed-1" / "finished.json").read_text(encoding="utf-8"))
    assert done["scores"]["test en-de"]["sentences"] == 5


def test_unknown_experiment_key_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(TINY.replace("overrides: [train.warmup_updates=5]", "overides: [train.warmup_updates=5]"),
                   encoding="utf-8")
    with pytest.raises(ConfigError, match=r"bad\.yaml: runs\[1\]: unknown key 'overides'"):
        load_experiment(bad)
    bad.write_text(TINY + "budjet: {updates: 5}\n", encoding="utf-8")
    assert main(["compare", str(bad), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "bad.yaml" in err and "'budjet'" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    bad.write_text(TINY.replace("[train.warmup_updates=5]", "[train.max_updates=99]"), encoding="utf-8")
    with pytest.raises(ConfigError, match="train.max_updates is set by the experiment"):
        load_experiment(bad)


@pytest.mark.parametrize("name", sorted(p.name for p in (REPO / "experiments").glob("*.yaml")))
def test_shipped_experiments_resolve(name: str, tmp_path: Path) -> None:
    exp = load_experiment(REPO / "experiments" / name, ["data.path=somewhere"] if name != "quick.yaml" else [])
    data = PreparedData(tmp_path)
    langs = {lang: 64 for lang in exp.data.langs}
    for index, run in enumerate(exp.runs):
        config = run_config(exp, index, exp.seeds[0], data, tmp_path / run.name)
        assert config.train.seed == exp.seeds[0] and config.train.save_dir == str(tmp_path / run.name)
        vocabs = (LanguageVocabularies(64, 64, encoders=langs, decoders=langs) if config.data.multilingual
                  else Vocabularies(64, 64))
        assert count_parameters(build_model(config.model, vocabs)) > 0  # the overrides fit the model


def test_a_prepared_directory_is_used_as_it_is(compared) -> None:
    experiment, out, _ = compared
    exp = load_experiment(experiment, [f"data.path={out / 'data'}", "data.synthetic=null"])
    data = compare.prepare_data(exp, out / "elsewhere")
    assert data.dir == (out / "data").resolve() and not (out / "elsewhere" / "data").exists()
    assert data.texts["test"]["de"] == str((out / "corpus" / "test.de").resolve())  # raw text from meta.json
    item = {"src_file": None, "ref_file": None, "data_dir": str(data.dir), "split": "test", "src": "en", "tgt": "de"}
    src, ref = load_texts(item, 5)  # without raw files: the prepared split, detokenised
    assert src == read_lines(out / "corpus" / "test.en")[:5] and ref == read_lines(out / "corpus" / "test.de")[:5]


def test_parallel_runs_match_sequential_runs(compared, tmp_path: Path, caplog) -> None:
    """``parallel: 2`` trains both runs at once in their own processes, with the same results as one by one."""
    experiment, out, _ = compared
    with caplog.at_level(logging.INFO, logger="nmtflow.compare"):
        result = run_comparison(experiment, out=tmp_path / "par", overrides=["parallel=2", "devices=[cpu]"])
    assert not result.failed and [r["status"] for r in result.runs] == ["done", "done"]
    assert "training 2 runs, 2 at a time" in caplog.text and caplog.text.count("started on cpu") == 2
    for name in ("baseline", "shortcuts"):
        seq, par = ([r for line in (root / "runs" / name / "seed-1" / "log.jsonl").read_text().splitlines()
                     if "loss" in (r := json.loads(line))] for root in (out, tmp_path / "par"))
        assert len(par) == len(seq) >= 10 and par[-1]["update"] == 10
        assert [r["loss"] for r in par] == pytest.approx([r["loss"] for r in seq], rel=1e-6)


def test_parallel_needs_isolated_runs(compared) -> None:
    experiment, _, _ = compared
    with pytest.raises(ConfigError, match="parallel: 2 runs at once need isolate: true"):
        load_experiment(experiment, ["parallel=2", "isolate=false"])


def test_only_reports_the_named_runs_and_rejects_unknown_names(compared) -> None:
    experiment, out, _ = compared
    ckpt = out / "runs" / "shortcuts" / "seed-1" / "checkpoint_last.pt"
    before = ckpt.stat().st_mtime_ns
    result = run_comparison(experiment, out=out, only=["shortcuts"])
    assert [r["name"] for r in result.runs] == ["shortcuts"] and ckpt.stat().st_mtime_ns == before
    with pytest.raises(ConfigError, match=r"--only: no run named 'nope' \(runs: baseline, shortcuts\)"):
        run_comparison(experiment, out=out, only=["nope"])
