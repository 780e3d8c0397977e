"""``nmtflow compare``: a tiny two-config comparison end to end, resumable reruns, strict experiment files."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from nmtflow.cli import main
from nmtflow.config import ConfigError
from nmtflow.evaluate import compare, compare_job
from nmtflow.evaluate.compare import PreparedData, run_comparison, run_config
from nmtflow.evaluate.compare_job import load_texts, read_lines
from nmtflow.evaluate.experiment import load_experiment
from nmtflow.models.base import Vocabularies, build_model, count_parameters
from nmtflow.models.multilingual import LanguageVocabularies

REPO = Path(__file__).resolve().parents[2]

TINY = """\
name: tiny
description: Baseline vs shortcuts, 10 updates each.
data:
  synthetic: {n_train: 300, n_valid: 20, n_test: 20, langs: [en, de]}
  directions: [en-de]
  vocab_size: 200
  byte_fallback: false
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


def main_table(md: str) -> list[list[str]]:
    """The rows of the first table of results.md (the significance and ensemble tables follow it)."""
    start = md.index("\n|")
    return table_rows(md[start:md.find("\n\n", start)])


def test_two_config_comparison_writes_table_json_and_plots(compared) -> None:
    _, out, result = compared
    assert not result.failed
    md = (out / "results.md").read_text(encoding="utf-8")
    assert "- command: `nmtflow compare" in md and "- budget: 10 updates per run" in md and "- machine:" in md
    assert "tiny.yaml says: Baseline vs shortcuts, 10 updates each. (what ran is below" in md  # the file's words
    rows = main_table(md)
    head, sep, body = rows[0], rows[1], rows[2:]
    assert head == ["run", "BLEU", "chrF", "parameters", "train tok/s", "decode sent/s", "peak memory", "wall time"]
    assert set(sep) <= {"---", "---:"}
    assert [r[0] for r in body] == ["baseline", "shortcuts"]
    assert all(len(r) == len(head) and "–" not in r for r in body)

    data = json.loads((out / "results.json").read_text(encoding="utf-8"))
    runs = data["runs"]
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
    with pytest.raises(ConfigError, match=r"--only: no run or group named 'nope' \(runs: baseline, shortcuts\)"):
        run_comparison(experiment, out=out, only=["nope"])


@pytest.fixture
def copied(compared, tmp_path: Path) -> tuple[Path, Path]:
    """The experiment and a copy of its finished comparison (which a test may change freely)."""
    experiment, out, _ = compared
    shutil.copytree(out, tmp_path / "out")
    return experiment, tmp_path / "out"


def test_a_lowered_budget_refuses_runs_trained_beyond_it(copied) -> None:
    experiment, out = copied
    with pytest.raises(ConfigError, match=r"seed-1: the run trained beyond the budget \(10 updates, budget 5\); "
                                          r"use another --out, or delete that run's directory"):
        run_comparison(experiment, out=out, overrides=["budget.updates=5"])
    for name in ("trained.json", "finished.json"):  # interrupted runs: checkpoint_last.pt tells
        (out / "runs" / "baseline" / "seed-1" / name).unlink()
    with pytest.raises(ConfigError, match=r"baseline/seed-1: the run trained beyond the budget"):
        run_comparison(experiment, out=out, overrides=["budget.updates=5"], only=["baseline"])
    # raising the budget continues the run
    result = run_comparison(experiment, out=out, overrides=["budget.updates=15", "isolate=false"], only=["baseline"])
    assert result.runs[0]["updates"] == 15 and "- budget: 15 updates per run" in (out / "results.md").read_text()
    assert result.runs[0]["seeds"][0]["result"]["averaged_from"] == ["checkpoint_10.pt", "checkpoint_15.pt"]
    with pytest.raises(ConfigError, match=r"\(15 updates, budget 10\)"):
        run_comparison(experiment, out=out, only=["baseline"])


def test_beyond_budget_counts_finished_epochs() -> None:
    from nmtflow.evaluate.compare_job import beyond_budget

    budget = {"updates": None, "epochs": 2, "minutes": None}
    assert beyond_budget({"update": 40, "epoch": 3, "position": 0}, budget) is None  # 2 epochs done
    assert beyond_budget({"update": 60, "epoch": 4, "position": 0}, budget) == "3 epochs, budget 2"
    assert beyond_budget({"update": 10, "epoch": 1}, {"updates": 10, "epochs": None}) is None


def no_training(*args, **kwargs):
    raise AssertionError("a trained run was trained again")


def test_a_diverged_run_fails_with_the_divergence_as_its_reason(copied, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: training stopped cleanly on non-finite losses, then decoding failed on NaN scores, and that decoding
    error (a traceback on the console) was recorded as the reason."""
    from types import SimpleNamespace

    experiment, out = copied
    for name in ("trained.json", "finished.json"):
        (out / "runs" / "baseline" / "seed-1" / name).unlink()
    stopped = "stopped after 5 consecutive non-finite losses (train.max_bad_updates=5): lower lr, use clip_norm"
    monkeypatch.setattr(compare_job, "train", lambda config: SimpleNamespace(progress=SimpleNamespace(
        stopped=stopped, bad_updates=5, update=10, epoch=1, elapsed=1.0)))
    monkeypatch.setattr(compare_job, "evaluate", no_training)  # not decoded
    result = run_comparison(experiment, out=out, overrides=["isolate=false"], only=["baseline"])
    assert result.failed
    run = result.runs[0]["seeds"][0]
    assert run["status"] == "failed" and run["error"] == f"RuntimeError: training diverged: {stopped}"


def test_another_prepared_dataset_is_refused(copied, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nmtflow.data.prepare import prepare

    experiment, out = copied
    corpus = out / "corpus"
    prepare({s: str(corpus / s) for s in ("train", "valid", "test")}, ["en", "de"], tmp_path / "other",
            vocab_size=150, byte_fallback=False)
    message = r"out: its runs were trained on data prepared with other settings \(in .*data, not .*other\)"
    with pytest.raises(ConfigError, match=message):
        run_comparison(experiment, out=out, overrides=[f"data.path={tmp_path / 'other'}", "data.synthetic=null"])
    (out / compare.DATA_IDENTITY).unlink()  # a comparison from before the identity was recorded: run.yaml tells
    with pytest.raises(ConfigError, match=message):
        run_comparison(experiment, out=out, overrides=[f"data.path={tmp_path / 'other'}", "data.synthetic=null"])
    # the same data, prepared elsewhere (here: a copy of the comparison's own), is the same: no training again
    shutil.copytree(out / "data", tmp_path / "same")
    monkeypatch.setattr(compare_job, "train", no_training)
    result = run_comparison(experiment, out=out, overrides=[f"data.path={tmp_path / 'same'}", "data.synthetic=null",
                                                            "isolate=false"])
    assert [r["status"] for r in result.runs] == ["done", "done"]


def test_fewer_checkpoints_than_average_last_are_reported(copied, caplog) -> None:
    experiment, out = copied
    with caplog.at_level(logging.WARNING, logger="nmtflow.compare"):
        result = run_comparison(experiment, out=out, overrides=["average_last=5", "isolate=false"],
                                only=["baseline"])
    assert result.runs[0]["seeds"][0]["result"]["averaged_from"] == ["checkpoint_5.pt", "checkpoint_10.pt"]
    assert "average_last is 5 but only 2 periodic checkpoint(s) are there" in caplog.text
    md = (out / "results.md").read_text(encoding="utf-8")
    assert "average of the last 5" not in md
    assert "checkpoint `averaged` (average_last 5, but only 2 periodic checkpoints were kept" in md


def test_decode_and_logging_settings_do_not_retrain_but_decode_again(copied, monkeypatch: pytest.MonkeyPatch
                                                                     ) -> None:
    from nmtflow.decode.translate import Translator

    experiment, out = copied
    changed = out.parent / "changed.yaml"
    text = TINY.replace("train.valid_bleu_max_sentences=10]",
                        "train.valid_bleu_max_sentences=10, decode.len_penalty=1.0, train.log_every=3]")
    changed.write_text(text, encoding="utf-8")
    penalties = []
    translate = Translator.translate

    def recording(self, *args, **kwargs):
        penalties.append(self.decode.len_penalty)
        return translate(self, *args, **kwargs)

    monkeypatch.setattr(Translator, "translate", recording)
    monkeypatch.setattr(compare_job, "train", no_training)
    result = run_comparison(changed, out=out, overrides=["isolate=false"])
    assert not result.failed
    assert penalties == [1.0, 1.0]  # the runs' new decode section, though their checkpoints hold the old one
    for name in ("baseline", "shortcuts"):
        job = json.loads((out / "runs" / name / "seed-1" / "job.json").read_text(encoding="utf-8"))
        done = json.loads((out / "runs" / name / "seed-1" / "finished.json").read_text(encoding="utf-8"))
        assert job["eval"]["decode"]["len_penalty"] == 1.0 and done["eval_key"] == job["eval_key"]
    with pytest.raises(ConfigError, match="trained with another config") as error:  # training settings still count
        run_comparison(changed, out=out, overrides=["overrides=[model.d_model=64]"], only=["baseline"])
    assert "decode." not in str(error.value)


def test_runs_recorded_before_decode_left_the_fingerprint_are_still_skipped(copied,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """finished.json written by earlier versions: the fingerprint kept decode and log_every, eval_key had no
    decode section or test-data digests."""
    experiment, out = copied
    run_comparison(experiment, out=out, overrides=["isolate=false"])  # every run finished with these settings
    exp = load_experiment(experiment)
    volatile = {("train", k) for k in ("save_dir", "max_updates", "max_epochs", "max_minutes", "device", "threads",
                                       "progress", "keep_checkpoints")} | {("data", "path")}
    old_fingerprints = {}
    for job in compare.plan_jobs(exp, out, compare.prepare_data(exp, out)):
        kept = {s: {k: v for k, v in values.items() if (s, k) not in volatile | set(compare.LATER_DEFAULTS)}
                if isinstance(values, dict) else values  # (settings added since then were not in those configs)
                for s, values in job["_config"].items()}
        ev = {k: v for k, v in job["eval"].items() if k not in ("decode", "test_data")}
        old = {"fingerprint": hashlib.sha1(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16],
               "eval_key": hashlib.sha1(json.dumps({**ev, "items": [i["key"] for i in ev["items"]]},
                                                   sort_keys=True).encode()).hexdigest()[:16]}
        for file in ("finished.json", "trained.json"):
            record = json.loads((Path(job["dir"]) / file).read_text(encoding="utf-8"))
            (Path(job["dir"]) / file).write_text(json.dumps({**record, **old}), encoding="utf-8")
        old_fingerprints[job["run"]] = (old["fingerprint"], job["fingerprint"])
    # another decoding of an old run: decoded again, not trained again, and recorded with the new fingerprint
    monkeypatch.setattr(compare_job, "train", no_training)
    run_comparison(experiment, out=out, overrides=["isolate=false", "decode.max_sentences=3"], only=["baseline"])
    trained = json.loads((out / "runs" / "baseline" / "seed-1" / "trained.json").read_text(encoding="utf-8"))
    assert trained["fingerprint"] == old_fingerprints["baseline"][1]
    assert old_fingerprints["baseline"][0] != old_fingerprints["baseline"][1]
    monkeypatch.setattr(compare, "execute", lambda *a, **k: pytest.fail("a finished run was started again"))
    result = run_comparison(experiment, out=out, only=["shortcuts"])
    assert [r["status"] for r in result.runs] == ["done"]


def test_runs_recorded_before_a_later_setting_existed_are_still_this_configs(copied,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A run.yaml written before a setting existed lacks it: at its default, the run is still this config's."""
    experiment, out = copied
    added = {("train", "valid_bleu_tokenize"): "13a", ("train", "init_from"): None,  # settings added since the
             ("model", "decoder_init"): "projected", ("model", "encoder_output_dropout"): True}  # first comparisons
    stripped = 0
    for run_yaml in sorted((out / "runs").glob("*/seed-*/run.yaml")):
        config = yaml.safe_load(run_yaml.read_text(encoding="utf-8"))
        for section, key in added:
            if key in config.get(section, {}):
                assert config[section].pop(key) == added[section, key]
                stripped += 1
        run_yaml.write_text(yaml.safe_dump(config), encoding="utf-8")
    assert stripped >= 4  # train.init_from and train.valid_bleu_tokenize of every run at least
    monkeypatch.setattr(compare_job, "train", no_training)  # decoded again at most, never trained again
    result = run_comparison(experiment, out=out, overrides=["isolate=false"])
    assert {r["status"] for r in result.runs} == {"done"}


# Every setting the fingerprint of a trained run holds (nested ones by their full name), for every registered model
# and a multilingual data section. A setting added to the config changes the fingerprint of every run recorded
# before it, and the comparison would refuse to continue or report those runs: give a new section-level setting an
# entry in compare.LATER_DEFAULTS at the default that keeps the earlier behaviour (a nested one needs the fingerprint
# to leave it out likewise), or list it here if runs before it must not count as this config's.
FINGERPRINTED = set("""
data.max_sentences data.max_tokens data.multilingual data.multilingual.copy_pairs data.multilingual.init_checkpoint
data.multilingual.langs data.multilingual.new_langs data.multilingual.pairs data.multilingual.schedule
data.multilingual.zero_shot data.src_lang data.tgt_lang data.train_split data.valid_split model.activation
model.activation_dropout model.attention model.attention_dropout model.backbone.decoder_layers model.backbone.dropout
model.backbone.encoder_layers model.backbone.hidden_dim model.backbone.input_feeding model.backbone.max_positions
model.backbone.name model.backbone.preset model.backbone.tie_embeddings model.bridge_bias model.bridge_dim
model.bridge_heads model.cross_attention.type model.d_model model.decoder model.decoder_layers
model.decoder_self_attention.type model.dense_decoder model.dense_encoder model.dropout model.embed_dim
model.embed_small model.encoder model.encoder_layers model.encoder_self_attention.type model.ffn_dim model.growth
model.heads model.hidden model.hidden_dim model.input_feeding model.kernel_size model.layer_groups model.layers
model.max_positions model.name model.penalty model.penalty_batch model.penalty_scale model.pre_norm model.preset
model.self_attention.type model.sumlen model.tie_embeddings model.weight_norm train.adam_betas train.adam_eps
train.clip_norm train.early_stop_metric train.fused_optimizer train.label_smoothing train.lr train.lr_scheduler
train.max_bad_updates train.optimizer train.patience train.precision train.save_every train.seed train.update_freq
train.valid_beam_size train.valid_bleu train.valid_bleu_max_sentences train.validate_every train.warmup_init_lr
train.warmup_updates train.weight_decay
""".split())


def test_every_fingerprinted_setting_is_known_so_a_new_one_cannot_orphan_recorded_runs() -> None:
    from nmtflow.config import load_config, to_dict
    from nmtflow.registry import MODELS

    found = set()
    for name in MODELS.names():
        for data in ({}, {"multilingual": {"langs": ["en", "de"]}}):
            config = to_dict(load_config(data={"model": {"name": name}, "data": data}))
            found |= {key for key in compare._flat(config)
                      if not compare._volatile(tuple(key.split("."))) and tuple(key.split("."))[:2]
                      not in compare.LATER_DEFAULTS}
    assert not found - FINGERPRINTED, (
        f"new settings {sorted(found - FINGERPRINTED)} change the fingerprint of every comparison run recorded "
        "before them: add each to compare.LATER_DEFAULTS at its behaviour-preserving default, or to FINGERPRINTED")
    assert not FINGERPRINTED - found, f"settings gone from the config: {sorted(FINGERPRINTED - found)}"


def test_budget_must_be_positive_and_one_seed_shows_no_spread(compared) -> None:
    from nmtflow.evaluate.compare_report import _fmt_score

    experiment, _, _ = compared
    for override in ("budget.updates=0", "budget.epochs=-1", "budget.minutes=0"):
        with pytest.raises(ConfigError, match=rf"budget\.{override.split('.')[1].split('=')[0]}: must be > 0"):
            load_experiment(experiment, [override])
    assert _fmt_score({"mean": 20.0, "std": 0.0, "n": 1}, 3) == "20.00 (n=1)"
    assert _fmt_score({"mean": 20.0, "std": 1.5, "n": 2}, 3) == "20.00 ± 1.50 (n=2)"
    assert _fmt_score({"mean": 20.0, "std": 1.5, "n": 3}, 3) == "20.00 ± 1.50"


def test_a_new_test_set_is_decoded_without_training_again(copied, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """Before: a test set added to data.splits changed the prepared data's key and every run had to train again
    (the comparison refused: "trained on data prepared with other settings")."""
    experiment, out = copied
    for lang in ("en", "de"):
        lines = (out / "corpus" / f"test.{lang}").read_text(encoding="utf-8").splitlines()
        (out / "corpus" / f"extra.{lang}").write_text("\n".join(lines[:6]) + "\n", encoding="utf-8")
    kept = {f: (out / "data" / f).read_bytes() for f in ("spm.model", "train.en.bin", "valid.de.bin", "test.en.bin")}
    monkeypatch.setattr(compare_job, "train", no_training)
    added = ["data.splits.extra=extra", "test_sets=[test, extra]", "isolate=false"]
    with caplog.at_level(logging.INFO, logger="nmtflow.compare"):
        result = run_comparison(experiment, out=out, overrides=added)
    assert caplog.text.count("trained earlier; decoding in") == 2 and "training and decoding" not in caplog.text
    assert not result.failed
    for run in result.runs:
        assert run["status"] == "done" and run["updates"] == 10
        assert run["seeds"][0]["result"]["scores"]["extra en-de"]["sentences"] == 6
    assert {f: (out / "data" / f).read_bytes() for f in kept} == kept  # tokenizer and other splits untouched
    assert json.loads((out / "data" / "meta.json").read_text(encoding="utf-8"))["splits"]["extra"]["rows"] == 6
    # a changed test set is binarized again; training data that changes is still refused
    with open(out / "corpus" / "extra.en", "a", encoding="utf-8") as f, \
            open(out / "corpus" / "extra.de", "a", encoding="utf-8") as g:
        f.write("one more line\n")
        g.write("noch eine zeile\n")
    result = run_comparison(experiment, out=out, overrides=added)
    assert result.runs[0]["seeds"][0]["result"]["scores"]["extra en-de"]["sentences"] == 7
    with open(out / "corpus" / "valid.en", "a", encoding="utf-8") as f, \
            open(out / "corpus" / "valid.de", "a", encoding="utf-8") as g:
        f.write("one more line\n")
        g.write("noch eine zeile\n")
    with pytest.raises(ConfigError, match="trained on data prepared with other settings"):
        run_comparison(experiment, out=out, overrides=added)


def test_a_changed_built_in_corpus_is_refused_before_it_is_drawn_again(copied) -> None:
    """Before: the refusal came after OUT/corpus had been drawn again with the new settings, so a comparison of the
    same --out still running decoded the new test files (and the next plain rerun drew the old ones back)."""
    experiment, out = copied
    before = {p.name: p.read_bytes() for p in (out / "corpus").iterdir()}
    with pytest.raises(ConfigError, match=r"out: its runs were trained on the built-in corpus drawn with other "
                                          r"settings \(.*corpus\.json\); use another --out"):
        run_comparison(experiment, out=out, overrides=["data.synthetic.n_test=21"])
    assert {p.name: p.read_bytes() for p in (out / "corpus").iterdir()} == before


def test_a_per_direction_runs_checkpoint_counts_as_a_started_run(tmp_path: Path) -> None:
    """Before: only runs/NAME/seed-S was looked at, so the data under a per-direction run (runs/NAME/DIR/seed-S)
    was prepared again with other settings, the run reported as finished earlier on the old data."""
    assert not compare._runs_started(tmp_path)
    (tmp_path / "runs" / "bridge" / "en-de" / "seed-1").mkdir(parents=True)
    (tmp_path / "runs" / "bridge" / "en-de" / "seed-1" / "checkpoint_last.pt").write_bytes(b"")
    assert compare._runs_started(tmp_path)


def test_a_run_another_process_trains_is_not_started_twice(tmp_path: Path) -> None:
    """Before: the same comparison in two shells (or a rerun beside an orphaned run) started the run again; it died
    with a SaveDirBusy traceback, was reported failed, with a line of the other process's log as its reason."""
    from nmtflow.checkpoint import lock_save_dir, unlock_save_dir

    from nmtflow.data.locks import lock_file

    run_dir = tmp_path / "runs" / "baseline" / "seed-1"
    run_dir.mkdir(parents=True)
    assert compare._busy(run_dir) is None
    lock_save_dir(run_dir)  # this process stands for the other training
    try:
        status, result, why = compare.execute({"dir": str(run_dir)}, isolate=True)
    finally:
        unlock_save_dir(run_dir)
    assert (status, result) == ("busy", None)
    assert why.startswith(f"another training is running in {run_dir} (pid {os.getpid()}") and "not started" in why
    assert compare._outcome(run_dir, compare_job.EXIT_BUSY, False)[0] == "busy"
    assert compare._busy(run_dir) is None
    # decoding, after the trainer let go of .lock: the run's process still holds its job lock
    fd = lock_file(run_dir / compare_job.JOB_LOCK, 0o644)
    try:
        assert compare.execute({"dir": str(run_dir)}, isolate=True)[0] == "busy"
    finally:
        os.close(fd)
    assert compare._busy(run_dir) is None


CHILD = """
import signal, sys, time
from pathlib import Path
from nmtflow.evaluate.compare_job import stop_with_parent
signal.signal(signal.SIGTERM, lambda *_: (Path(sys.argv[1]).write_text("stopped"), sys.exit(0)))
stop_with_parent()
Path(sys.argv[1] + ".ready").write_text("")
time.sleep(60)
"""
PARENT = """
import os, subprocess, sys, time
from nmtflow.evaluate.compare_job import PARENT_ENV
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], start_new_session=True,
                 env={**os.environ, PARENT_ENV: str(os.getpid())})
time.sleep(60)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG) is Linux's")
def test_a_run_stops_when_its_comparison_is_killed(tmp_path: Path) -> None:
    """Before: kill -9 (or a closed terminal) ended the comparison but not its run, which trained on orphaned; the
    next nmtflow compare found its save dir busy. Now the run gets SIGTERM, as on Ctrl-C (checkpoint, exit)."""
    import subprocess
    import time

    marker = tmp_path / "child"
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD, str(marker)])
    deadline = time.monotonic() + 60
    while not Path(f"{marker}.ready").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert Path(f"{marker}.ready").exists()
    parent.kill()
    parent.wait()
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marker.read_text() == "stopped"


def test_a_data_identity_recorded_over_every_split_is_still_recognised(copied,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Earlier versions hashed the test splits into the prepared data's identity."""
    experiment, out = copied
    record = json.loads((out / compare.DATA_IDENTITY).read_text(encoding="utf-8"))
    legacy = compare.data_identity(out / "data", legacy=True)
    assert legacy != compare.data_identity(out / "data")
    (out / compare.DATA_IDENTITY).write_text(json.dumps({**record, "identity": legacy}), encoding="utf-8")
    monkeypatch.setattr(compare_job, "train", no_training)
    result = run_comparison(experiment, out=out, overrides=["isolate=false"])
    assert [r["status"] for r in result.runs] == ["done", "done"]
    assert json.loads((out / compare.DATA_IDENTITY).read_text())["identity"] == compare.data_identity(out / "data")


def test_an_override_into_a_default_mapping_adds_to_it(tmp_path: Path) -> None:
    """Before: ``data.splits.extra=x`` on a file that names no splits left {extra: x} alone ("needs a 'train'
    split"), while on a file that names them it added a split."""
    (tmp_path / "tiny.yaml").write_text(TINY, encoding="utf-8")
    exp = load_experiment(tmp_path / "tiny.yaml", ["data.splits.extra=x", "decode.beam_size=3"])
    assert exp.data.splits == {"train": "train", "valid": "valid", "test": "test", "extra": "x"}
    assert exp.decode.beam_size == 3
    exp = load_experiment(tmp_path / "tiny.yaml", ["data.splits={train: a, valid: b}", "test_sets=[valid]"])
    assert exp.data.splits == {"train": "a", "valid": "b"}  # a whole mapping still replaces the default


def test_ensemble_decodes_each_runs_seeds_as_one_model(tmp_path: Path, caplog) -> None:
    """``ensemble: true``: the seeds' decoded checkpoints as one ensemble, the same hypotheses as the ensemble
    opened directly, reported beside the seeds' mean and reused on a rerun."""
    from nmtflow.decode.ensemble import open_translators

    text = TINY.replace("seeds: [1]", "seeds: [1, 2]\nensemble: true").replace(
        "  - {name: shortcuts, config: shortcuts-small, overrides: [train.warmup_updates=5]}\n", "")
    (tmp_path / "ens.yaml").write_text(text, encoding="utf-8")
    out = tmp_path / "out"
    result = run_comparison(tmp_path / "ens.yaml", out=out, overrides=["isolate=false"])
    run = result.runs[0]
    ens = run["ensemble"]
    assert ens["seeds"] == [1, 2] and [Path(m).name for m in ens["members"]] == ["averaged.pt", "averaged.pt"]
    hyps = (out / "runs" / "baseline" / "ensemble" / "hyp.test.en-de.txt").read_text(encoding="utf-8").splitlines()
    translator = open_translators(ens["members"])
    translator.decode = dataclasses.replace(translator.decode, beam_size=2, max_len_a=1.2, max_len_b=4)
    src = (out / "corpus" / "test.en").read_text(encoding="utf-8").splitlines()
    assert hyps == [nbest[0][0] for nbest in translator.translate(src)]
    assert ens["scores"]["test en-de"]["sentences"] == 20
    md = (out / "results.md").read_text(encoding="utf-8")
    rows = [r for r in table_rows(md) if r[0] == "baseline" and r[1] == "test en-de"]
    assert len(rows) == 1 and rows[0][2] == f"{ens['scores']['test en-de']['bleu']:.2f}"
    assert rows[0][3] == f"{run['scores']['test en-de']['bleu']['mean']:.2f}"
    saved = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert saved["runs"]["baseline"]["ensemble"]["scores"] == ens["scores"]
    with caplog.at_level(logging.INFO, logger="nmtflow.compare"):
        again = run_comparison(tmp_path / "ens.yaml", out=out, overrides=["isolate=false"])
    assert "was decoded earlier, skipped" in caplog.text and again.runs[0]["ensemble"] == ens
    with pytest.raises(ConfigError, match="ensemble: an ensemble of each run's seeds needs two or more seeds"):
        run_comparison(tmp_path / "ens.yaml", out=out, overrides=["seeds=[1]"])


def test_runs_recorded_before_test_set_digests_are_skipped_and_upgraded(copied,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """finished.json of the previous version: its eval_key had the decode section but no test-set digests."""
    experiment, out = copied
    exp = load_experiment(experiment)
    jobs = compare.plan_jobs(exp, out, compare.prepare_data(exp, out))
    for job in jobs:
        ev = {k: v for k, v in job["eval"].items() if k != "test_data"}
        old_key = hashlib.sha1(json.dumps({**ev, "items": [i["key"] for i in ev["items"]]},
                                          sort_keys=True).encode()).hexdigest()[:16]
        assert old_key == job["previous"]["eval_key"] != job["eval_key"]
        record = json.loads((Path(job["dir"]) / "finished.json").read_text(encoding="utf-8"))
        (Path(job["dir"]) / "finished.json").write_text(json.dumps({**record, "eval_key": old_key}), encoding="utf-8")
    monkeypatch.setattr(compare, "execute", lambda *a, **k: pytest.fail("a finished run was decoded again"))
    result = run_comparison(experiment, out=out)
    assert [r["status"] for r in result.runs] == ["done", "done"]
    for job in jobs:
        assert json.loads((Path(job["dir"]) / "finished.json").read_text())["eval_key"] == job["eval_key"]


def test_the_report_is_written_after_each_run(compared, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """results.json, results.md and the plots hold each finished run as soon as it ends, the others "not run", so
    that a long comparison's results are there while its last runs train (and survive a crash of them)."""
    experiment, out, _ = compared
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    finished = {}
    for name in ("baseline", "shortcuts"):
        path = copy / "runs" / name / "seed-1" / "finished.json"
        finished[name] = json.loads(path.read_text(encoding="utf-8"))
        path.unlink()
    for name in ("results.json", "results.md", "valid_bleu.png"):
        (copy / name).unlink()
    seen = []

    def decode_again(job, isolate):  # the runs are trained: give back their results as execute would
        report = json.loads((copy / "results.json").read_text(encoding="utf-8")) if (copy / "results.json").exists() \
            else None
        seen.append((job["run"], report and {name: r["status"] for name, r in report["runs"].items()},
                     (copy / "valid_bleu.png").exists()))
        return "done", finished[job["run"]], ""

    monkeypatch.setattr(compare, "execute", decode_again)
    result = run_comparison(experiment, out=copy)
    assert seen == [("baseline", None, False), ("shortcuts", {"baseline": "done", "shortcuts": "not run"}, True)]
    assert [r["status"] for r in result.runs] == ["done", "done"]
    final = json.loads((copy / "results.json").read_text(encoding="utf-8"))
    assert {name: r["status"] for name, r in final["runs"].items()} == {"baseline": "done", "shortcuts": "done"}
