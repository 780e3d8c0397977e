"""``nmtflow serve`` over a real loopback socket: the JSON contract of every endpoint, equal to what ``nmtflow.load`` and
the analysis code compute; clear 4xx errors; concurrent clients get their own translations; the worker merges."""
from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

pytest.importorskip("fastapi")
import uvicorn  # noqa: E402

import nmtflow  # noqa: E402
from nmtflow.analysis.attention_maps import attention_maps  # noqa: E402
from nmtflow.cli import main  # noqa: E402
from nmtflow.config import load_config, to_dict  # noqa: E402
from nmtflow.data.batching import collate  # noqa: E402
from nmtflow.serve.app import create_app, model_names  # noqa: E402
from nmtflow.train.trainer import Trainer  # noqa: E402
from tests.conftest import copy_sentences, tiny_config  # noqa: E402
from tests.decode.test_ensemble import train  # noqa: E402
from tests.train.test_train_review import three_langs  # noqa: F401,E402  (the tiny en/de/fr fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

LINES = copy_sentences(16, 31)


@pytest.fixture(scope="module")
def checkpoints(one_thread: None, copy_data: Path, three_langs: Path,  # noqa: F811
                tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """Tiny checkpoints of every kind of flow: a Transformer trained until it writes words, phrasal attention,
    feature-fusion shortcuts, an LSTM (no flow) and a multilingual attention bridge on Transformer stacks (1-2 updates each)."""
    from nmtflow.train.multilingual import MultilingualTrainer

    root = tmp_path_factory.mktemp("serve")
    phrasal = {"type": "phrasal", "ngrams": [1, 2]}
    fused = {"type": "shortcut", "feature_fusion": True}
    paths = {
        "transformer": train(copy_data, root / "transformer", 1,
                             schedule={"max_updates": 30, "lr": 1e-2, "warmup_updates": 5}),
        "phrasal": train(copy_data, root / "phrasal", 2, encoder_self_attention=phrasal,
                         decoder_self_attention=phrasal, cross_attention=phrasal),
        "fusion": train(copy_data, root / "fusion", 3, encoder_self_attention=fused, decoder_self_attention=fused),
    }
    raw = to_dict(tiny_config(copy_data, root / "rnn", max_updates=1, valid_bleu=False, validate_every=0,
                              save_every=0, threads=1))
    raw["model"] = {"name": "rnn", "hidden_dim": 16, "encoder_layers": 1, "decoder_layers": 1}
    Trainer(load_config(data=raw)).train()
    paths["rnn"] = str(root / "rnn" / "checkpoint_last.pt")
    save = root / "bridge"
    MultilingualTrainer(load_config(data={
        "model": {"name": "bridge", "encoder": "transformer", "decoder": "transformer", "hidden_dim": 16,
                  "heads": 2, "ffn_dim": 32, "encoder_layers": 1, "decoder_layers": 1, "dropout": 0.0,
                  "bridge_heads": 3, "bridge_dim": 8},
        "data": {"path": str(three_langs), "max_tokens": 600, "multilingual": {"langs": ["en", "de", "fr"]}},
        "train": {"save_dir": str(save), "lr": 5e-3, "warmup_updates": 1, "max_updates": 1, "validate_every": 0,
                  "save_every": 0, "progress": False, "valid_bleu": False, "threads": 1}})).train()
    paths["bridge"] = str(save / "checkpoint_last.pt")
    return paths


@pytest.fixture(scope="module")
def loaded(checkpoints: dict[str, str]) -> dict[str, nmtflow.Model]:
    return {name: nmtflow.load(path, "cpu") for name, path in checkpoints.items()}


@pytest.fixture(scope="module")
def server(loaded: dict[str, nmtflow.Model]) -> Iterator[tuple[str, Any]]:
    """The app on 127.0.0.1 (a free port) in a background thread: (base URL, app)."""
    with running(create_app(loaded, max_sentences=20, max_chars=200)) as started:
        yield started


@contextlib.contextmanager
def running(app: Any) -> Iterator[tuple[str, Any]]:
    """``app`` served on 127.0.0.1 (a free port) in a background thread while the block runs: (base URL, app)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert srv.started
    yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    srv.should_exit = True
    thread.join(10)
    sock.close()


def call(base: str, path: str, body: Any = None, *, raw: bytes | None = None) -> tuple[int, Any]:
    """(status, decoded JSON) of a GET (no body) or POST."""
    data = raw if raw is not None else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_health_and_models(server: tuple[str, Any], checkpoints: dict[str, str]) -> None:
    base, _ = server
    assert call(base, "/api/health") == (200, {"status": "ok", "models": list(checkpoints)})
    status, body = call(base, "/api/models")
    models = {m["name"]: m for m in body["models"]}
    assert status == 200 and list(models) == list(checkpoints)
    assert {k: m["architecture"] for k, m in models.items()} == {
        "transformer": "transformer", "phrasal": "phrasal", "fusion": "shortcuts", "rnn": "rnn", "bridge": "bridge"}
    assert {k: m["flow"] for k, m in models.items()} == {
        "transformer": ["attention"], "phrasal": ["attention"], "fusion": ["attention", "gates"], "rnn": [],
        "bridge": ["attention", "bridge"]}
    assert models["transformer"]["checkpoint"] == "checkpoint_last.pt"
    assert models["transformer"]["multilingual"] is False and models["transformer"]["src_langs"] is None
    assert models["bridge"]["multilingual"] is True and set(models["bridge"]["src_langs"]) == {"en", "de", "fr"}


def test_translate_nbest_and_sampling_equal_the_python_api(server: tuple[str, Any],
                                                           loaded: dict[str, nmtflow.Model]) -> None:
    base, _ = server
    status, body = call(base, "/api/translate", {"model": "transformer", "sentences": LINES[:3], "beam_size": 3,
                                                 "nbest": 2})
    expected = loaded["transformer"].translate(LINES[:3], beam_size=3, nbest=2, return_scores=True)
    assert status == 200 and body["model"] == "transformer"
    assert [t["source"] for t in body["translations"]] == LINES[:3]
    for got, want in zip(body["translations"], expected):
        assert [h["text"] for h in got["hypotheses"]] == [text for text, _ in want]
        assert [h["score"] for h in got["hypotheses"]] == pytest.approx([s for _, s in want], abs=1e-5)
    assert any(h["text"] for t in body["translations"] for h in t["hypotheses"])  # it writes words
    sample = {"model": "transformer", "sentences": LINES[:2], "sampling": True, "nbest": 3, "seed": 7}
    first, again = call(base, "/api/translate", sample)[1], call(base, "/api/translate", sample)[1]
    assert first == again
    drawn = loaded["transformer"].translate(LINES[:2], sampling=True, nbest=3, seed=7)
    assert [[h["text"] for h in t["hypotheses"]] for t in first["translations"]] == drawn
    other = call(base, "/api/translate", {**sample, "seed": 8})[1]
    assert other != first


def test_score_equals_the_python_api(server: tuple[str, Any], loaded: dict[str, nmtflow.Model]) -> None:
    base, _ = server
    targets = [LINES[1], LINES[0]]
    status, body = call(base, "/api/score", {"model": "fusion", "sources": LINES[:2], "targets": targets})
    assert status == 200
    expected = loaded["fusion"].score(LINES[:2], targets)
    tok = loaded["fusion"].translator().tgt_tokenizer
    for got, want, target in zip(body["scores"], expected, targets):
        assert got["score"] == pytest.approx(want, abs=1e-5)
        assert got["tokens"] == len(tok.encode(target)) + 1 == len(got["per_token"])  # the pieces, then EOS
        assert sum(got["per_token"]) == pytest.approx(want, abs=1e-4)


def flow(base: str, body: dict[str, Any]) -> dict[str, Any]:
    status, out = call(base, "/api/flow", body)
    assert status == 200, out
    return out


def test_flow_equals_the_analysis_maps(server: tuple[str, Any], loaded: dict[str, nmtflow.Model]) -> None:
    base, _ = server
    out = flow(base, {"model": "transformer", "sentence": LINES[0]})
    translator = loaded["transformer"].translator()
    assert out["translation"] == translator.translate([LINES[0]])[0][0][0]  # the model's own beam translation
    src_ids = translator.encode_source([LINES[0]])[0]
    tgt_ids = translator.tgt_tokenizer.encode(out["translation"])
    b = collate([src_ids], [tgt_ids])
    assert out["source_tokens"] == translator.src_tokenizer.labels(b.src[0].tolist())
    assert out["target_tokens"][-1] == "</s>" and out["target_input_tokens"][0] == "<s>"
    maps = attention_maps(translator.model, b.src, b.tgt_in)
    assert [(a["slot"], a["layer"]) for a in out["attention"]] == [(m.slot, m.layer + 1) for m in maps]
    for a, m in zip(out["attention"], maps):
        assert a["ngrams"] == [1] and a["heads"] == m.weights.size(1)
        torch.testing.assert_close(torch.tensor(a["weights"]["1"]), m.weights[0].float(), atol=6e-5, rtol=0)
        rows = out["source_tokens"] if a["slot"].startswith("encoder") else out["target_tokens"]
        keys = out["target_input_tokens"] if a["slot"] == "decoder.self_attn" else out["source_tokens"]
        assert a["queries"] == rows and a["keys"] == {"1": keys}
        assert a["phrase_share"] == [0.0] * a["heads"] and a["layer_phrase_share"] == 0.0
    assert out["gates"] == [] and out["bridge"] is None


def test_translate_and_flow_default_to_the_checkpoints_beam(server: tuple[str, Any],
                                                           loaded: dict[str, nmtflow.Model]) -> None:
    """Without ``beam_size`` both endpoints decode with the checkpoint's beam (as the CLI and the API do), and the
    flow's translation is the first hypothesis of ``/api/translate`` at the same beam."""
    base, _ = server
    model = loaded["transformer"]
    beam = model.decode.beam_size
    assert beam != 5  # the fixture's checkpoints decode with another beam than the old fixed default
    assert {m["name"]: m["beam_size"] for m in call(base, "/api/models")[1]["models"]}["transformer"] == beam
    status, body = call(base, "/api/translate", {"model": "transformer", "sentences": LINES[:4], "nbest": beam})
    assert status == 200
    expected = model.translate(LINES[:4], nbest=beam, return_scores=True)
    assert [[h["text"] for h in t["hypotheses"]] for t in body["translations"]] == \
        [[text for text, _ in hyps] for hyps in expected]
    for size, translations in ((None, body["translations"]),
                               (1, call(base, "/api/translate", {"model": "transformer", "sentences": LINES[:4],
                                                                 "beam_size": 1})[1]["translations"])):
        request = {} if size is None else {"beam_size": size}
        for line, t in zip(LINES[:4], translations):
            assert flow(base, {"model": "transformer", "sentence": line, **request})["translation"] == \
                t["hypotheses"][0]["text"]
    assert [t["hypotheses"][0]["text"] for t in translations] == model.translate(LINES[:4], beam_size=1)


def test_flow_of_phrasal_shortcut_and_bridge_models(server: tuple[str, Any]) -> None:
    base, _ = server
    target = "alpha bravo charlie"
    out = flow(base, {"model": "phrasal", "sentence": LINES[2], "target": target})
    assert out["translation"] == target
    for a in out["attention"]:
        assert a["ngrams"] == [1, 2] and list(a["weights"]) == list(a["keys"]) == ["1", "2"]
        one, two = torch.tensor(a["weights"]["1"]), torch.tensor(a["weights"]["2"])  # (H,T,S), (H,T,S-1)
        assert one.size(-1) == len(a["keys"]["1"]) == two.size(-1) + 1 == len(a["keys"]["2"]) + 1
        assert a["keys"]["2"][0] == f"{a['keys']['1'][0]} {a['keys']['1'][1]}"
        totals = one.sum(-1) + two.sum(-1)  # every query's mass over all n
        torch.testing.assert_close(totals, torch.ones_like(totals), atol=2e-3, rtol=0)
        share = (two.sum((-1, -2)) / totals.sum(-1)).tolist()
        assert a["phrase_share"] == pytest.approx(share, abs=2e-3)
    out = flow(base, {"model": "fusion", "sentence": LINES[3]})
    assert {(g["slot"], g["layer"], g["kind"]) for g in out["gates"]} == {
        (slot, layer, kind) for slot in ("encoder.self_attn", "decoder.self_attn") for layer in (1, 2)
        for kind in ("r_k", "r_v")}
    for g in out["gates"]:
        keys = out["target_input_tokens"] if g["slot"] == "decoder.self_attn" else out["source_tokens"]
        assert g["keys"] == keys and len(g["values"]) == len(keys)
        assert all(0 <= v <= 1 for v in g["values"]) and g["mean"] == pytest.approx(
            sum(g["values"]) / len(keys), abs=1e-3)
    out = flow(base, {"model": "bridge", "sentence": "the house", "src_lang": "en", "tgt_lang": "de"})
    bridge = out["bridge"]
    assert bridge["heads"] == 3 == len(bridge["weights"]) and bridge["keys"] == out["source_tokens"]
    assert [sum(row) for row in bridge["weights"]] == pytest.approx([1.0] * 3, abs=1e-3)
    cross = [a for a in out["attention"] if a["slot"] == "decoder.cross_attn"]
    assert cross and cross[0]["keys"]["1"] == ["M1", "M2", "M3"]
    out = flow(base, {"model": "rnn", "sentence": LINES[4], "target": "alpha"})  # an LSTM: tokens, no flow
    assert (out["attention"], out["gates"], out["bridge"]) == ([], [], None)
    assert out["translation"] == "alpha" and out["target_tokens"][-1] == "</s>"
    assert len(out["target_tokens"]) == len(out["target_input_tokens"]) and out["source_tokens"][-1] == "</s>"


def test_sources_longer_than_the_model_reads_are_refused_by_every_endpoint(loaded: dict[str, nmtflow.Model]) -> None:
    """Before: /api/translate answered 413, but /api/score and /api/flow answered (200) about the source cut short at
    the model's limit, with no sign of it."""
    limit = loaded["transformer"].translator().max_source_tokens
    long = " ".join(["a"] * (limit + 1))
    assert len(loaded["transformer"].translator().src_tokenizer.encode(long)) > limit
    with running(create_app(loaded, max_sentences=20, max_chars=len(long))) as (base, _):
        for path, body, name in (("/api/translate", {"sentences": ["a", long]}, "sentences[1]"),
                                 ("/api/score", {"sources": ["a", long], "targets": ["a", "b"]}, "sources[1]"),
                                 ("/api/flow", {"sentence": long}, "sentence")):
            got, out = call(base, path, {"model": "transformer", **body})
            assert (got, out) == (413, {"error": out["error"]}) and out["error"].startswith(f"{name} has "), out
            assert out["error"].endswith(f"sub-words; model reads at most {limit}")


@pytest.mark.parametrize("path, body, status, message", [
    ("/api/translate", {"model": "transformer", "sentences": []}, 422, "sentences"),
    ("/api/translate", {"model": "transformer", "sentences": ["  "]}, 422, "sentences[0] is empty"),
    ("/api/translate", {"model": "transformer", "sentences": ["a" * 201]}, 413, "at most 200"),
    ("/api/translate", {"model": "transformer", "sentences": ["a"] * 21}, 413, "at most 20"),
    ("/api/translate", {"model": "transformer", "sentences": [3]}, 422, "sentences[0]"),
    ("/api/translate", {"model": "transformer", "sentences": ["a"], "beam_size": "5"}, 422, "beam_size"),
    ("/api/translate", {"model": "transformer", "sentences": ["a"], "nbest": 6}, 422, "nbest"),
    ("/api/translate", {"model": "transformer", "sentences": ["a"], "beam": 6}, 422, "beam: unknown field"),
    ("/api/translate", {"model": "transformer", "sentences": ["a"], "len_penalty": 1000}, 422,
     "len_penalty: must be between -20 and 20"),  # before: 500, OverflowError
    ("/api/translate", {"sentences": ["a"]}, 422, "model: name one of"),
    ("/api/translate", {"model": "nope", "sentences": ["a"]}, 404, "unknown model 'nope'"),
    ("/api/translate", {"model": "bridge", "sentences": ["a"], "src_lang": "en", "tgt_lang": "xx"}, 422,
     "tgt_lang: unknown language 'xx'"),
    ("/api/translate", {"model": "bridge", "sentences": ["a"]}, 422, "src_lang"),
    ("/api/translate", {"model": "transformer", "sentences": ["a"], "src_lang": "de"}, 422, "src_lang"),
    ("/api/score", {"model": "transformer", "sources": ["a"], "targets": ["a", "b"]}, 422, "targets"),
    ("/api/flow", {"model": "transformer"}, 422, "sentence: Field required"),
    ("/api/flow", {"model": "transformer", "sentence": "a", "target": " "}, 422, "target is empty"),
    # a lone surrogate (JSON's "\ud800" escape): no UTF-8 text, named, not an internal error
    ("/api/translate", {"model": "transformer", "sentences": ["a", "b\ud800"]}, 422,
     "sentences[1] is not valid Unicode text: a lone surrogate U+D800 at character 1"),
    ("/api/score", {"model": "transformer", "sources": ["a"], "targets": ["\udfff"]}, 422,
     "targets[0] is not valid Unicode text"),
    ("/api/flow", {"model": "transformer", "sentence": "a", "target": "\ud800"}, 422,
     "target is not valid Unicode text"),
    ("/api/translate", [1, 2], 422, "body"),
])
def test_bad_requests_are_4xx_with_one_clear_message(server: tuple[str, Any], path: str, body: Any, status: int,
                                                     message: str) -> None:
    got, out = call(server[0], path, body)
    assert got == status and list(out) == ["error"] and message in out["error"], out


def test_malformed_json_and_unknown_paths(server: tuple[str, Any]) -> None:
    base, _ = server
    assert call(base, "/api/translate", raw=b'{"sentences": [')[0] == 400
    status, out = call(base, "/api/translate", raw=b'{"sentences": [')
    assert "malformed JSON" in out["error"]
    assert call(base, "/api/nothing")[0] == 404
    status, out = call(base, "/api/translate", raw=b'{"sentences": ["' + b"a" * 200_000 + b'"]}')
    assert status == 413 and "request body over" in out["error"]  # refused before parsing
    with urllib.request.urlopen(base + "/static/vendor/plotly.min.js", timeout=30) as response:
        assert b"plotly" in response.read(4096).lower()
    with urllib.request.urlopen(base + "/", timeout=30) as response:
        assert b"<" in response.read()


def test_concurrent_clients_get_their_own_translations(server: tuple[str, Any]) -> None:
    base, _ = server
    requests = [{"model": "transformer", "sentences": [LINES[i], LINES[(i + 5) % 16]], "beam_size": 2}
                for i in range(16)]
    sequential = [call(base, "/api/translate", r)[1] for r in requests]
    with ThreadPoolExecutor(16) as pool:
        parallel = list(pool.map(lambda r: call(base, "/api/translate", r)[1], requests))
    for got, want, r in zip(parallel, sequential, requests):
        assert [t["source"] for t in got["translations"]] == r["sentences"]
        assert [h["text"] for t in got["translations"] for h in t["hypotheses"]] == \
            [h["text"] for t in want["translations"] for h in t["hypotheses"]]


def test_the_worker_merges_waiting_requests_into_one_call(server: tuple[str, Any]) -> None:
    base, app = server
    requests = [{"model": "transformer", "sentences": [LINES[i]], "beam_size": 2} for i in range(6)]
    alone = call(base, "/api/translate", requests[0])[1]
    worker, started, gate = app.state.worker, threading.Event(), threading.Event()

    def busy(items: list[None]) -> list[bool]:
        started.set()
        return [gate.wait(30)]

    blocker = worker.submit(busy, [None])  # the worker is busy until the gate opens
    assert started.wait(30)
    calls = worker.calls
    with ThreadPoolExecutor(6) as pool:
        futures = [pool.submit(call, base, "/api/translate", r) for r in requests]
        deadline = time.monotonic() + 20
        while worker.queue.qsize() < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        gate.set()
        results = [f.result()[1] for f in futures]
    assert blocker.result() == [True]
    assert worker.calls - calls == 1  # the six requests as one call
    merged, single = results[0]["translations"][0]["hypotheses"][0], alone["translations"][0]["hypotheses"][0]
    assert merged["text"] == single["text"] and merged["score"] == pytest.approx(single["score"], abs=1e-4)
    assert [r["translations"][0]["source"] for r in results] == [r["sentences"][0] for r in requests]


def test_model_names_and_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert model_names(["a/base/checkpoint_best.pt", "b/base/checkpoint_last.pt", "x/avg.pt"]) == \
        ["base", "base-2", "avg"]
    assert main(["serve", str(tmp_path / "missing.pt"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("nmtflow serve: error:") and "missing.pt" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("model", [
    {"name": "convs2s", "embed_dim": 16, "hidden": 16, "encoder_layers": 1, "decoder_layers": 1},
    {"name": "densenmt", "embed_dim": 16, "hidden": 16, "growth": 8, "encoder_layers": 2, "decoder_layers": 2,
     "attention": "dense2"},
], ids=["convs2s", "densenmt"])
def test_flow_of_models_without_attention_modules(copy_data: Path, tmp_path: Path, model: dict[str, Any]) -> None:
    """Convolutional models have no nmtflow.nn.attention modules: their flow is the tokens and nothing else."""
    from nmtflow.serve.flow import flow_kinds, sentence_flow

    raw = to_dict(tiny_config(copy_data, tmp_path, max_updates=1, valid_bleu=False, validate_every=0, save_every=0,
                              threads=1))
    raw["model"] = model
    Trainer(load_config(data=raw)).train()
    translator = nmtflow.load(str(tmp_path / "checkpoint_last.pt"), "cpu").translator()
    out = sentence_flow(translator, LINES[0], "alpha bravo")
    assert flow_kinds(translator.model) == [] and out["architecture"] == model["name"]
    assert (out["attention"], out["gates"], out["bridge"]) == ([], [], None)
    assert out["target_tokens"][-1] == "</s>" and len(out["target_tokens"]) == len(out["target_input_tokens"])


def test_serve_precision_reaches_the_models(checkpoints: dict[str, str]) -> None:
    from nmtflow.serve.app import load_models

    paths = [checkpoints["transformer"], checkpoints["rnn"]]
    assert {m.decode.precision for m in load_models(paths, device="cpu").values()} == {"fp32"}
    assert {m.decode.precision for m in load_models(paths, device="cpu", precision="bf16").values()} == {"bf16"}
    assert load_models(paths, device="cpu", ensemble=True, precision="bf16")["ensemble"].decode.precision == "bf16"
