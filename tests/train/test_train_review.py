"""Review of training and config loading: errors name the file or override that holds the bad value, a run's
config.yaml reads back as written, devices the machine lacks and unreadable checkpoints are one-line errors, and a
save dir whose checkpoint_last.pt is missing or holds no training state is neither resumed nor wiped."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from nmtflow.cli import main
from nmtflow.config import ConfigError, load_config, to_dict, yaml_dump, yaml_load
from nmtflow.train.checkpoint import FORMAT, CheckpointError, average_checkpoints, load_checkpoint, save_atomic
from nmtflow.train.trainer import resolve_device

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
        assert main(["average", str(run), "-o", str(run / "checkpoint_last.pt")]) == 0
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
        assert {p.name for p in run.glob("checkpoint_*.pt")} == {"checkpoint_1.pt", "checkpoint_2.pt",
                                                                  "checkpoint_best.pt"}
        assert main(["train", str(config), "--save-dir", str(run), "--restart"]) == 0
    finally:
        torch.set_num_threads(threads)
    assert load_checkpoint(run / "checkpoint_last.pt")["progress"]["update"] == 2
