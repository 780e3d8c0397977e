"""Screenshots of the explorer page of ``nmtflow serve`` for the docs: ``docs/images/serve-ARCH.png``.

    pip install -e ".[serve,test]"          # FastAPI, uvicorn, Plotly; Playwright (it drives the system's Chromium)
    python docs/screenshots.py --workdir runs/screenshots

Generates the built-in corpus, trains four small models briefly on it (en→de; the bridge en/de/fr on Transformer
stacks) so that their maps are not uniform, serves them on 127.0.0.1 and saves one screenshot per architecture
(transformer, phrasal, shortcuts, bridge) of the page in headless Chromium, a target token hovered. Finished
steps are reused when run again. A few minutes on 2 idle CPU cores.
"""
from __future__ import annotations

import argparse
import copy
import logging
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SENTENCE = "Do the girls read seven maps in front of the station?"
PHRASAL = {"type": "phrasal", "ngrams": [1, 2]}
SHORTCUT = {"type": "shortcut"}
TRAIN = {"lr": 3e-3, "warmup_updates": 40, "validate_every": 0, "save_every": 0, "log_every": 25,
         "progress": False, "valid_bleu": False}
SMALL = {"d_model": 64, "ffn_dim": 128, "heads": 4, "encoder_layers": 2, "decoder_layers": 2, "dropout": 0.1}
MODELS: dict[str, dict[str, Any]] = {
    "transformer": {"name": "transformer", **SMALL},
    "phrasal": {"name": "transformer", **SMALL, "encoder_self_attention": PHRASAL, "cross_attention": PHRASAL},
    "shortcuts": {"name": "transformer", **SMALL, "encoder_self_attention": SHORTCUT,
                  "decoder_self_attention": SHORTCUT},
    "bridge": {"name": "bridge", "encoder": "transformer", "decoder": "transformer", "hidden_dim": 64,
               "ffn_dim": 128, "heads": 4, "encoder_layers": 2, "decoder_layers": 2, "bridge_heads": 6,
               "bridge_dim": 64, "dropout": 0.1},
}
# training updates (the bridge, six directions at a fraction of the speed, fewer)
UPDATES = {"transformer": 600, "phrasal": 600, "shortcuts": 600, "bridge": 150}
# what each screenshot keeps of its panel (the other sections are hidden): data-slot values of app.js's sections
SHOWN = {"transformer": ["decoder.cross_attn"], "phrasal": ["decoder.cross_attn"],
         "shortcuts": ["gates:encoder.self_attn", "gates:decoder.self_attn"],
         "bridge": ["bridge", "decoder.cross_attn"]}


def train(name: str, data: Path, out: Path, updates: int) -> Path:
    """Train ``MODELS[name]`` for ``updates`` updates (skipped when its checkpoint exists)."""
    from nmtflow.config import load_config

    ckpt = out / name / "checkpoint_last.pt"
    if ckpt.is_file():
        return ckpt
    model = copy.deepcopy(MODELS[name])
    bridge = model["name"] == "bridge"
    data_cfg: dict[str, Any] = {"path": str(data), "max_tokens": 1000}
    data_cfg.update({"multilingual": {"langs": ["en", "de", "fr"]}} if bridge else {"src_lang": "en", "tgt_lang": "de"})
    cfg = load_config(data={"model": model, "data": data_cfg,
                            "train": {**TRAIN, "save_dir": str(out / name), "max_updates": updates}})
    if bridge:
        from nmtflow.train.multilingual import MultilingualTrainer as Trainer
    else:
        from nmtflow.train.trainer import Trainer
    print(f"training {name} for {updates} updates", file=sys.stderr)
    Trainer(cfg).train()
    return ckpt


def screenshot(browser: Any, url: str, name: str, path: Path) -> None:
    page = browser.new_page(viewport={"width": 1200, "height": 900}, device_scale_factor=1)
    page.goto(url)
    page.wait_for_selector(".model-row")
    for row in page.query_selector_all(".model-row"):
        row.query_selector("input[name=model]").set_checked(row.get_attribute("data-model") == name)
        if row.get_attribute("data-model") == name and row.query_selector("select"):
            row.query_selector("select[name=src_lang]").select_option("en")
            row.query_selector("select[name=tgt_lang]").select_option("de")
    page.fill("#sentence", SENTENCE)
    page.click("#translate")
    page.wait_for_selector(f".panel[data-model='{name}'][data-state]", timeout=120_000)
    page.evaluate("""keep => document.querySelectorAll('.panel .plot-section').forEach(s => {
        if (!keep.includes(s.dataset.slot)) s.style.display = 'none'; })""", SHOWN[name])
    chips = page.query_selector_all(".chip-row.target .chip")
    chips[min(2, len(chips) - 1)].hover()
    page.wait_for_timeout(300)
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path), full_page=True)
    page.close()
    print(f"wrote {path}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("runs/screenshots"))
    parser.add_argument("--updates", type=int, help="training updates of every model (default: UPDATES)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images")
    parser.add_argument("--only", nargs="+", choices=list(MODELS), default=list(MODELS))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")

    import nmtflow
    from playwright.sync_api import sync_playwright

    from nmtflow.data.corpus import CleanConfig
    from nmtflow.data.prepare import prepare
    from nmtflow.data.synthetic import generate_corpus
    from nmtflow.serve.app import create_app
    from nmtflow.serve.background import BackgroundServer, chromium_binary

    chromium = chromium_binary()
    if chromium is None:
        raise SystemExit("no Chromium binary: apt-get install chromium (or set NMTFLOW_CHROMIUM)")
    corpus, data = args.workdir / "corpus", args.workdir / "data"
    if not (corpus / "train.fr").is_file():
        generate_corpus(corpus, n_train=20000, n_valid=50, n_test=50)
    if not (data / "meta.json").is_file():
        prepare({"train": str(corpus / "train"), "valid": str(corpus / "valid")}, ["en", "de", "fr"], data,
                vocab_size=2000, joint=True, clean=CleanConfig())
    checkpoints = {name: train(name, data, args.workdir, args.updates or UPDATES[name]) for name in args.only}
    app = create_app({name: nmtflow.load(str(p), device="cpu") for name, p in checkpoints.items()})
    with BackgroundServer(app) as server, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        for name in checkpoints:
            screenshot(browser, server.url + "/", name, args.out / f"serve-{name}.png")
        browser.close()


if __name__ == "__main__":
    main()
