"""The command line: clear one-line errors for bad input, JSON model summaries, translate/score/evaluate."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from nmtflow.cli import main

REPO = Path(__file__).resolve().parents[1]


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


def test_info_json_counts_parameters(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(["info", str(REPO / "configs" / "transformer-base.yaml"), "--vocab-size", "32000", "--json"],
                       capsys)
    assert code == 0
    info = json.loads(out)
    assert info["parameters"] == sum(info["modules"].values())
    d, f, L, V = 512, 2048, 6, 32000
    enc = L * (4 * d * d + 2 * d * f + f + d + 4 * d)
    dec = L * (8 * d * d + 2 * d * f + f + d + 6 * d)
    assert info["parameters"] == V * d + enc + dec + 4 * d


def test_under_torchrun_a_config_error_is_printed_by_rank_0_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Every process meets a config error alike: one line from rank 0, not one per process. Other errors may be
    one rank's own, so every rank prints them, naming itself."""
    config = str(REPO / "configs" / "transformer-small.yaml")
    for rank, printed in (("0", "nmtflow train: error: override 'train.lr=abc'"), ("1", "")):
        monkeypatch.setenv("RANK", rank)
        code, _, err = run(["train", config, "--set", "train.lr=abc", "--save-dir", str(tmp_path / "run")], capsys)
        assert code == 2 and err.strip().startswith(printed) and bool(err) == bool(printed)
    missing = str(tmp_path / "missing.txt")
    code, _, err = run(["evaluate", "--hyp", missing, "--ref", missing], capsys)
    assert code == 2 and err.startswith("nmtflow evaluate: error: rank 1: ") and missing in err


def test_unknown_config_key_is_a_one_line_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: {name: transformer, layers: 3}\n", encoding="utf-8")
    code, _, err = run(["info", str(bad)], capsys)
    assert code == 2
    assert "bad.yaml" in err and "'layers'" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_prepare_reports_mismatched_lines_and_bad_utf8(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "train.en").write_text("a\nb\nc\n", encoding="utf-8")
    (tmp_path / "train.de").write_text("a\nb\n", encoding="utf-8")
    code, _, err = run(["prepare", "--train", str(tmp_path / "train"), "--langs", "en", "de",
                        "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "train.de" in err and "Traceback" not in err
    (tmp_path / "train.de").write_bytes(b"a\nb\xff\xfe\nc\n")
    code, _, err = run(["prepare", "--train", str(tmp_path / "train"), "--langs", "en", "de",
                        "--out", str(tmp_path / "out")], capsys)
    assert code == 2 and "train.de:2" in err and "UTF-8" in err


def test_translate_score_evaluate_round_trip(copy_data: Path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    code, _, _ = run(["train", str(REPO / "configs" / "transformer-small.yaml"), "--data", str(copy_data),
                      "--save-dir", str(tmp_path / "m"), "--set", "model.encoder_layers=1",
                      "--set", "model.decoder_layers=1", "--set", "model.d_model=32", "--set", "model.ffn_dim=64",
                      "--set", "train.max_updates=5", "--set", "train.progress=false",
                      "--set", "data.src_lang=src", "--set", "data.tgt_lang=tgt"], capsys)
    assert code == 0
    ckpt = str(tmp_path / "m" / "checkpoint_last.pt")
    src = tmp_path / "in.txt"
    src.write_text("alpha bravo\n\ncharlie " + "delta " * 700 + "\n", encoding="utf-8")  # empty and over-long lines
    code, _, _ = run(["translate", ckpt, "-i", str(src), "-o", str(tmp_path / "out.txt"), "--beam", "2"], capsys)
    assert code == 0
    out_lines = (tmp_path / "out.txt").read_text(encoding="utf-8").split("\n")
    assert len(out_lines) == 4 and out_lines[1] == "" and out_lines[3] == ""
    code, out, _ = run(["translate", ckpt, "-i", str(src), "--nbest", "2", "--beam", "3"], capsys)
    rows = [ln.split("\t") for ln in out.splitlines()]
    assert code == 0 and all(len(r) == 3 for r in rows)
    assert [int(r[0]) for r in rows] == [0, 0, 1, 2, 2]  # an empty input has one (empty) hypothesis

    code, _, err = run(["score", ckpt, "--src", str(src), "--tgt", str(src)], capsys)
    assert code == 2 and "target line 3" in err  # too long to score: an error, never a silent truncation
    pairs = tmp_path / "pairs.txt"
    pairs.write_text("alpha bravo\n\ncharlie\n", encoding="utf-8")
    code, out, _ = run(["score", ckpt, "--src", str(pairs), "--tgt", str(pairs)], capsys)
    assert code == 0 and len(out.splitlines()) == 3 and all(float(x) <= 0 for x in out.split())
    cands = tmp_path / "cands.tsv"
    cands.write_text("alpha bravo\talpha bravo\tbravo alpha\tbravo\n", encoding="utf-8")
    code, out, _ = run(["score", ckpt, "--candidates", str(cands), "--json"], capsys)
    assert code == 0 and json.loads(out)["total"] == 1

    ref = tmp_path / "ref.txt"
    ref.write_text("alpha bravo charlie delta echo\n\ncharlie delta echo foxtrot\n", encoding="utf-8")
    code, out, _ = run(["evaluate", "--hyp", str(ref), "--ref", str(ref), "--json"], capsys)
    scores = json.loads(out)
    assert code == 0 and scores["BLEU"]["score"] == 100.0 and "nrefs:1" in scores["BLEU"]["signature"]

    code, _, err = run(["translate", str(tmp_path / "missing.pt"), "-i", str(src)], capsys)
    assert code == 2 and "missing.pt" in err


def test_stdin_is_translated_line_by_line(copy_data: Path, tmp_path: Path) -> None:
    """`nmtflow translate CKPT` with a pipe on stdin answers each line (the interactive path)."""
    from tests.conftest import tiny_config
    from nmtflow.train.trainer import Trainer

    Trainer(tiny_config(copy_data, tmp_path / "m", max_updates=3, valid_bleu=False)).train()
    proc = subprocess.Popen([sys.executable, "-m", "nmtflow", "translate", str(tmp_path / "m" / "checkpoint_last.pt"),
                             "--unbuffered", "--beam", "2"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write("alpha bravo\n")
    proc.stdin.flush()
    first = proc.stdout.readline()  # answered before stdin is closed
    proc.stdin.write("charlie\n")
    proc.stdin.close()
    rest = proc.stdout.read()
    assert proc.wait(timeout=60) == 0
    assert first.endswith("\n") and len(rest.splitlines()) == 1
