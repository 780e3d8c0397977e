"""Review of training and config loading: errors name the file or override that holds the bad value, a run's
config.yaml reads back as written, devices the machine lacks and unreadable checkpoints are one-line errors, and a
save dir whose checkpoint_last.pt is missing or holds no training state is neither resumed nor wiped."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from nmtflow.checkpoint import FORMAT, CheckpointError, average_checkpoints, load_checkpoint, save_atomic
from nmtflow.cli import main
from nmtflow.config import ConfigError, load_config, to_dict, yaml_dump, yaml_load
from nmtflow.train.trainer import read_log, resolve_device, trim_log

TINY = "model: {name: transformer, d_model: 32, ffn_dim: 64, heads: 2, encoder_layers: 1, decoder_layers: 1}\n"


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_a_bad_value_names_the_base_file_or_override_that_set_it(tmp_path: Path) -> None:
    write(tmp_path / "base.yaml", TINY + "train: {lr: fast}\n")
    child = write(tmp_path / "child.yaml", "base: base.yaml\ndata: {max_tokens: 100}\n")
    with pytest.raises(ConfigError, match=r"^\S*base\.yaml: train\.lr: expected a number, got 'fast'$"):
        load_config(child)
    ok = write(tmp_path / "ok.yaml", TINY)
    for override, problem in [("train.lr=abc", "train.lr: expected a number"),
                              ("train.max_updates=0", "train.max_updates: must be >= 1"),
                              ("model.heads=3", "model.heads: 3 does not divide d_model=32"),
                              ("train.adam_betas=[0.9, x]", r"train.adam_betas\[1\]: expected a number")]:
        with pytest.raises(ConfigError, match=rf"^override '{re.escape(override)}': {problem}"):
            load_config(ok, [override])
    # the files set other keys of the same section: the override is still the one named
    with pytest.raises(ConfigError, match=r"^override 'data\.max_tokens=0': data\.max_tokens: must be >= 1, got 0$"):
        load_config(child, ["train.lr=1", "data.max_tokens=0"])
    with pytest.raises(ConfigError, match=r"^override 'train\.lr=-1': train\.lr: must be > 0, got -1\.0$"):
        load_config(child, ["train.lr=-1"])
    with pytest.raises(ConfigError, match=r"ok\.yaml: train\.lr: expected a number"):  # the file's own value
        load_config(write(tmp_path / "ok.yaml", TINY + "train: {lr: abc}\n"), ["train.max_updates=3"])


def test_a_runs_config_yaml_reads_back_strings_that_look_like_numbers(tmp_path: Path) -> None:
    config = load_config(write(tmp_path / "c.yaml", TINY), ["train.save_dir='5e-4'", "data.tgt_lang='1e3'",
                                                           "data.src_lang='no'"])
    again = load_config(data=yaml_load(yaml_dump(to_dict(config))))  # what the trainer writes as config.yaml
    assert again == config and again.train.save_dir == "5e-4" and again.data.tgt_lang == "1e3"


@pytest.mark.parametrize("text, override, problem", [
    ("base: 5\n", None, r"c\.yaml: base: expected the path of another config file, got 5"),
    ("base: [a.yaml, b.yaml]\n", None, r"c\.yaml: base: expected the path"),
    ("base: ''\n", None, r"c\.yaml: base: expected the path"),
    (TINY, "base=other.yaml", r"override 'base=other\.yaml': 'base' can only be given in a config file"),
    (TINY, "train.lr=.nan", r"train\.lr: must be a finite number >= 0, got nan"),
    (TINY, "train.clip_norm=.nan", r"train\.clip_norm: must be a finite number"),
    (TINY, "train.weight_decay=.inf", r"train\.weight_decay: must be a finite number"),
    (TINY, "train.adam_eps=-1", r"train\.adam_eps: must be a finite number >= 0"),
    (TINY, "train.adam_betas=[1.5, 0.9]", r"train\.adam_betas: each must be in \[0, 1\)"),
    (TINY, "train.max_minutes=.nan", r"train\.max_minutes: must be > 0 or null"),
    (TINY, "train.optimizer=sgd", r"train\.optimizer: unknown optimizer 'sgd' \(known: adam, adamw, nesterov\)"),
    (TINY, "train.lr_scheduler=cosine", r"train\.lr_scheduler: unknown schedule 'cosine'"),
    (TINY, "train.seed=-5", r"train\.seed: must be in \[0, 2\*\*32\), got -5"),
])
def test_bad_bases_numbers_and_names_are_errors_at_load_time(tmp_path: Path, text: str, override: str | None,
                                                              problem: str) -> None:
    with pytest.raises(ConfigError, match=problem):
        load_config(write(tmp_path / "c.yaml", text), [override] if override else [])


@pytest.mark.parametrize("device", ["cuda", "cuda:7", "mps"])
def test_a_device_the_machine_lacks_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        device: str) -> None:
    lacks = torch.cuda.device_count() <= 7 if device.startswith("cuda") else not torch.backends.mps.is_available()
    if not lacks:
        pytest.skip(f"this machine has {device}")
    config = write(tmp_path / "c.yaml", TINY)
    err = one_line_error(["train", str(config), "--save-dir", str(tmp_path / "run"), "--set", f"train.device={device}"],
                         capsys)
    assert f"train.device '{device}':" in err
    with pytest.raises(ValueError, match=f"device '{device}':"):
        resolve_device(device)
    with pytest.raises(ValueError, match="device 'gpu': expected auto, cpu, cuda or cuda:N"):
        resolve_device("gpu")


def test_patience_without_scheduled_validations_is_an_error(tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    config = write(tmp_path / "c.yaml", TINY + "train: {validate_every: 0, patience: 3}\n")
    err = one_line_error(["train", str(config), "--save-dir", str(tmp_path / "run")], capsys)
    assert "train.patience: early stopping counts scheduled validations, but train.validate_every is 0" in err


def test_a_save_dir_that_is_a_file_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = write(tmp_path / "c.yaml", TINY)
    taken = write(tmp_path / "taken", "")
    err = one_line_error(["train", str(config), "--save-dir", str(taken)], capsys)
    assert f"{taken}: the save dir (train.save_dir, --save-dir) is a file, not a directory" in err


def test_unreadable_checkpoints_say_what_they_are(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.pt"
    save_atomic({"format": FORMAT, "model": {"w": torch.randn(4000)}}, good)
    cases = {"empty.pt": (b"", "not an nmtflow checkpoint (an empty file)"),
             "text.pt": (b"hello\n", "not an nmtflow checkpoint (not a PyTorch checkpoint file)"),
             "cut.pt": (good.read_bytes()[:3000], "not a readable nmtflow checkpoint, truncated or corrupted "
                                                  "(PytorchStreamReader failed reading zip archive: failed finding "
                                                  "central directory)")}
    for name, (content, message) in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CheckpointError) as caught:
            load_checkpoint(tmp_path / name)
        assert str(caught.value) == f"{tmp_path / name}: {message}"
    with pytest.raises(CheckpointError, match=f"^{tmp_path}: a directory, not a checkpoint file$"):
        load_checkpoint(tmp_path)
    save_atomic({"format": FORMAT, "step": 1}, tmp_path / "no_model.pt")
    with pytest.raises(CheckpointError, match=r"no_model\.pt: holds no model parameters to average"):
        average_checkpoints([good, tmp_path / "no_model.pt"])
    err = one_line_error(["average", str(tmp_path / "no_model.pt"), "-o", str(tmp_path / "avg.pt")], capsys)
    assert "no_model.pt: holds no model parameters to average" in err


def run_config(tmp_path: Path, data: Path) -> Path:
    """A config of two updates on ``data`` that saves after each."""
    return write(tmp_path / "c.yaml", TINY + f"data: {{path: {data}, src_lang: src, tgt_lang: tgt}}\n"
                 "train: {max_updates: 2, save_every: 1, validate_every: 0, progress: false, threads: 1}\n")


def test_an_averaged_checkpoint_last_is_not_resumed(copy_data: Path, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    run, config = tmp_path / "run", run_config(tmp_path, copy_data)
    threads = torch.get_num_threads()
    try:
        assert main(["train", str(config), "--save-dir", str(run)]) == 0
        capsys.readouterr()
        for name in ("checkpoint_last.pt", "checkpoint_best.pt", "checkpoint_7.pt"):  # the names training gives
            assert "a name training gives its own checkpoints" in one_line_error(
                ["average", str(run), "-o", str(run / name)], capsys)
        assert main(["average", str(run), "-o", str(tmp_path / "avg.pt")]) == 0
        (run / "checkpoint_last.pt").write_bytes((tmp_path / "avg.pt").read_bytes())  # copied over it by hand
        err = one_line_error(["train", str(config), "--save-dir", str(run), "--set", "train.max_updates=3"], capsys)
    finally:
        torch.set_num_threads(threads)
    assert (f"{run / 'checkpoint_last.pt'}: holds a model but no training state (optimizer, scheduler, rng, "
            "progress), like an averaged checkpoint") in err


def test_checkpoints_without_checkpoint_last_are_kept_until_restart(copy_data: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A kill between the first save's checkpoint_1.pt and checkpoint_last.pt: the rerun no longer deletes them."""
    run, config = tmp_path / "run", run_config(tmp_path, copy_data)
    threads = torch.get_num_threads()
    try:
        assert main(["train", str(config), "--save-dir", str(run)]) == 0
        (run / "checkpoint_last.pt").unlink()
        err = one_line_error(["train", str(config), "--save-dir", str(run)], capsys)
        assert (f"{run}: holds checkpoints of an earlier run (checkpoint_1.pt, checkpoint_2.pt, checkpoint_best.pt) "
                "but no checkpoint_last.pt to resume from; start afresh with --restart") in err
        assert err.rstrip().endswith("the save dir's checkpoint_2.pt is intact and holds the training state at "
                                     "update 2: to resume from there, copy it to checkpoint_last.pt")
        assert {p.name for p in run.glob("checkpoint_*.pt")} == {"checkpoint_1.pt", "checkpoint_2.pt",
                                                                  "checkpoint_best.pt"}
        assert main(["train", str(config), "--save-dir", str(run), "--restart"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert load_checkpoint(run / "checkpoint_last.pt")["progress"]["update"] == 2


def test_a_first_save_cut_short_before_checkpoint_last_is_completed_and_resumed_exactly(
        copy_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    """``kill -9`` after the first save's checkpoint_1.pt (and checkpoint_best.pt) but before checkpoint_last.pt:
    the same command stopped with "no checkpoint_last.pt to resume from", so a relaunched job never went on."""
    run, config = tmp_path / "run", run_config(tmp_path, copy_data)
    threads = torch.get_num_threads()
    try:
        assert main(["train", str(config), "--save-dir", str(run)]) == 0
        full = load_checkpoint(run / "checkpoint_last.pt")["model"]
        shutil.rmtree(run)
        assert main(["train", str(config), "--save-dir", str(run), "--set", "train.max_updates=1"]) == 0
        (run / "checkpoint_last.pt").unlink()  # the state the kill leaves
        (run / ".checkpoint_last.pt.x1.tmp").write_bytes(b"PK\x03")
        other = one_line_error(["train", str(config), "--save-dir", str(run), "--set", "train.lr=0.5"], capsys)
        assert "but no checkpoint_last.pt to resume from" in other  # other settings: not this run's save
        assert not (run / "checkpoint_last.pt").exists()
        with caplog.at_level("WARNING", logger="nmtflow"):
            assert main(["train", str(config), "--save-dir", str(run)]) == 0
    finally:
        torch.set_num_threads(threads)
    assert any("the first save, at update 1, was cut short before checkpoint_last.pt; completed it from "
               "checkpoint_1.pt" in r.getMessage() for r in caplog.records)
    resumed = load_checkpoint(run / "checkpoint_last.pt")
    assert resumed["progress"]["update"] == 2
    assert all(torch.equal(resumed["model"][k], full[k]) for k in full)  # the uninterrupted run's weights
    assert [e["update"] for e in read_log(run) if e["kind"] == "start"] == [0, 1]


def test_sigterm_during_set_up_exits_as_interrupted(copy_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Before the loop routes it, SIGTERM killed the process silently (status -15) where Ctrl-C said "interrupted"
    and exited 130, as the guide says both do; the handler is put back after the command."""
    import os
    import signal

    from nmtflow.train import trainer as trainer_module

    def set_up(self: object, *args: object, **kwargs: object) -> None:
        os.kill(os.getpid(), signal.SIGTERM)  # e.g. while the data or the checkpoint loads

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(trainer_module.Trainer, "__init__", set_up)
    assert main(["train", str(run_config(tmp_path, copy_data)), "--save-dir", str(tmp_path / "run")]) == 130
    assert capsys.readouterr().err.strip().endswith("interrupted")
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_resume_cut_short_leaves_one_start_entry(tmp_path: Path) -> None:
    """Each resume from the same checkpoint, killed before its next save, left one more identical start entry."""
    log_file = tmp_path / "log.jsonl"
    entries = [{"kind": "start", "update": 0}, {"kind": "train", "update": 1}, {"kind": "valid", "update": 1},
               {"kind": "start", "update": 1}, {"kind": "train", "update": 2}]
    log_file.write_text("".join(json.dumps(e) + "\n" for e in entries), encoding="utf-8")
    trim_log(log_file, 1)
    assert [json.loads(line) for line in log_file.read_text(encoding="utf-8").splitlines()] == entries[:3]


def test_a_truncated_checkpoint_last_names_the_intact_checkpoint_to_resume_from(
        copy_data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Periodic and best checkpoints hold the whole training state: the error names the newest intact one, and a
    copy of it over checkpoint_last.pt resumes the run exactly from its update."""
    run, config = tmp_path / "run", run_config(tmp_path, copy_data)
    threads = torch.get_num_threads()
    try:
        assert main(["train", str(config), "--save-dir", str(run), "--set", "train.max_updates=4"]) == 0
        full = load_checkpoint(run / "checkpoint_last.pt")["model"]
        shutil.rmtree(run)
        assert main(["train", str(config), "--save-dir", str(run)]) == 0
        last = run / "checkpoint_last.pt"
        last.write_bytes(last.read_bytes()[:3000])  # a disk fault after the save
        (run / "checkpoint_best.pt").unlink()
        argv = ["train", str(config), "--save-dir", str(run), "--set", "train.max_updates=4"]
        err = one_line_error(argv, capsys)
        assert f"{last}: not a readable nmtflow checkpoint, truncated or corrupted" in err
        assert ("; the save dir's checkpoint_2.pt is intact and holds the training state at update 2: to resume "
                "from there, copy it to checkpoint_last.pt") in err
        (run / "checkpoint_2.pt").write_bytes(b"PK\x03\x04 cut")  # the newest periodic one damaged too
        assert "; the save dir's checkpoint_1.pt is intact and holds the training state at update 1" in \
            one_line_error(argv, capsys)
        shutil.copyfile(run / "checkpoint_1.pt", last)
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    resumed = load_checkpoint(last)
    assert resumed["progress"]["update"] == 4
    assert all(torch.equal(resumed["model"][k], full[k]) for k in full)  # the uninterrupted run's weights
    (run / "checkpoint_1.pt").unlink()
    for path in run.glob("checkpoint_*.pt"):
        path.write_bytes(b"")
    assert "is intact" not in one_line_error(argv, capsys)  # nothing intact: no advice


def test_the_language_label_model_without_multilingual_data_is_refused(copy_data: Path, tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Trained on one direction it would be its backbone with no tag in any source: said, nothing written."""
    config = write(tmp_path / "label.yaml", "model: {name: language_label, backbone: {name: rnn, hidden_dim: 32, "
                   f"encoder_layers: 1, decoder_layers: 1}}}}\ndata: {{path: {copy_data}, src_lang: src, tgt_lang: tgt}}\n"
                   "train: {max_updates: 1, validate_every: 0, progress: false}\n")
    err = one_line_error(["train", str(config), "--save-dir", str(tmp_path / "run")], capsys)
    assert "model.name: 'language_label' is a multilingual model" in err and "data.multilingual" in err
    assert not (tmp_path / "run").exists()


def test_the_one_direction_trainer_refuses_multilingual_data_and_trainer_for_picks(
        copy_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``Trainer`` on a config with ``data.multilingual`` would train data.src_lang → data.tgt_lang only, silently:
    refused, naming the trainer to use; ``trainer_for`` picks that one (as ``nmtflow train`` does)."""
    import nmtflow.train.multilingual as multilingual
    from nmtflow.train.multilingual import trainer_for
    from nmtflow.train.trainer import Trainer

    config = load_config("bridge-k10", [f"data.path={copy_data}", f"train.save_dir={tmp_path / 'run'}",
                                        "data.multilingual.pairs=[src-tgt]"])
    with pytest.raises(ConfigError, match=r"data\.multilingual: set, but this trainer trains one direction.*"
                                          r"MultilingualTrainer"):
        Trainer(config)
    assert not (tmp_path / "run").exists()
    built: list[tuple[object, bool]] = []
    monkeypatch.setattr(multilingual.MultilingualTrainer, "__init__",
                        lambda self, cfg, *, resume=True: built.append((cfg, resume)))
    assert isinstance(trainer_for(config, resume=False), multilingual.MultilingualTrainer)
    assert built == [(config, False)]


def test_a_missing_validation_split_says_how_to_train_without_one(copy_data: Path, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """validate_every: 0 still validates once at the end, so a split that is not there is refused, naming
    data.valid_split and its two ways out; with valid_split: null the run trains and writes no checkpoint_best."""
    base = ["train", "transformer-small", "--data", str(copy_data), "--set", "model.d_model=16",
            "--set", "model.ffn_dim=32", "--set", "model.heads=2", "--set", "model.encoder_layers=1",
            "--set", "model.decoder_layers=1", "--set", "train.max_updates=2", "--set", "train.validate_every=0",
            "--set", "train.progress=false", "--set", "data.src_lang=src", "--set", "data.tgt_lang=tgt"]
    err = one_line_error([*base, "--save-dir", str(tmp_path / "a"), "--set", "data.valid_split=dev"], capsys)
    assert "error: data.valid_split: 'dev' is not prepared in" in err and "data.valid_split: null" in err
    assert not list((tmp_path / "a").glob("checkpoint*"))
    assert main([*base, "--save-dir", str(tmp_path / "b"), "--set", "data.valid_split=null"]) == 0
    assert (tmp_path / "b" / "checkpoint_last.pt").is_file() and not (tmp_path / "b" / "checkpoint_best.pt").exists()
    assert not [e for e in read_log(tmp_path / "b") if e["kind"] == "valid"]


# ---- second review: crash safety of the log, multilingual resume, schedules, DDP ----------------------------
TRIM_WITH_A_FULL_DISK = """
import resource, signal, sys
from pathlib import Path
from nmtflow.train.trainer import trim_log
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) like one on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), resource.RLIM_INFINITY))
try:
    trim_log(Path(sys.argv[1]), 10**9)
except OSError as exc:
    print(exc)
"""


def test_a_log_rewrite_that_fails_leaves_the_log_whole(tmp_path: Path) -> None:
    """Resuming rewrites log.jsonl (trim_log): a full disk during the rewrite must not cut the run's history."""
    import json
    import subprocess
    import sys

    log = tmp_path / "log.jsonl"
    text = "".join(json.dumps({"kind": "train", "update": u, "loss": 1.0 / u}) + "\n" for u in range(1, 400))
    write(log, text + '{"kind": "tra')  # ends in a line torn by a kill
    run = subprocess.run([sys.executable, "-c", TRIM_WITH_A_FULL_DISK, str(log), str(len(text) // 2)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == f"{log}: could not write the log (File too large); it is unchanged"
    assert log.read_text(encoding="utf-8") == text + '{"kind": "tra'
    assert [p.name for p in tmp_path.iterdir()] == ["log.jsonl"]  # no temporary file left behind


@pytest.fixture(scope="module")
def three_langs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny en/de/fr multi-way corpus (joint vocabulary): fr is added to an en↔de model."""
    from nmtflow.data.prepare import prepare
    from nmtflow.data.synthetic import generate_corpus

    root = tmp_path_factory.mktemp("three")
    generate_corpus(root / "raw", langs=("en", "de", "fr"), n_train=120, n_valid=4, n_test=2, seed=1)
    prepare({"train": str(root / "raw" / "train"), "valid": str(root / "raw" / "valid")}, ["en", "de", "fr"],
            root / "data", vocab_size=120, byte_fallback=False, progress=False)
    return root / "data"


def bridge_run(data: Path, save_dir: Path, updates: int, **multilingual: object):
    from nmtflow.config import load_config

    return load_config(data={
        "model": {"name": "bridge", "hidden_dim": 16, "encoder_layers": 1, "decoder_layers": 1, "dropout": 0.1,
                  "bridge_heads": 2, "bridge_dim": 8, "input_feeding": False},
        "data": {"path": str(data), "max_tokens": 300, "multilingual": multilingual},
        "train": {"save_dir": str(save_dir), "lr": 5e-3, "warmup_updates": 1, "max_updates": updates,
                  "validate_every": 0, "save_every": 0, "log_every": 1, "progress": False, "valid_bleu": False,
                  "threads": 1}})


def train_losses(trainer) -> list[float]:
    from nmtflow.train.trainer import read_log

    threads = torch.get_num_threads()
    try:
        result = trainer.train()
    finally:
        torch.set_num_threads(threads)
    return [e["loss"] for e in read_log(result.save_dir) if e["kind"] == "train"]


def test_a_run_that_adds_a_language_resumes_without_its_init_checkpoint(three_langs: Path, tmp_path: Path) -> None:
    """init_checkpoint starts the run; once it has checkpoint_last.pt, resuming needs only that (exactly)."""
    from nmtflow.train.multilingual import MultilingualTrainer

    train_losses(MultilingualTrainer(bridge_run(three_langs, tmp_path / "base", 2, langs=["en", "de"])))
    init = tmp_path / "init.pt"
    (tmp_path / "base" / "checkpoint_last.pt").rename(init)
    add_fr = {"langs": ["en", "de"], "new_langs": ["fr"], "pairs": ["en-fr", "fr-en"], "init_checkpoint": str(init)}
    full = train_losses(MultilingualTrainer(bridge_run(three_langs, tmp_path / "full", 4, **add_fr)))
    train_losses(MultilingualTrainer(bridge_run(three_langs, tmp_path / "cut", 2, **add_fr)))
    init.unlink()  # e.g. the base run's save dir was cleaned up
    resumed = MultilingualTrainer(bridge_run(three_langs, tmp_path / "cut", 4, **add_fr))
    frozen = {name for name, p in resumed.model.named_parameters() if not p.requires_grad}
    assert frozen and all(".fr." not in name for name in frozen)  # the bridge, en and de stay frozen
    assert train_losses(resumed) == full and len(full) == 4
    a, b = (load_checkpoint(tmp_path / name / "checkpoint_last.pt") for name in ("full", "cut"))
    assert b["langs"] == a["langs"] and b["vocab"] == a["vocab"]  # the base model's directions are still listed
    assert {"en-de", "de-en", "en-fr", "fr-en"} <= set(b["langs"]["directions"])
    with pytest.raises(CheckpointError, match=r"init\.pt: checkpoint not found"):  # a fresh start needs it
        MultilingualTrainer(bridge_run(three_langs, tmp_path / "cut", 4, **add_fr), resume=False)


def test_zero_shot_directions_stay_listed_after_fine_tuning_and_adding_a_language(
        three_langs: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A model trained from another keeps that one's untrained (zero-shot) directions listed as such; new_langs
    naming a language the model has is refused; decoding a direction neither trained nor zero-shot warns."""
    from nmtflow.config import ConfigError
    from nmtflow.decode.multilingual import multilingual_translator
    from nmtflow.train.multilingual import MultilingualTrainer

    base = tmp_path / "base" / "checkpoint_last.pt"
    train_losses(MultilingualTrainer(bridge_run(three_langs, base.parent, 1, zero_shot=["de-fr", "fr-de"])))
    assert load_checkpoint(base)["langs"]["zero_shot"] == ["de-fr", "fr-de"]
    tuned = bridge_run(three_langs, tmp_path / "tuned", 1, pairs=["en-de", "de-fr"])  # de-fr trained now
    tuned.train.init_from = str(base)
    train_losses(MultilingualTrainer(tuned))
    langs = load_checkpoint(tmp_path / "tuned" / "checkpoint_last.pt")["langs"]
    assert langs["zero_shot"] == ["fr-de"] and "de-fr" in langs["directions"] and "fr-en" in langs["directions"]

    two = tmp_path / "two" / "checkpoint_last.pt"
    train_losses(MultilingualTrainer(bridge_run(three_langs, two.parent, 1, langs=["en", "de"],
                                                pairs=["en-de", "de-en"])))
    add_fr = {"langs": ["en", "de"], "new_langs": ["fr"], "pairs": ["en-fr"], "init_checkpoint": str(two)}
    train_losses(MultilingualTrainer(bridge_run(three_langs, tmp_path / "added", 1, **add_fr)))
    with pytest.raises(ConfigError, match=r"^data\.multilingual\.new_langs: 'de' is already a language of "):
        MultilingualTrainer(bridge_run(three_langs, tmp_path / "again", 1, **{**add_fr, "new_langs": ["de"],
                                                                                 "pairs": []}))

    wider = bridge_run(three_langs, tmp_path / "wider", 1, **add_fr)
    wider.model.hidden_dim = 32  # the base model has 16
    with pytest.raises(ConfigError, match=r"does not fit this model \(size mismatch for .*; give the model section"):
        MultilingualTrainer(wider)

    caplog.set_level("WARNING", logger="nmtflow.decode.multilingual")
    multilingual_translator(two, "en", "de")
    assert not caplog.records  # trained
    multilingual_translator(two, "de", "de")
    assert f"{two}: de-de was neither trained nor held out as zero-shot (trained: en-de, de-en)" in caplog.text


def epoch_config(data: Path, save_dir: Path, max_epochs: int):
    from tests.conftest import tiny_config

    config = tiny_config(data, save_dir, max_updates=1000, max_epochs=max_epochs, update_freq=4, valid_bleu=False,
                         validate_every=0, save_every=0, threads=1)
    config.model.d_model, config.model.ffn_dim, config.model.encoder_layers, config.model.decoder_layers = 16, 32, 1, 1
    config.data.max_tokens = 4000
    return config


def test_max_epochs_with_update_freq_stops_at_the_epochs_end(copy_data: Path, tmp_path: Path) -> None:
    """An update does not take batches of the next epoch: max_epochs=1 trains on one pass exactly, and the cut run
    continued to max_epochs=2 equals a run of two epochs."""
    from nmtflow.train.trainer import Trainer

    cut = Trainer(epoch_config(copy_data, tmp_path / "cut", 1))
    batches = len(cut.epoch_batches(1))
    assert batches % 4, batches  # the epoch's last update is short
    first = train_losses(cut)
    assert (cut.progress.epoch, cut.progress.position) == (2, 0)
    assert cut.progress.update == len(first) == -(-batches // 4)
    assert cut.progress.stopped == "reached max_epochs=1"
    resumed = train_losses(Trainer(epoch_config(copy_data, tmp_path / "cut", 2)))
    assert resumed == train_losses(Trainer(epoch_config(copy_data, tmp_path / "full", 2)))
    assert len(resumed) == 2 * len(first)


def test_ddp_update_freq_k_on_2_ranks_equals_2k_on_one_across_an_epochs_end(copy_data: Path, tmp_path: Path) -> None:
    """README: N processes with update_freq k equal one with N·k; here also over the epoch's last, short update,
    and both stop where max_epochs ends (the ranks shorten the same update, so they stay in step)."""
    from nmtflow.train.trainer import Trainer, read_log
    from tests.train.test_distributed import torchrun, write_config

    def config(name: str, update_freq: int):
        c = epoch_config(copy_data, tmp_path / name, 1)
        c.train.update_freq, c.train.lr, c.train.warmup_updates, c.model.dropout = update_freq, 1e-3, 1, 0.0
        return c

    single = Trainer(config("single", 4))
    assert (len(single.epoch_batches(1)) // 2) % 2  # each rank's epoch ends with an update of one batch
    train_losses(single)
    torchrun(write_config(config("ddp", 2), tmp_path / "ddp.yaml"))
    logs = {name: [(e["update"], e["loss"]) for e in read_log(tmp_path / name) if e["kind"] == "train"]
            for name in ("single", "ddp")}
    assert [u for u, _ in logs["ddp"]] == [u for u, _ in logs["single"]] == list(range(1, single.progress.update + 1))
    assert [loss for _, loss in logs["ddp"]] == pytest.approx([loss for _, loss in logs["single"]], rel=1e-5)
    ddp = load_checkpoint(tmp_path / "ddp" / "checkpoint_last.pt")["progress"]
    assert (ddp["epoch"], ddp["position"], ddp["stopped"]) == (2, 0, "reached max_epochs=1")
    assert len(list((tmp_path / "ddp" / "tensorboard").glob("events.*"))) == 1  # rank 0's scalars only


TRAIN_WITH_A_FULL_DISK = """
import resource, signal, sys
from nmtflow.cli import main
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails (EFBIG) like one on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), resource.RLIM_INFINITY))
sys.exit(main(sys.argv[2:]))
"""


def test_a_full_disk_at_start_leaves_the_runs_config_yaml_whole(copy_data: Path, tmp_path: Path) -> None:
    """config.yaml, the file a resume is told to use, is rewritten at every start: atomically, like the log."""
    import subprocess
    import sys

    from nmtflow.checkpoint import remove_interrupted_saves

    run, config = tmp_path / "run", run_config(tmp_path, copy_data)
    threads = torch.get_num_threads()
    try:
        assert main(["train", str(config), "--save-dir", str(run)]) == 0
    finally:
        torch.set_num_threads(threads)
    saved = (run / "config.yaml").read_text(encoding="utf-8")
    limit = len(saved) // 2
    assert (run / "log.jsonl").stat().st_size < limit  # the log's rewrite fits: config.yaml's does not
    again = subprocess.run([sys.executable, "-c", TRAIN_WITH_A_FULL_DISK, str(limit), "train", str(config),
                            "--save-dir", str(run), "--set", "train.max_updates=3"],
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 2, again.stderr[-2000:]
    assert again.stderr.strip().splitlines()[-1] == (f"nmtflow train: error: {run / 'config.yaml'}: could not write "
                                                     "the run's config (File too large); it is unchanged")
    assert (run / "config.yaml").read_text(encoding="utf-8") == saved
    for name in (".log.jsonl.x1.tmp", ".config.yaml.x2.tmp"):  # what a kill -9 during a rewrite leaves
        write(run / name, "{")
    assert sorted(p.name for p in remove_interrupted_saves(run)) == [".config.yaml.x2.tmp", ".log.jsonl.x1.tmp"]
    assert not list(run.glob(".*.tmp"))
