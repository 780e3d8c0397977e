"""``nmtflow compare`` with runs of their own directions (the bridge paper's Table 1 layout): bilingual runs trained
once per direction, a multilingual model type trained per direction (``per_direction``), multilingual runs with
their own trained and zero-shot directions, groups for ``--only``, lowercased BLEU and the paper's figures."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import sacrebleu

from nmtflow.config import ConfigError
from nmtflow.evaluate.compare import run_comparison
from nmtflow.evaluate.compare_job import read_lines
from nmtflow.evaluate.experiment import load_experiment

REPO = Path(__file__).resolve().parents[2]

TABLE = """\
name: table
data:
  synthetic: {n_train: 200, n_valid: 12, n_test: 12, langs: [en, de, fr]}
  langs: [en, de, fr]
  directions: [en-de]
  vocab_size: 150
  byte_fallback: false
  joint: false
overrides: [model.hidden_dim=16, model.encoder_layers=1, model.decoder_layers=1, data.max_tokens=400,
            data.max_sentences=null, train.warmup_updates=1, train.validate_every=0, train.save_every=2,
            train.log_every=1, train.progress=false]
runs:
  - {name: rnn, group: bilingual, config: rnn-m30k, directions: [en-de, de-en]}
  - {name: bridge-bi, group: bilingual, config: bridge-m30k, directions: [en-de, de-en], per_direction: true,
     overrides: [model.bridge_dim=8, model.bridge_heads=2]}
  - {name: bridge-multi, group: multi, config: bridge-m30k, directions: [en-de, de-en, en-fr],
     zero_shot: [de-fr], overrides: [model.bridge_dim=8, model.bridge_heads=2, data.multilingual.copy_pairs=true]}
budget: {updates: 2}
seeds: [1]
decode: {checkpoint: last, beam_size: 1, max_len_a: 1.0, max_len_b: 3}
test_sets: [test]
bootstrap_samples: 0
threads: 1
paper_note: "Table 1, lowercased"
paper:
  rnn: {en-de: 36.78, de-en: 39.0}
  bridge-multi: {de-fr: 0.83}
"""


@pytest.fixture(scope="module")
def table(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("table")
    (root / "table.yaml").write_text(TABLE, encoding="utf-8")
    return root / "table.yaml", root / "out"


def test_only_a_group_trains_one_model_per_direction_and_reports_each_beside_the_paper(table) -> None:
    experiment, out = table
    result = run_comparison(experiment, out=out, overrides=["isolate=false"], only=["bilingual"])
    assert not result.failed and [r["name"] for r in result.runs] == ["rnn", "bridge-bi"]
    for run in ("rnn", "bridge-bi"):
        for direction in ("en-de", "de-en"):
            run_dir = out / "runs" / run / direction / "seed-1"
            config = (run_dir / "run.yaml").read_text(encoding="utf-8")
            assert (run_dir / "checkpoint_last.pt").is_file()
            if run == "rnn":
                src, tgt = direction.split("-")
                assert f"src_lang: {src}" in config and f"tgt_lang: {tgt}" in config
            else:  # a bridge with this direction's encoder and decoder only
                assert f"pairs:\n    - {direction}" in config and "zero_shot: []" in config
    saved = json.loads((out / "results.json").read_text(encoding="utf-8"))
    runs = saved["runs"]
    assert set(runs) == {"rnn", "bridge-bi"}
    assert runs["rnn"]["en-de"]["paper"] == 36.78 and runs["bridge-bi"]["de-en"]["paper"] is None
    for name, direction in (("rnn", "en-de"), ("bridge-bi", "de-en")):
        seed = next(s for s in runs[name]["seeds"] if s["direction"] == direction)
        hyps = read_lines(Path(seed["dir"]) / seed["result"]["scores"][f"test {direction}"]["hypotheses"])
        refs = read_lines(out / "corpus" / f"test.{direction[-2:]}")
        lc = sacrebleu.corpus_bleu(hyps, [refs], lowercase=True).score
        assert runs[name][direction]["bleu_lc"] == pytest.approx(lc)
        assert runs[name][direction]["bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score)
    md = (out / "results.md").read_text(encoding="utf-8")
    assert "| run | direction | BLEU | BLEU (lc) | chrF | paper (Table 1, lowercased) |" in md
    assert f"| rnn | en-de | {runs['rnn']['en-de']['bleu']:.2f} | {runs['rnn']['en-de']['bleu_lc']:.2f} |" in md
    assert "| 36.78 |" in md and "| 39.00 |" in md


def test_a_multilingual_run_trains_its_own_directions_and_decodes_its_zero_shot_ones(table) -> None:
    experiment, out = table
    result = run_comparison(experiment, out=out, overrides=["isolate=false"], only=["multi"])
    (run,) = result.runs
    assert not result.failed and run["name"] == "bridge-multi"
    config = (out / "runs" / "bridge-multi" / "seed-1" / "run.yaml").read_text(encoding="utf-8")
    assert "copy_pairs: true" in config and "zero_shot:\n    - de-fr" in config
    assert set(run["scores"]) == {"test en-de", "test de-en", "test en-fr", "test de-fr"}  # copy pairs not decoded
    runs = json.loads((out / "results.json").read_text(encoding="utf-8"))["runs"]
    assert runs["bridge-multi"]["de-fr"]["paper"] == 0.83


def test_run_directions_are_checked_where_they_are_written(tmp_path: Path) -> None:
    base = TABLE.replace("runs:\n", "runs:\n  - {name: x, config: rnn-m30k, directions: [en-xx]}\n", 1)
    (tmp_path / "bad.yaml").write_text(base, encoding="utf-8")
    with pytest.raises(ConfigError, match=r"runs\[0\] \(x\): direction en-xx: language 'xx' is not in data.langs"):
        load_experiment(tmp_path / "bad.yaml")
    for run, message in (
            ("{name: x, config: rnn-m30k, zero_shot: [de-fr]}", r"zero_shot: needs the run's own directions"),
            ("{name: x, config: rnn-m30k, directions: [en-de, en-de]}", r"directions: 'en-de' is listed twice"),
            ("{name: x, config: bridge-m30k, per_direction: true}", r"per_direction: needs the run's own directions"),
            ("{name: bilingual, config: rnn-m30k}", r"'bilingual' names both a run and a group"),
            ("{name: x, group: 'a b', config: rnn-m30k}", r"group: 'a b' is not a usable group name")):
        (tmp_path / "bad.yaml").write_text(TABLE.replace("runs:\n", f"runs:\n  - {run}\n", 1), encoding="utf-8")
        with pytest.raises(ConfigError, match=message):
            load_experiment(tmp_path / "bad.yaml")
    (tmp_path / "bad.yaml").write_text(TABLE.replace("  bridge-multi: {de-fr: 0.83}", "  nope: {de-fr: 1.0}"),
                                       encoding="utf-8")
    with pytest.raises(ConfigError, match=r"paper: 'nope' is not a run of the experiment"):
        load_experiment(tmp_path / "bad.yaml")
    (tmp_path / "ok.yaml").write_text(TABLE, encoding="utf-8")
    with pytest.raises(ConfigError, match=r"--only: no run or group named 'nope' \(runs: rnn, bridge-bi, "
                                          r"bridge-multi; groups: bilingual, multi\)"):
        run_comparison(tmp_path / "ok.yaml", out=tmp_path / "out", only=["nope"])
    rnn_zero_shot = TABLE.replace("runs:\n", "runs:\n  - {name: x, config: rnn-m30k, directions: [en-de], "
                                             "zero_shot: [de-fr]}\n", 1)
    (tmp_path / "zs.yaml").write_text(rnn_zero_shot, encoding="utf-8")
    with pytest.raises(ConfigError, match=r"runs\[0\] \(x\): zero_shot: a bilingual run translates only"):
        run_comparison(tmp_path / "zs.yaml", out=tmp_path / "out2")


def test_the_table1_experiment_loads_with_every_group_and_the_papers_figures() -> None:
    exp = load_experiment(REPO / "experiments" / "bridge-table1.yaml")
    groups = {r.group for r in exp.runs}
    assert groups == {"bilingual", "bilingual-more", "x-en", "x-en-mono", "many-to-many"}
    assert exp.paper["rnn-m30k"] == {"en-de": 36.78, "de-en": 39.0}
    for run in exp.runs:  # every direction a run trains or holds out has the paper's figure beside it
        assert set(exp.paper[run.name]) == set(run.directions) | set(run.zero_shot)
