"""The explorer page at ``/`` in a real headless Chromium (Debian's ``chromium``, driven by Playwright): what it
shows (translations, token chips, heat maps, shading on hover, gates, the bridge, errors) is checked against the
JSON the API answers for the same request. Skipped when no Chromium binary is found (``NMTFLOW_CHROMIUM`` names
one elsewhere)."""
from __future__ import annotations

import dataclasses
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

pytest.importorskip("fastapi", reason="the serve extra is not installed (pip install 'nmtflow[serve]')")
pytest.importorskip("plotly", reason="the serve extra is not installed (pip install 'nmtflow[serve]')")
pytest.importorskip("uvicorn", reason="the serve extra is not installed (pip install 'nmtflow[serve]')")
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install 'nmtflow[test]')")

from nmtflow.serve.background import BackgroundServer, chromium_binary  # noqa: E402
from tests.decode.test_ensemble import train  # noqa: E402
from tests.train.test_train_review import bridge_run, three_langs  # noqa: E402,F401  (en/de/fr fixture)

pytestmark = pytest.mark.usefixtures("one_thread")

SENTENCE = "alpha bravo charlie delta"
PHRASAL = {"type": "phrasal", "ngrams": [1, 2]}
SHORTCUT = {"type": "shortcut"}


if chromium_binary() is None:
    pytest.skip("no Chromium binary (apt-get install chromium, or set NMTFLOW_CHROMIUM)", allow_module_level=True)


# ---- a served app on 127.0.0.1 -----------------------------------------------------------------------------------
class Server(BackgroundServer):
    """The app in a background thread, with a JSON client to ask the API what the page should show."""

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        req = urllib.request.Request(self.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.load(e)


@pytest.fixture(scope="module")
def server(one_thread: None, copy_data: Path, three_langs: Path,  # noqa: F811
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """Four tiny models: a Transformer trained until it writes words, phrasal attention {1, 2} in every slot,
    lexical shortcuts in both self-attention slots, and an en/de/fr attention bridge on Transformer stacks."""
    import nmtflow
    from nmtflow.serve.app import create_app
    from nmtflow.train.multilingual import MultilingualTrainer

    root = tmp_path_factory.mktemp("page")
    paths = {
        "transformer": train(copy_data, root / "transformer", 1, schedule={"max_updates": 30, "lr": 1e-2,
                                                                           "warmup_updates": 5}),
        "phrasal": train(copy_data, root / "phrasal", 2, encoder_self_attention=PHRASAL,
                         decoder_self_attention=PHRASAL, cross_attention=PHRASAL),
        "shortcuts": train(copy_data, root / "shortcuts", 3, encoder_self_attention=SHORTCUT,
                           decoder_self_attention=SHORTCUT),
    }
    cfg = bridge_run(three_langs, root / "bridge", 1, langs=["en", "de", "fr"])  # on Transformer stacks
    cfg.model = dataclasses.replace(cfg.model, encoder="transformer", decoder="transformer", heads=2, ffn_dim=32)
    MultilingualTrainer(cfg).train()
    paths["bridge"] = str(root / "bridge" / "checkpoint_last.pt")
    app = create_app({name: nmtflow.load(p, device="cpu") for name, p in paths.items()}, max_chars=200)
    s = Server(app)
    yield s
    s.close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium_binary(), args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


@pytest.fixture
def page(browser: Any, server: Server) -> Iterator[Any]:
    pg = browser.new_page(viewport={"width": 1280, "height": 900})
    errors: list[str] = []
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(server.url + "/")
    pg.wait_for_selector(".model-row")
    yield pg
    pg.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def translate(pg: Any, models: dict[str, tuple[str, str] | None], sentence: str = SENTENCE,
              target: str = "") -> None:
    """Fill the form, pick ``models`` (name → (src_lang, tgt_lang) for a multilingual one), press Translate and
    wait until every panel has its answers."""
    pg.fill("#sentence", sentence)
    pg.fill("#target", target)
    for row in pg.query_selector_all(".model-row"):
        name = row.get_attribute("data-model")
        box = row.query_selector("input[name=model]")
        box.check() if name in models else box.uncheck()
        if models.get(name):
            row.query_selector("select[name=src_lang]").select_option(models[name][0])
            row.query_selector("select[name=tgt_lang]").select_option(models[name][1])
    pg.click("#translate")
    pg.wait_for_function(f"document.querySelectorAll('.panel[data-state]').length === {len(models)}",
                         timeout=20000)


def mean_over_heads(heads: list[list[list[float]]]) -> list[list[float]]:
    n = len(heads)
    return [[sum(h[t][s] for h in heads) / n for s in range(len(heads[0][t]))] for t in range(len(heads[0]))]


def chip_weights(panel: Any, side: str) -> list[float]:
    return [float(c.get_attribute("data-weight")) for c in panel.query_selector_all(f".chip-row.{side} .chip")]


def grid(panel: Any, slot: str) -> list[dict[str, Any]]:
    """The traces of a slot's layers × heads grid, as Plotly holds them."""
    return panel.eval_on_selector(f"section.slot[data-slot='{slot}'] .grid-plot",
                                  "g => g.data.map(t => ({z: t.z, meta: t.meta}))")


# ---- the tests --------------------------------------------------------------------------------------------------
def test_the_page_lists_the_served_models_with_languages_for_a_multilingual_one(page: Any, server: Server) -> None:
    with urllib.request.urlopen(server.url + "/api/models") as r:
        served = json.load(r)["models"]
    rows = page.query_selector_all(".model-row")
    assert [r.get_attribute("data-model") for r in rows] == [m["name"] for m in served]
    for row, m in zip(rows, served):
        assert m["architecture"] in row.inner_text()
        langs = row.query_selector_all("select")
        if m["multilingual"]:
            assert [[o.get_attribute("value") for o in s.query_selector_all("option")] for s in langs] == \
                [m["src_langs"], m["tgt_langs"]]
        else:
            assert not langs


def test_translations_heat_maps_and_hover_shading_equal_the_api(page: Any, server: Server) -> None:
    translate(page, {"transformer": None, "phrasal": None, "shortcuts": None})
    for name in ("transformer", "phrasal", "shortcuts"):
        panel = page.query_selector(f".panel[data-model='{name}']")
        assert panel.get_attribute("data-state") == "done", panel.inner_text()
        status, tr = server.post("/api/translate", {"model": name, "sentences": [SENTENCE], "nbest": 1})
        assert status == 200
        assert [h.inner_text() for h in panel.query_selector_all(".nbest .hyp")] == \
            [h["text"] for h in tr["translations"][0]["hypotheses"]]
        status, flow = server.post("/api/flow", {"model": name, "sentence": SENTENCE})
        assert status == 200
        assert panel.query_selector(".flow-for q").inner_text() == flow["translation"]
        assert [c.inner_text() for c in panel.query_selector_all(".chip-row.source .chip")] == flow["source_tokens"]
        assert [c.inner_text() for c in panel.query_selector_all(".chip-row.target .chip")] == flow["target_tokens"]

        # one heat map per layer and head of every slot, each the API's weights (phrasal: token half, a gap, phrases)
        slots = {e["slot"] for e in flow["attention"]}
        assert {s.get_attribute("data-slot") for s in panel.query_selector_all("section.slot")} == slots
        for slot in slots:
            entries = sorted((e for e in flow["attention"] if e["slot"] == slot), key=lambda e: e["layer"])
            traces = grid(panel, slot)
            assert len(traces) == sum(e["heads"] for e in entries) == len(entries) * entries[0]["heads"]
            for e in entries:
                for h in range(e["heads"]):
                    z = traces[(e["layer"] - 1) * e["heads"] + h]["z"]
                    tokens = e["weights"]["1"][h]
                    phrases = e["weights"]["2"][h] if "2" in e["weights"] else [[] for _ in tokens]
                    assert z == [t + ([None] + p if p else []) for t, p in zip(tokens, phrases)]
            if name == "phrasal":
                last = entries[-1]
                assert panel.eval_on_selector(f"section.slot[data-slot='{slot}'] .share", "n => n.textContent") \
                    == f"phrase share {share_text(last['layer_phrase_share'])}"

        # hovering a target token shades the source by the mean over heads of the picked cross-attention layer
        cross = sorted((e for e in flow["attention"] if e["slot"] == "decoder.cross_attn"), key=lambda e: e["layer"])
        section = panel.query_selector("section.slot[data-slot='decoder.cross_attn']")
        chips = panel.query_selector_all(".chip-row.target .chip")
        for layer in (len(cross), 1):
            section.query_selector(".pick-layer").select_option(str(layer - 1))
            t = len(chips) // 2
            chips[t].hover()
            expected = mean_over_heads(cross[layer - 1]["weights"]["1"])[t]
            assert chip_weights(panel, "source") == pytest.approx(expected, abs=1e-4)
            rows = section.eval_on_selector(".focus-plot", "g => g.layout.shapes.filter(s => s.type === 'rect')"
                                                          ".map(s => s.y0 + 0.5)")
            assert rows and set(rows) == {t}  # its row is outlined in the cross-attention map
            page.mouse.move(0, 0)
        assert panel.query_selector(".chip-row.source .chip[data-weight]") is None  # leaving clears the shading

        if name == "shortcuts":  # the gates: one row per layer and kind, the API's mean gate per key position
            for slot in {g["slot"] for g in flow["gates"]}:
                gates = sorted((g for g in flow["gates"] if g["slot"] == slot), key=lambda g: (g["layer"], g["kind"]))
                z = panel.eval_on_selector(f"section[data-slot='gates:{slot}'] .plot", "g => g.data[0].z")
                assert z == [g["values"] for g in gates] and len(z) == 2 * len({g["layer"] for g in gates})
        else:
            assert not flow["gates"] and panel.query_selector("section[data-slot^='gates:']") is None


def share_text(x: float) -> str:
    """The page's percentage (``pct`` in app.js)."""
    return f"{100 * x:.1f}%" if x < 0.1 else f"{100 * x:.0f}%"


def test_the_bridge_heat_map_and_shading_through_it(page: Any, server: Server) -> None:
    translate(page, {"bridge": ("en", "de")}, sentence="the cat sleeps")
    panel = page.query_selector(".panel[data-model='bridge']")
    assert panel.get_attribute("data-state") == "done", panel.inner_text()
    assert "en → de" in panel.query_selector(".panel-head").inner_text()
    status, flow = server.post("/api/flow", {"model": "bridge", "sentence": "the cat sleeps", "src_lang": "en",
                                             "tgt_lang": "de"})
    assert status == 200 and flow["bridge"] is not None
    z = panel.eval_on_selector("section[data-slot='bridge'] .plot", "g => g.data[0].z")
    assert z == flow["bridge"]["weights"] and len(z) == flow["bridge"]["heads"]
    assert flow["bridge"]["keys"] == flow["source_tokens"]
    cross = [e for e in flow["attention"] if e["slot"] == "decoder.cross_attn"]  # target → M1..Mk
    assert cross and cross[-1]["keys"]["1"] == [f"M{k + 1}" for k in range(flow["bridge"]["heads"])]
    panel.query_selector(".chip-row.target .chip").hover()  # shaded through A: target → M → source
    a = flow["bridge"]["weights"]
    to_m = mean_over_heads(cross[-1]["weights"]["1"])[0]
    expected = [sum(w * a[k][s] for k, w in enumerate(to_m)) for s in range(len(a[0]))]
    assert chip_weights(panel, "source") == pytest.approx(expected, abs=1e-4)


def test_errors_from_the_api_and_the_form_are_shown(page: Any, server: Server) -> None:
    page.click("#translate")  # no sentence typed
    assert page.inner_text("#form-error") == "Type a source sentence to translate."
    long = " ".join(["alpha"] * 60)  # over max_chars = 200
    translate(page, {"transformer": None}, sentence=long)
    panel = page.query_selector(".panel[data-model='transformer']")
    assert panel.get_attribute("data-state") == "error"
    status, answer = server.post("/api/flow", {"model": "transformer", "sentence": long})
    assert status == 413
    assert answer["error"] in panel.query_selector(".error").inner_text()
