"""``nmtflow.load``: one object that translates and scores, equal to the translators the CLI builds; and the Python API
page's examples, run against tiny checkpoints trained here."""
from __future__ import annotations

import inspect
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import nmtflow
from nmtflow.checkpoint import CheckpointError
from nmtflow.cli import main
from nmtflow.config import ConfigError, DecodeConfig, load_config
from nmtflow.decode.ensemble import ensemble_translator, open_translators
from nmtflow.decode.multilingual import load_multilingual
from nmtflow.decode.translate import Translator

from tests.conftest import copy_sentences
from tests.decode.test_ensemble import train
from tests.train.test_train_review import three_langs  # noqa: F401  (the tiny en/de/fr fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
LINES = copy_sentences(6, 21)


@pytest.fixture(scope="module")
def checkpoints(one_thread: None, copy_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    """Two tiny bilingual (src → tgt) checkpoints of different architectures on the same prepared data: a
    Transformer trained until it writes words (not only the empty translation), a feature-fusion model of 2 updates."""
    root = tmp_path_factory.mktemp("api")
    fused = {"type": "shortcut", "feature_fusion": True}
    return (train(copy_data, root / "transformer", 1, schedule={"max_updates": 30, "lr": 1e-2, "warmup_updates": 5}),
            train(copy_data, root / "fusion", 2, encoder_self_attention=fused, decoder_self_attention=fused))


@pytest.fixture(scope="module")
def bridge(one_thread: None, three_langs: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny en/de/fr attention-bridge checkpoint (one update); de→fr held out (zero-shot)."""
    from nmtflow.train.multilingual import MultilingualTrainer

    save = tmp_path_factory.mktemp("api-bridge")
    MultilingualTrainer(load_config(data={
        "model": {"name": "bridge", "hidden_dim": 16, "encoder_layers": 1, "decoder_layers": 1, "dropout": 0.0,
                  "bridge_heads": 2, "bridge_dim": 8},
        "data": {"path": str(three_langs), "max_tokens": 600,
                 "multilingual": {"langs": ["en", "de", "fr"], "zero_shot": ["de-fr"]}},
        "train": {"save_dir": str(save), "lr": 5e-3, "warmup_updates": 1, "max_updates": 1, "validate_every": 0,
                  "save_every": 0, "progress": False, "valid_bleu": False}})).train()
    return str(save / "checkpoint_last.pt")


def lower_level(path: str, **decode: object) -> Translator:
    """The CLI's translator (``open_translators``) with ``decode`` set as the CLI sets its options."""
    translator = open_translators([path], "cpu")
    for name, value in decode.items():
        setattr(translator.decode, name, value)
    return translator


# ---- the package ---------------------------------------------------------------------------------------------
def test_import_nmtflow_stays_light_and_load_documents_itself() -> None:
    code = "import sys, nmtflow; print(sorted(m for m in ('torch', 'nmtflow.api') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    params = inspect.signature(nmtflow.load).parameters
    assert list(params) == ["path_or_paths", "device", "src_lang", "tgt_lang", "decode"]
    assert params["device"].default == "auto" and params["src_lang"].kind is inspect.Parameter.KEYWORD_ONLY
    assert "DecodeConfig" in nmtflow.load.__doc__ and "ensemble" in nmtflow.load.__doc__


# ---- str and list, n-best lists and scores --------------------------------------------------------------------
def test_a_str_is_one_sentence_and_a_list_a_list(checkpoints: tuple[str, str]) -> None:
    model = nmtflow.load(checkpoints[0], beam_size=3)
    best = model.translate(LINES)
    assert sum(bool(t) for t in best) >= len(LINES) // 2  # the model writes words: the checks below can fail
    assert isinstance(best, list) and len(best) == len(LINES) and all(isinstance(t, str) for t in best)
    assert best == [nb[0][0] for nb in lower_level(checkpoints[0], beam_size=3).translate(LINES)]
    one = model.translate(LINES[2])
    assert isinstance(one, str) and one == model.translate([LINES[2]])[0]
    assert model.translate(tuple(LINES)) == model.translate(line for line in LINES) == best
    assert model.translate([]) == []
    for bad, message in ((b"bytes", "bytes"), ([LINES[0], None], r"sentences\[1\] is a NoneType"),
                         (3, "expected a str or a list")):
        with pytest.raises(TypeError, match=message):
            model.translate(bad)  # type: ignore[arg-type]
    # a lone surrogate is no UTF-8 text: named, not SentencePiece's bare TypeError
    surrogate = re.escape("is not valid Unicode text: a lone surrogate U+D800 at character 1")
    for call, message in ((lambda: model.translate("a\ud800"), rf"translate: sentences\[0\] {surrogate}"),
                          (lambda: model.score(["x", "y"], ["a", "a\ud800"]), rf"score: targets\[1\] {surrogate}"),
                          (lambda: lower_level(checkpoints[0]).translate(["ok", "a\ud800"]),
                           rf"^sentence 1 \(0-based\) {surrogate}"),
                          (lambda: lower_level(checkpoints[0]).score(["a\ud800"], ["ok"]),
                           rf"^source line 1 {surrogate}")):
        with pytest.raises(ValueError, match=message):
            call()


def test_translator_refuses_a_bare_str(checkpoints: tuple[str, str]) -> None:
    translator = lower_level(checkpoints[0])
    for call in (lambda: translator.translate(LINES[0]), lambda: list(translator.translate_stream(LINES[0])),
                 lambda: translator.score(LINES[0], LINES[0])):
        with pytest.raises(TypeError, match=r"expected a list of sentences, got a str \(pass \[sentence\]"):
            call()
    with pytest.raises(ValueError, match="2 sources but 1 targets"):
        translator.score(LINES[:2], LINES[:1])


def test_nbest_and_scores_are_the_translators_best_first(checkpoints: tuple[str, str]) -> None:
    model = nmtflow.load(checkpoints[0], beam_size=4)
    scored = model.translate(LINES, nbest=3, return_scores=True)
    assert scored == lower_level(checkpoints[0], beam_size=4, nbest=3).translate(LINES)
    for nbest in scored:
        assert len(nbest) == 3 and all(isinstance(t, str) and isinstance(s, float) for t, s in nbest)
        assert [s for _, s in nbest] == sorted((s for _, s in nbest), reverse=True)
    assert model.translate(LINES, nbest=3) == [[t for t, _ in nb] for nb in scored]
    best = model.translate(LINES)
    assert model.translate(LINES, nbest=1) == [[t] for t in best]  # nbest given: a list, even of one
    assert model.translate(LINES, return_scores=True) == [nb[0] for nb in scored]
    text, score = model.translate(LINES[0], return_scores=True)
    assert text == scored[0][0][0] and score == pytest.approx(scored[0][0][1], abs=1e-5)  # (batched alone)
    assert model.translate(LINES[0], nbest=2) == [t for t, _ in scored[0][:2]]
    assert nmtflow.load(checkpoints[0], beam_size=4, nbest=2).translate(LINES[:2]) == [
        [t for t, _ in nb[:2]] for nb in scored[:2]]  # nbest at load: lists too


def test_score_gives_the_values_of_the_cli(checkpoints: tuple[str, str], tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    model = nmtflow.load(checkpoints[0], device="cpu")
    targets = model.translate(LINES)
    scores = model.score(LINES, targets)
    src, tgt = tmp_path / "src.txt", tmp_path / "tgt.txt"
    src.write_text("".join(s + "\n" for s in LINES), encoding="utf-8")
    tgt.write_text("".join(t + "\n" for t in targets), encoding="utf-8")
    assert main(["score", checkpoints[0], "--src", str(src), "--tgt", str(tgt), "--json", "--device", "cpu"]) == 0
    assert scores == pytest.approx(json.loads(capsys.readouterr().out), abs=1e-6)
    assert scores == lower_level(checkpoints[0]).score(LINES, targets)
    assert all(s <= 0 for s in scores)
    assert model.score(LINES[1], targets[1]) == pytest.approx(scores[1], abs=1e-5)  # (batched alone)
    with pytest.raises(TypeError, match="two str"):
        model.score(LINES[1], targets)
    with pytest.raises(ValueError, match="6 sources but 5 targets"):
        model.score(LINES, targets[:5])
    long = " ".join(["alpha"] * 1100)  # more pieces than the target positions: named by its index
    with pytest.raises(ValueError, match=r"^targets\[1\] has \d+ tokens"):
        model.score(LINES[:2], [targets[0], long])
    for option in ({"beam_size": 3}, {"greedy": True}, {"len_penalty": 2.0}, {"sampling": True, "seed": 1}):
        with pytest.raises(TypeError, match=f"score: '{next(iter(option))}' is a search option"):
            model.score(LINES, targets, **option)  # as `nmtflow score --beam 3` is refused: it would be ignored
    assert model.score(LINES, targets, max_tokens=50) == pytest.approx(scores, abs=1e-5)  # batching: allowed


# ---- options, ensembles, devices -----------------------------------------------------------------------------
def test_decode_options_at_load_and_per_call(checkpoints: tuple[str, str]) -> None:
    model = nmtflow.load(checkpoints[0], beam_size=2, len_penalty=1.0)
    assert (model.decode.beam_size, model.decode.len_penalty) == (2, 1.0)
    scored = model.translate(LINES, return_scores=True)
    assert scored == [nb[0] for nb in lower_level(checkpoints[0], beam_size=2, len_penalty=1.0).translate(LINES)]
    assert scored != nmtflow.load(checkpoints[0], beam_size=2).translate(LINES, return_scores=True)
    greedy = lower_level(checkpoints[0], greedy=True, len_penalty=1.0).translate(LINES)
    assert model.translate(LINES, greedy=True, return_scores=True) == [nb[0] for nb in greedy]
    wide = model.translate(LINES, beam_size=4, max_len_b=3, len_penalty=0.0, return_scores=True)  # this call only
    assert wide == [nb[0] for nb in lower_level(checkpoints[0], beam_size=4, len_penalty=0.0,
                                                max_len_b=3).translate(LINES)]
    assert wide != scored and model.translate(LINES, return_scores=True) == scored
    assert (model.decode.beam_size, model.decode.len_penalty, model.decode.max_len_b) == (2, 1.0, 10)
    with pytest.raises(TypeError, match=r"unknown decode option 'beam' \(did you mean 'beam_size'\? valid: "
                                        r"beam_size, nbest, .*greedy"):
        model.translate(LINES, beam=5)
    with pytest.raises(TypeError, match="nmtflow.load: unknown decode option 'lenpen'"):
        nmtflow.load(checkpoints[0], lenpen=1.0)
    with pytest.raises(ConfigError, match="decode.beam_size: expected an integer, got '5'"):
        model.translate(LINES, beam_size="5")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="decode.nbest: 3 is more than beam_size 2"):
        model.translate(LINES, nbest=3)


def test_sampling_and_prefixes_through_the_api(checkpoints: tuple[str, str]) -> None:
    model = nmtflow.load(checkpoints[0])
    sampled = model.translate(LINES, sampling=True, top_k=5, seed=3, nbest=2, return_scores=True)
    assert sampled == lower_level(checkpoints[0], sampling=True, top_k=5, seed=3, nbest=2).translate(LINES)
    assert sampled != model.translate(LINES, sampling=True, top_k=5, seed=4, nbest=2, return_scores=True)
    best = model.translate(LINES, greedy=True)
    prefixes = [" ".join(text.split()[:1]) for text in best]
    assert model.translate(LINES, greedy=True, prefixes=prefixes) == best  # its own first word: the same output
    word = next(w for w in LINES[1].split() if not best[0].startswith(w))  # a word of the vocabulary, not best[0]'s
    forced = model.translate(LINES[0], greedy=True, prefixes=word)
    assert forced.startswith(word) and forced != best[0]
    with pytest.raises(ValueError, match="1 prefixes for 2 input lines"):
        model.translate(LINES[:2], prefixes=["a"])


def test_a_list_of_checkpoints_is_the_clis_ensemble(checkpoints: tuple[str, str]) -> None:
    a, b = checkpoints
    ensemble = nmtflow.load([a, Path(b)], beam_size=3)
    reference = ensemble_translator([open_translators([a]), open_translators([b])], [a, b])
    reference.decode.beam_size = 3
    scored = ensemble.translate(LINES, nbest=2, return_scores=True)
    reference.decode.nbest = 2
    assert scored == reference.translate(LINES)
    targets = [nb[0][0] for nb in scored]
    assert ensemble.score(LINES, targets) == reference.score(LINES, targets)
    assert ensemble.score(LINES, targets) != nmtflow.load(a).score(LINES, targets)  # both members count


def test_device_auto_is_the_clis(checkpoints: tuple[str, str]) -> None:
    model = nmtflow.load(checkpoints[0])
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert model.device.type == expected
    assert next(model.translator().model.parameters()).device.type == expected
    assert nmtflow.load(checkpoints[0], torch.device("cpu")).device == torch.device("cpu")
    with pytest.raises(ValueError, match="device 'tpu'"):
        nmtflow.load(checkpoints[0], device="tpu")


def test_clear_errors_for_files(checkpoints: tuple[str, str], tmp_path: Path) -> None:
    text = tmp_path / "notes.txt"
    text.write_text("not a model\n", encoding="utf-8")
    for path, message in ((tmp_path / "missing.pt", "checkpoint not found"),
                          (text, r"not an nmtflow checkpoint \(not a PyTorch checkpoint file\)"),
                          (tmp_path, "a directory, not a checkpoint file")):
        with pytest.raises(CheckpointError, match=f"^{re.escape(str(path))}: {message}"):
            nmtflow.load(path)
    with pytest.raises(CheckpointError, match=f"^{re.escape(str(text))}: "):  # an ensemble member, named
        nmtflow.load([checkpoints[0], text])
    with pytest.raises(ValueError, match="no checkpoint given"):
        nmtflow.load([])
    with pytest.raises(TypeError, match="expected checkpoint paths"):
        nmtflow.load([checkpoints[0], 3])


# ---- multilingual --------------------------------------------------------------------------------------------
def test_directions_of_a_multilingual_model(bridge: str) -> None:
    reference = load_multilingual(bridge)
    model = nmtflow.load(bridge, src_lang="de", tgt_lang="en", beam_size=2)
    assert (model.directions, model.zero_shot) == (reference.directions, reference.zero_shot) and model.zero_shot
    lines = ["ein mann", "zwei hunde spielen"]
    seen = []
    for src, tgt, call in (("de", "en", {}), ("de", "fr", {"tgt_lang": "fr"}),  # the default, then zero-shot
                           ("fr", "en", {"src_lang": "fr"}), ("en", "de", {"src_lang": "en", "tgt_lang": "de"})):
        translator = reference.translator(src, tgt, DecodeConfig(beam_size=2))
        expected = [nb[0] for nb in translator.translate(lines)]
        assert model.translate(lines, return_scores=True, **call) == expected, (src, tgt)
        targets = [text for text, _ in expected]
        assert model.score(lines, targets, **call) == translator.score(lines, targets)
        seen.append(expected)
    assert all(a != b for n, a in enumerate(seen) for b in seen[n + 1:])  # four directions, four models
    unnamed = nmtflow.load(bridge)  # loads; a call must name the direction
    with pytest.raises(CheckpointError, match=f"^{re.escape(bridge)}: a multilingual checkpoint .*de-en.*"
                                              "zero-shot: de-fr.*name the source and the target language"):
        unnamed.translate(lines)
    assert unnamed.translate(lines, src_lang="de", tgt_lang="en", beam_size=2) == model.translate(lines)
    with pytest.raises(CheckpointError, match=f"^{re.escape(bridge)}: language 'xx' is unknown to this model"):
        nmtflow.load(bridge, src_lang="xx", tgt_lang="en")
    with pytest.raises(CheckpointError, match="language 'xx' is unknown"):
        model.translate(lines, tgt_lang="xx")
    with pytest.raises(ValueError, match=f"^{re.escape(bridge)}: name both languages"):
        nmtflow.load(bridge, src_lang="de")
    with pytest.raises(CheckpointError, match=f"^{re.escape(bridge)}: a multilingual checkpoint \\(trained: .*de-en.*; "
                                              "zero-shot: de-fr.*\\): name the direction with --src-lang"):
        Translator.from_checkpoint(bridge)  # what `nmtflow translate` without --src-lang/--tgt-lang says


def test_a_bilingual_model_translates_only_its_own_direction(checkpoints: tuple[str, str]) -> None:
    own = nmtflow.load(checkpoints[0], src_lang="src", tgt_lang="tgt")
    assert own.translate(LINES) == nmtflow.load(checkpoints[0]).translate(LINES)
    assert own.directions == ["src-tgt"] and own.zero_shot == []
    with pytest.raises(CheckpointError, match=r"a bilingual src→tgt model cannot translate tgt→src \(name no "
                                              r"languages, or src and tgt\)"):
        nmtflow.load(checkpoints[0], src_lang="tgt", tgt_lang="src")


# ---- the guide's page runs -----------------------------------------------------------------------------------
def test_the_python_api_page_examples_run(checkpoints: tuple[str, str], bridge: str, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Every python block of docs/guide/python-api.md above its training example, run in order in one namespace
    where the paths it names hold tiny checkpoints."""
    page = (ROOT / "docs" / "guide" / "python-api.md").read_text(encoding="utf-8")
    api = page[:page.index("\n## Training and evaluating from Python")]
    blocks = re.findall(r"^```python\n(.*?)^```", api, flags=re.S | re.M)
    assert len(blocks) == 8 and blocks[0].startswith("import nmtflow\n")
    for name, source in (("en-de", checkpoints[0]), ("en-de-fusion", checkpoints[1]), ("bridge", bridge)):
        (tmp_path / "runs" / name).mkdir(parents=True)
        shutil.copy(source, tmp_path / "runs" / name / "checkpoint_best.pt")
    monkeypatch.chdir(tmp_path)
    ns: dict[str, object] = {"__name__": "__main__"}  # as a script run by itself
    for n, block in enumerate(blocks):
        exec(compile(block, f"python-api.md block {n + 1}", "exec"), ns)
    out = capsys.readouterr().out
    sentences = ns["sentences"]
    assert isinstance(ns["one"], str) and isinstance(ns["text"], str) and isinstance(ns["score"], float)
    for name in ("best", "wide", "fast", "averaged"):
        assert len(ns[name]) == len(sentences) and all(isinstance(t, str) for t in ns[name]), name
    assert [len(nb) for nb in ns["nbest"]] == [3, 3] and ns["nbest"] == [[t for t, _ in nb] for nb in ns["scored"]]
    assert len(ns["log_probs"]) == 2 and isinstance(ns["single"], float)
    assert ns["model"].decode.beam_size == 8 and ns["ensemble"].paths[1].endswith("en-de-fusion/checkpoint_best.pt")
    assert all(len(ns[name]) == 1 for name in ("english", "french", "back"))
    assert ns["parallel"] == ns["best"] * 20  # the workers' translations (stopped by the with block)
    assert "runs/missing.pt: checkpoint not found" in out and "runs/en-de: a directory" in out
    assert "unknown decode option 'beam' (did you mean 'beam_size'?" in out


def test_workers_through_the_api_for_two_directions_then_close(bridge: str) -> None:
    """``nmtflow.load(..., workers=2)`` on a multilingual model: each direction's translations are one process's,
    per-call options reuse that direction's workers, and ``with`` stops them all."""
    from nmtflow.decode import workers

    lines = ["ein mann", "zwei hunde spielen", "eine frau", "ein kind läuft", "zwei männer"] * 4
    one = nmtflow.load(bridge, src_lang="de", tgt_lang="en", beam_size=2, max_tokens=8)
    with nmtflow.load(bridge, src_lang="de", tgt_lang="en", beam_size=2, max_tokens=8, workers=2) as model:
        for call in ({}, {"tgt_lang": "fr"}):
            assert model.translate(lines, **call) == one.translate(lines, **call)
            pool = workers._POOLS[model.translator(**{"src_lang": "de", **call}).model]
            assert model.translate(lines, beam_size=3, **call) == one.translate(lines, beam_size=3, **call)
            assert workers._POOLS[model.translator(**{"src_lang": "de", **call}).model] is pool
        pools = [workers._POOLS[t.model] for t in model._translators.values()]
        processes = [p for pool in pools for p in pool._executor._processes.values()]
        assert len(pools) == 2 and len(processes) == 4 and all(p.is_alive() for p in processes)
    assert all(t.model not in workers._POOLS for t in model._translators.values())
    assert not any(p.is_alive() for p in processes)
