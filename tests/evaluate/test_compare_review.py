"""``nmtflow compare`` review: mistakes that used to train (or prepare data) before failing, an --out that is not
a comparison's, and why a killed run failed. None of these tests trains a model."""
from __future__ import annotations

import dataclasses
import re
import signal
from pathlib import Path

import pytest
import torch

from nmtflow.cli import main
from nmtflow.config import ConfigError, DecodeConfig
from nmtflow.evaluate import compare
from nmtflow.evaluate.compare import run_comparison
from nmtflow.evaluate.experiment import load_experiment
from tests.evaluate.test_compare import TINY


@pytest.fixture
def experiment(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(TINY, encoding="utf-8")
    return path


@pytest.mark.parametrize("override, message", [
    ("decode.beam_size=0", r"decode\.beam_size: must be >= 1"),
    ("decode.max_sentences=0", r"decode\.max_sentences: must be >= 1"),
    ("decode.max_tokens=0", r"decode\.max_tokens: must be >= 1"),
    ("decode.max_len_a=-1", r"decode\.max_len_a: must be >= 0"),
    ("decode.min_len=-1", r"decode\.min_len: must be >= 0"),
    ("test_sets=[test, test]", r"test_sets: 'test' is listed twice"),
    ("device=tpu", r"device: expected auto, cpu, cuda, cuda:N or mps, got 'tpu'"),
    ("devices=[cpu, gpu0]", r"devices\[1\]: expected auto, cpu, cuda, cuda:N or mps, got 'gpu0'"),
    ("threads=0", r"threads: must be >= 1"),
    ("decode.len_penalty=.nan", r"decode\.len_penalty: must be a finite number, got nan"),
    ("decode.max_len_a=.inf", r"decode\.max_len_a: must be >= 0 \(and finite\), got inf"),
    ("seeds=[-1]", r"seeds: -1 is not a training seed: each must be in \[0, 2\*\*32\)"),
    ("data.synthetic.n_train=-5", r"data\.synthetic\.n_train: the number of train sentences must be >= 1, got -5"),
    # these failed after the corpus had been drawn, naming neither the file nor the key
    ("data.max_len=0", r"data\.max_len: must be >= 1 \(tokens of a training sentence\), got 0"),
    ("data.max_ratio=-1", r"data\.max_ratio: must be >= 1 \(longer side / shorter side\), got -1\.0"),
    ("data.vocab_size=-5", r"data\.vocab_size: must be > 4 \(the special pieces and at least one more\), got -5"),
    ("decode.len_penalty=1000", r"decode\.len_penalty: must be between -20 and 20"),
])
def test_settings_that_failed_after_training_are_errors_naming_where_they_were_set(experiment: Path,
                                                                                    override: str,
                                                                                    message: str) -> None:
    """These trained every run, then failed to decode (or crashed writing the report: device=tpu). The error
    names the override that set the value (it named the experiment file), or the file where the file set it."""
    with pytest.raises(ConfigError, match=rf"^override '{re.escape(override)}': {message}"):
        load_experiment(experiment, [override])


def test_min_len_reaches_the_runs_decode_settings(experiment: Path) -> None:
    """The experiment's decode.min_len overrides each run's (as the compare job applies its search overrides)."""
    search = load_experiment(experiment, ["decode.min_len=3"]).decode.search_overrides()
    assert dataclasses.replace(DecodeConfig(), **search).min_len == 3
    assert "min_len" not in load_experiment(experiment).decode.search_overrides()


def test_a_bad_value_set_by_the_file_names_the_file(experiment: Path) -> None:
    experiment.write_text(experiment.read_text(encoding="utf-8") + "devices: [cpu, gpu0]\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(experiment))}: devices\[1\]: expected auto"):
        load_experiment(experiment, ["parallel=2"])


@pytest.mark.parametrize("override, message", [
    ("runs=[{name: a, config: no-such-config}]", r"tiny\.yaml: config 'no-such-config' not found"),
    ("overrides=[model.no_such_key=3]", r"tiny\.yaml: runs\[0\] \(baseline\): .*unknown key 'no_such_key'"),
    ("data.directions=[en-en]", r"tiny\.yaml: data\.directions: the bilingual run 'baseline' trains en-en: "
                                r"source and target are the same language"),
])
def test_run_errors_come_before_the_data_is_prepared(experiment: Path, tmp_path: Path, override: str,
                                                     message: str) -> None:
    """A run's config error used to surface only after generating and preparing the corpus (en-en: after
    training, with BLEU nan)."""
    with pytest.raises(ConfigError, match=message):
        run_comparison(experiment, out=tmp_path / "out", overrides=[override])
    assert not (tmp_path / "out").exists()


def test_missing_cuda_devices_are_errors_before_training(experiment: Path, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"tiny\.yaml: devices\[0\]: cuda:7, but CUDA is not available"):
        run_comparison(experiment, out=tmp_path / "out", overrides=["devices=[cuda:7]"])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"devices\[0\]: cuda:7, but this machine has 2 CUDA device\(s\)"):
        run_comparison(experiment, out=tmp_path / "out", overrides=["devices=[cuda:7]"])
    assert not (tmp_path / "out").exists()


def test_an_out_directory_of_something_else_is_refused(experiment: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "results.md").write_text("my own results\n", encoding="utf-8")
    (other / "runs").mkdir()
    with pytest.raises(ConfigError, match=r"--out .*other: not a comparison's directory, and it holds results\.md, "
                                          r"runs, which a comparison would overwrite"):
        run_comparison(experiment, out=other)
    assert (other / "results.md").read_text(encoding="utf-8") == "my own results\n"
    assert sorted(p.name for p in other.iterdir()) == ["results.md", "runs"]
    (tmp_path / "file").write_text("x", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"--out .*file: exists and is not a directory"):
        run_comparison(experiment, out=tmp_path / "file")
    # a directory that holds only unrelated files (say, the experiment file itself) is fine, and so is a comparison's
    compare.check_out(tmp_path)
    (other / compare.MARKER).write_text("{}", encoding="utf-8")
    compare.check_out(other)


def test_an_empty_only_is_an_error_not_every_run(experiment: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["compare", str(experiment), "--out", str(tmp_path / "out"), "--only", ","]) == 2
    assert "--only ',': name one or more runs" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_killed_run_says_it_was_killed(tmp_path: Path) -> None:
    """Not 'exit status -9' followed by the last progress line of its log, which reads as the reason."""
    (tmp_path / "train.log").write_text("update 30 | epoch 3 | loss 5.403\n", encoding="utf-8")
    status, result, error = compare._outcome(tmp_path, -signal.SIGKILL, False)
    assert (status, result) == ("failed", None)
    assert error.startswith("killed by SIGKILL (out of memory?)") and "update 30" not in error
    assert compare._outcome(tmp_path, -signal.SIGSEGV, False)[2].startswith("killed by SIGSEGV;")
    assert compare._outcome(tmp_path, 1, False)[2].startswith("exit status 1: update 30")


def test_an_isolated_runs_log_is_written_as_its_output_arrives(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """``train.log`` holds each chunk of the run's output before the next one is read (it was block-buffered: a
    long run's log lagged its terminal output by about 8 KB)."""
    import io
    import subprocess

    from nmtflow.evaluate import compare

    seen: list[str] = []

    class Output(io.BytesIO):
        def read1(self, size: int = -1) -> bytes:
            seen.append((tmp_path / "train.log").read_text(encoding="utf-8"))
            return super().read1(min(size, 6))

    class FakeProcess:
        def __init__(self, *args, **kwargs) -> None:
            self.stdout = Output(b"first\nsecond\n")

        def wait(self) -> int:
            return 0

        def send_signal(self, signum: int) -> None:
            pass

    monkeypatch.setattr(subprocess, "Popen", FakeProcess)
    assert compare._run_isolated(tmp_path / "job.json", tmp_path) == (0, False)
    assert seen == ["", "first\n", "first\nsecond", "first\nsecond\n"]


def test_the_training_loss_curve_takes_each_entrys_mean_where_the_log_has_one(tmp_path: Path) -> None:
    """train_loss.png plots ``loss_mean`` (the mean since the previous log entry) and, in logs written before it
    existed, the update's own ``loss``."""
    import json

    from nmtflow.evaluate.compare_report import validation_curves

    entries = [{"kind": "train", "update": 1, "loss": 5.0},  # an older log's entry: no mean
               {"kind": "train", "update": 2, "loss": 4.0, "loss_mean": 4.5},
               {"kind": "valid", "update": 2, "nll": 3.0}]
    (tmp_path / "log.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries), encoding="utf-8")
    run = {"seeds": [{"dir": tmp_path}]}
    assert validation_curves(run, ("loss_mean", "loss"), "train") == ([1, 2], [5.0, 4.5])
    assert validation_curves(run, "loss", "train") == ([1, 2], [5.0, 4.0])
    assert validation_curves(run, "nll") == ([2], [3.0])


def _state(pid: int) -> str:
    """The process's state letter from /proc (``T``: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _wait_for(predicate, seconds: float = 20.0) -> bool:
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_ctrl_z_pauses_a_comparisons_runs_and_fg_resumes_them() -> None:
    """A run has a session of its own, so a terminal's Ctrl-Z (SIGTSTP) stopped the comparison and left its
    trainings running; now the comparison stops each run's process group first and continues it when continued."""
    import os
    import subprocess
    import sys

    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "from nmtflow.evaluate.compare import _pause_with\n"
        "sleeper = 'import time\\nwhile True: time.sleep(0.01)'\n"
        "child = subprocess.Popen([sys.executable, '-c', sleeper], start_new_session=True)\n"
        "with _pause_with(lambda: [child]):\n"
        "    print(child.pid, flush=True)\n"
        "    while True:\n"
        "        time.sleep(0.05)\n")], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert _state(child) != "T"
        os.kill(parent.pid, signal.SIGTSTP)  # what the terminal sends on Ctrl-Z
        assert _wait_for(lambda: _state(parent.pid) == "T" and _state(child) == "T")
        os.kill(parent.pid, signal.SIGCONT)  # what the shell's fg sends
        assert _wait_for(lambda: _state(parent.pid) != "T" and _state(child) != "T")
    finally:
        for pid in (child, parent.pid):
            if pid:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        parent.wait()
