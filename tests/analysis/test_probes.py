"""Analyses (SPEC §2): lexical probes, similarity to E and gate statistics on tiny trained models, via the CLI."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nmtflow.analysis.probes import ProbeConfig, train_and_score
from nmtflow.analysis.report import layer_table
from nmtflow.checkpoint import save_atomic
from nmtflow.cli import main
from nmtflow.nn.shortcuts import ShortcutOptions
from nmtflow.train.trainer import Trainer
from tests.conftest import tiny_config

LAYERS = 2
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def checkpoints(copy_data: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """A baseline and a model with shortcuts in every slot (self and cross), each trained 20 updates at d=32."""
    root = tmp_path_factory.mktemp("analysis")
    slots = ("encoder_self_attention", "decoder_self_attention", "cross_attention")
    paths = []
    for name, shortcut_slots in (("baseline", ()), ("shortcuts", slots)):
        config = tiny_config(copy_data, root / name, max_updates=20, validate_every=20, save_every=20,
                             valid_bleu=False, log_every=10)
        config.model.d_model, config.model.ffn_dim = 32, 64
        for slot in shortcut_slots:
            setattr(config.model, slot, ShortcutOptions())
        Trainer(config).train()
        paths.append(str(root / name / "checkpoint_last.pt"))
    return paths


def analyze(kind: str, checkpoints: list[str], data: Path, out: Path, *extra: str) -> dict:
    code = main(["analyze", kind, *checkpoints, "--data", str(data), "--split", "valid", "--out", str(out),
                 "--labels", "baseline", "shortcuts", "--device", "cpu", *extra])
    assert code == 0
    name = "probes" if kind == "probe" else "similarity"
    assert (out / f"{name}.png").read_bytes()[:8] == PNG
    return json.loads((out / f"{name}.json").read_text(encoding="utf-8"))


def test_probe_command_writes_a_layer_table_and_plot(checkpoints: list[str], copy_data: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    result = analyze("probe", checkpoints, copy_data, tmp_path, "--epochs", "3")
    assert result["split"] == "valid" and result["settings"]["hidden"] == 512 and result["settings"]["dropout"] == 0.5
    assert list(result["models"]) == ["baseline", "shortcuts"]
    for model in result["models"].values():
        for side in ("encoder", "decoder"):
            assert len(model[side]) == LAYERS + 1  # E, then every layer
            assert all(0.0 <= acc <= 1.0 for acc in model[side])
            assert model[f"{side}_tokens"]["train"] > model[f"{side}_tokens"]["held_out"] > 0
        assert model["encoder"][0] > 0.5  # the embeddings themselves name the sub-word
    out = capsys.readouterr().out
    assert "encoder E" in out and "decoder 2" in out and "probes.json" in out


def test_similarity_command_reports_cosines_and_gate_statistics(checkpoints: list[str], copy_data: Path,
                                                                 tmp_path: Path) -> None:
    result = analyze("similarity", checkpoints, copy_data, tmp_path, "--max-sentences", "60")
    assert result["settings"]["max_sentences"] == 60
    baseline, shortcuts = result["models"]["baseline"], result["models"]["shortcuts"]
    for model in (baseline, shortcuts):
        for side in ("encoder", "decoder"):
            assert len(model[side]) == LAYERS + 1
            assert model[side][0] == pytest.approx(1.0, abs=1e-5)  # E against itself
            assert all(abs(c) <= 1.0 + 1e-5 for c in model[side])
    assert baseline["gates"] == {}
    slots = sorted((g["slot"], g["layer"]) for g in shortcuts["gates"].values())
    assert slots == sorted((s, n) for s in ("encoder.self_attn", "decoder.self_attn", "decoder.cross_attn")
                           for n in (1, 2))
    for g in shortcuts["gates"].values():
        for kv in ("k", "v"):
            assert 0.0 < g[f"{kv}_mean"] < 1.0 and 0.0 <= g[f"{kv}_std"] < 0.5
    assert (tmp_path / "gates.png").read_bytes()[:8] == PNG


def test_probe_learns_a_separable_code_and_unseen_words_count_as_errors() -> None:
    g = torch.Generator().manual_seed(0)
    y_train = torch.randint(4, 10, (600,), generator=g)
    y_test = torch.cat([torch.randint(4, 10, (90,), generator=g), torch.full((10,), 11)])  # 11: never trained on
    code = torch.randn(12, 16, generator=g)
    cfg = ProbeConfig(hidden=32, epochs=10, batch_size=128)
    accuracy = train_and_score(code[y_train], y_train, code[y_test], y_test, cfg)
    assert accuracy == pytest.approx(0.9)


def test_layer_table_lines_up_models_by_layer() -> None:
    table = layer_table({"a": {"encoder": [1.0, 0.5], "decoder": [1.0]}, "b": {"encoder": [0.9], "decoder": [0.8]}})
    lines = table.splitlines()
    assert lines[1].split() == ["encoder", "E", "1.0000", "0.9000"]
    assert lines[2].split() == ["encoder", "1", "0.5000", "-"]
    assert lines[3].split() == ["decoder", "E", "1.0000", "0.8000"]


def test_layer_outputs_hook_collects_each_layer() -> None:
    from tests.nn.test_shortcuts import batch, make

    model = make("lexical")
    src, tgt = batch()
    enc_layers: list[torch.Tensor] = []
    dec_layers: list[torch.Tensor] = []
    with torch.no_grad():
        enc = model.encoder(src, layer_outputs=enc_layers)
        final, _ = model.decoder.features(tgt, enc, layer_outputs=dec_layers)
        assert len(enc_layers) == len(dec_layers) == LAYERS
        torch.testing.assert_close(model.encoder.final_norm(enc_layers[-1]), enc["out"])
        torch.testing.assert_close(model.decoder.final_norm(dec_layers[-1]), final)
        assert set(enc) == set(model.encoder(src))  # the hook adds nothing to the encoder output


def analyze_error(capsys: pytest.CaptureFixture[str], kind: str, *args: str) -> str:
    """The one-line error of an ``nmtflow analyze`` command that must fail (exit status 2)."""
    assert main(["analyze", kind, *args, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("kind", ["probe", "similarity"])
def test_labels_must_differ(kind: str, checkpoints: list[str], copy_data: Path, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    """Results are keyed by label: a repeated label (or checkpoint) must not silently drop a model."""
    common = ["--data", str(copy_data), "--out", str(tmp_path), "--max-sentences", "20"]
    err = analyze_error(capsys, kind, *checkpoints, *common, "--labels", "same", "same")
    assert "nmtflow analyze: error: --labels must differ, got same, same" in err
    err = analyze_error(capsys, kind, checkpoints[0], checkpoints[0], *common)
    assert f"{checkpoints[0]} is given twice" in err and "--labels" in err
    assert not list(tmp_path.iterdir())
    result = analyze(kind, [checkpoints[0], checkpoints[0]], copy_data, tmp_path, "--max-sentences", "20",
                     *(["--epochs", "1"] if kind == "probe" else []))
    assert list(result["models"]) == ["baseline", "shortcuts"]  # the labels given: both kept


@pytest.mark.parametrize("kind", ["probe", "similarity"])
def test_a_multilingual_checkpoint_is_a_clear_error(kind: str, checkpoints: list[str], copy_data: Path,
                                                    tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt = torch.load(checkpoints[0], weights_only=True)
    ckpt["multilingual"], ckpt["langs"] = True, {"directions": ["src-tgt"], "zero_shot": []}
    save_atomic(ckpt, tmp_path / "multi.pt")  # an edit sealed with a new integrity code
    err = analyze_error(capsys, kind, str(tmp_path / "multi.pt"), "--data", str(copy_data), "--out", str(tmp_path))
    assert "multi.pt: a multilingual checkpoint; these analyses support bilingual checkpoints only" in err
    assert "--src-lang" not in err


@pytest.mark.parametrize("option", [("--holdout", "0"), ("--holdout", "1"), ("--holdout", "1.5"),
                                    ("--holdout", "-0.2"), ("--max-sentences", "0"), ("--max-sentences", "-3"),
                                    ("--batch-tokens", "0"), ("--epochs", "0")])
def test_probe_settings_are_checked(option: tuple[str, str], checkpoints: list[str], copy_data: Path,
                                    tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = analyze_error(capsys, "probe", checkpoints[0], "--data", str(copy_data), "--out", str(tmp_path), *option)
    assert f"nmtflow analyze: error: {option[0]}: " in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("option", [("--max-sentences", "0"), ("--batch-tokens", "-1")])
def test_similarity_settings_are_checked(option: tuple[str, str], checkpoints: list[str], copy_data: Path,
                                         tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = analyze_error(capsys, "similarity", checkpoints[0], "--data", str(copy_data), "--out", str(tmp_path),
                        *option)
    assert f"nmtflow analyze: error: {option[0]}: must be >= 1" in err


def test_similarity_without_shortcuts_removes_an_earlier_gate_plot(checkpoints: list[str], copy_data: Path,
                                                                   tmp_path: Path) -> None:
    analyze("similarity", checkpoints, copy_data, tmp_path, "--max-sentences", "20")
    assert (tmp_path / "gates.png").is_file()
    code = main(["analyze", "similarity", checkpoints[0], "--data", str(copy_data), "--out", str(tmp_path),
                 "--max-sentences", "20", "--device", "cpu"])
    assert code == 0 and not (tmp_path / "gates.png").exists()


def test_a_repeated_sentence_pair_is_probed_once() -> None:
    """A pair in both the training and the held-out part would score the probe on states it was trained on."""
    import numpy as np
    from types import SimpleNamespace

    from nmtflow.analysis.probes import distinct_pairs

    src = [np.array([5, 6]), np.array([7]), np.array([5, 6]), np.array([5, 6]), np.array([7])]
    tgt = [np.array([9]), np.array([9]), np.array([9]), np.array([8]), np.array([9])]
    m = SimpleNamespace(label="m", data=SimpleNamespace(src=src, tgt=tgt))
    rows = np.array([4, 0, 3, 2, 1])
    assert distinct_pairs(m, rows).tolist() == [4, 0, 3]  # 2 repeats 0's pair, 1 repeats 4's; 3 differs in tgt
