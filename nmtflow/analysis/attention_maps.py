"""Attention heat maps with token-to-token and token-to-phrase halves, and the share of attention on phrases.

SPEC §3, the paper's Figures 2-3 and §4.4. Works for any model built from attention modules of
:mod:`nmtflow.nn.attention` (Transformer, language model): while :func:`recording` is active, every module
is called with ``ctx.need_weights`` and its weights are kept. Phrasal weights (B,H,T,ΣS_n) are split with
:func:`~nmtflow.nn.phrasal.split_phrasal_weights`; standard attention counts as ``ngrams = [1]``.

* **Heat maps** (one sentence pair): one PNG per attention slot, layer and head, ``SLOT.layerL.headH.png``
  (1-based), the token-to-token half (n = 1) left and the token-to-phrase half (n ≥ 2, grouped by n)
  right, on one colour scale. Rows of the encoder are source tokens; rows of the decoder are the tokens
  the position predicts (``tgt_out``: the sub-words, then EOS); decoder self-attention keys are its input
  tokens (``tgt_in``: BOS, then the sub-words).
* **Phrase share** (a prepared split, teacher-forced): per slot and layer, the attention mass on n-grams
  with n ≥ 2 divided by all attention mass, summed over every non-padding query position and head; also per
  n and per head. Written as ``phrase_share.json`` with a plot ``phrase_share.png``.
"""
from __future__ import annotations

import dataclasses
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from torch import Tensor, nn

from nmtflow.analysis.report import write_json
from nmtflow.analysis.states import check_limits
from nmtflow.data.batching import TokenBatchSampler, collate
from nmtflow.data.bitext import Bitext
from nmtflow.data.tokenizer import Tokenizer
from nmtflow.data.vocab import PAD
from nmtflow.decode.multilingual import open_translator
from nmtflow.evaluate.perplexity import check_positions, open_checkpoint_data
from nmtflow.models.base import EncoderDecoder, device_of, position_limits
from nmtflow.nn.attention import AttentionContext, MultiHeadAttention
from nmtflow.nn.phrasal import PhrasalAttention, split_phrasal_weights

SLOT_TITLES = {"encoder.self_attn": "encoder self-attention", "decoder.self_attn": "decoder self-attention",
               "decoder.cross_attn": "decoder-to-encoder attention"}


@dataclass
class AttentionMap:
    """The weights one attention module returned: (B,H,T,ΣS_n), in ``ngrams`` order over a key length S."""

    slot: str  # module name without its layer index, e.g. "decoder.cross_attn"
    layer: int  # 0-based
    weights: Tensor
    ngrams: list[int]
    key_length: int

    def split(self) -> dict[int, Tensor]:
        """{n: (B,H,T,S_n)}."""
        return split_phrasal_weights(self.weights, self.ngrams, self.key_length)


def slot_and_layer(name: str) -> tuple[str, int]:
    """``decoder.3.cross_attn`` → (``decoder.cross_attn``, 3); a name without an index is layer 0."""
    match = re.fullmatch(r"(.*?)\.(\d+)\.(.*)", name)
    return (f"{match[1]}.{match[3]}", int(match[2])) if match else (name, 0)


def module_ngrams(module: nn.Module) -> list[int]:
    return list(module.ngrams) if isinstance(module, PhrasalAttention) else [1]


@contextmanager
def recording(model: nn.Module) -> Iterator[list[AttentionMap]]:
    """Inside the block every attention module of ``model`` computes its weights; they are appended to the list."""
    maps: list[AttentionMap] = []

    def ask_for_weights(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        ctx = kwargs.get("ctx")
        kwargs["ctx"] = AttentionContext(need_weights=True) if ctx is None else \
            dataclasses.replace(ctx, need_weights=True)
        return args, kwargs

    def keep(module: MultiHeadAttention, args: tuple, kwargs: dict, output: tuple[Tensor, Tensor | None]) -> None:
        source = args[1] if len(args) > 1 else kwargs["source"]
        if output[1] is not None:
            slot, layer = slot_and_layer(module.name)
            maps.append(AttentionMap(slot, layer, output[1].detach(), module_ngrams(module), source.size(1)))

    handles = []
    for mod in model.modules():
        if isinstance(mod, MultiHeadAttention):
            handles.append(mod.register_forward_pre_hook(ask_for_weights, with_kwargs=True))
            handles.append(mod.register_forward_hook(keep, with_kwargs=True))
    try:
        yield maps
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def attention_maps(model: EncoderDecoder, src: Tensor, tgt_in: Tensor) -> list[AttentionMap]:
    """Teacher-forced forward pass of src (B,S), tgt_in (B,T) → the weights of every attention module."""
    model.eval()
    with recording(model) as maps:
        model(src, tgt_in)
    return maps


# ---- heat maps -----------------------------------------------------------------------------------------
def phrase_labels(tokens: list[str], n: int) -> list[str]:
    """The n-grams of ``tokens`` as text, one per phrase start."""
    return [" ".join(tokens[j:j + n]) for j in range(len(tokens) - n + 1)]


def plot_heat_map(weights: Tensor, ngrams: list[int], rows: list[str], keys: list[str], title: str,
                  path: Path) -> None:
    """weights (T,ΣS_n) of one head → a PNG: token-to-token half | token-to-phrase half, one colour scale."""
    parts = split_phrasal_weights(weights, ngrams, len(keys))
    halves = []
    if 1 in parts:
        halves.append(("token-to-token", parts[1], keys, []))
    phrase_ns = [n for n in ngrams if n > 1 and parts[n].size(-1)]
    if phrase_ns:
        cols = torch.cat([parts[n] for n in phrase_ns], dim=-1)
        labels = [p for n in phrase_ns for p in phrase_labels(keys, n)]
        bounds = torch.tensor([parts[n].size(-1) for n in phrase_ns]).cumsum(0)[:-1].tolist()
        halves.append((f"token-to-phrase ({', '.join(f'{n}-grams' for n in phrase_ns)})", cols, labels, bounds))
    vmax = max(float(weights.max()), 1e-9)
    widths = [max(h[1].size(-1), 1) for h in halves]
    fig = Figure(figsize=(2.5 + 0.28 * sum(widths), 2.0 + 0.28 * len(rows)), layout="constrained")
    axes = fig.subplots(1, len(halves), squeeze=False, gridspec_kw={"width_ratios": widths})[0]
    image = None
    for ax, (name, w, labels, bounds) in zip(axes, halves):
        image = ax.imshow(w.float().numpy(), aspect="auto", cmap="viridis", vmin=0.0, vmax=vmax)
        ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=7)
        ax.set_yticks(range(len(rows)), rows, fontsize=7)
        for b in bounds:
            ax.axvline(b - 0.5, color="white", linewidth=1.0)
        ax.set_title(name, fontsize=9)
    if image is not None:
        fig.colorbar(image, ax=list(axes), shrink=0.8)
    fig.suptitle(title, fontsize=10)
    path.parent.mkdir(parents=True, exist_ok=True)
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=100)


def draw_heat_maps(model: EncoderDecoder, src_ids: list[int], tgt_ids: list[int], src_tok: Tokenizer,
                   tgt_tok: Tokenizer, out_dir: str | Path, *, src_prefix: int | None = None) -> list[Path]:
    """Heat maps of every slot, layer and head for one sentence pair (ids without BOS/EOS; ``src_prefix``: a
    language-label model's ``<2xx>`` tag before the source)."""
    b = collate([src_ids], [tgt_ids], src_prefix=src_prefix).to(device_of(model))
    src = src_tok.labels(b.src[0].tolist())  # byte pieces shown as the characters they spell
    tgt_in = tgt_tok.labels(b.tgt_in[0].tolist())
    tgt_out = tgt_tok.labels(b.tgt_out[0].tolist())
    files = []
    for m in attention_maps(model, b.src, b.tgt_in):
        rows = src if m.slot.startswith("encoder.") else tgt_out
        keys = tgt_in if m.slot == "decoder.self_attn" else src
        if m.slot == "decoder.cross_attn" and m.key_length != len(src):  # an attention bridge: its k rows of M
            keys = [f"M{i + 1}" for i in range(m.key_length)]
        share = phrase_mass(m, torch.ones(1, m.weights.size(2), dtype=torch.bool, device=m.weights.device))
        for h in range(m.weights.size(1)):
            path = Path(out_dir) / f"{m.slot}.layer{m.layer + 1}.head{h + 1}.png"
            title = (f"{SLOT_TITLES.get(m.slot, m.slot)}, layer {m.layer + 1}, head {h + 1} "
                     f"(phrase share {share['phrase'][h] / max(share['total'][h], 1e-9):.0%})")
            plot_heat_map(m.weights[0, h].cpu(), m.ngrams, rows, keys, title, path)
            files.append(path)
    return files


# ---- phrase share over a data set ------------------------------------------------------------------------
def phrase_mass(m: AttentionMap, queries: Tensor) -> dict[str, Tensor]:
    """Attention mass per head over the ``queries`` (B,T) True = count: ``total`` (H,), ``phrase`` (H,) on n ≥ 2,
    and ``by_n`` (H, len(ngrams))."""
    keep = queries[:, None, :].to(m.weights.dtype)  # (B,1,T)
    by_n = torch.stack([(w.sum(-1) * keep).sum((0, 2)) for w in m.split().values()], dim=-1)  # (H,N)
    phrase = by_n[:, [i for i, n in enumerate(m.ngrams) if n > 1]].sum(-1)
    return {"total": by_n.sum(-1), "phrase": phrase, "by_n": by_n}


@torch.no_grad()
def phrase_share(model: EncoderDecoder, data: Bitext, *, max_tokens: int = 4000,
                 max_sentences: int | None = None) -> dict[str, Any]:
    """Share of attention mass on phrases (n ≥ 2) per slot and layer over the first ``max_sentences`` of ``data``."""
    n = len(data) if max_sentences is None else min(max_sentences, len(data))
    sampler = TokenBatchSampler(data.src.sizes[:n], data.tgt.sizes[:n], max_tokens, shuffle=False)
    sums: dict[tuple[str, int], dict[str, Any]] = {}
    device = device_of(model)
    for idx in sampler.batches(1):
        b = data.batch(idx).to(device)
        for m in attention_maps(model, b.src, b.tgt_in):
            queries = b.src.ne(PAD) if m.slot.startswith("encoder.") else b.tgt_out.ne(PAD)
            mass = phrase_mass(m, queries)
            acc = sums.setdefault((m.slot, m.layer), {"ngrams": m.ngrams})
            for k, v in mass.items():
                acc[k] = acc[k] + v.double().cpu() if k in acc else v.double().cpu()
    slots: dict[str, list[dict[str, Any]]] = {}
    for (slot, layer), acc in sorted(sums.items()):
        total = acc["total"].sum().clamp_min(1e-12)
        slots.setdefault(slot, []).append({
            "layer": layer + 1,
            "ngrams": acc["ngrams"],
            "phrase_share": float(acc["phrase"].sum() / total),
            "by_ngram": {str(g): float(acc["by_n"][:, i].sum() / total) for i, g in enumerate(acc["ngrams"])},
            "heads": (acc["phrase"] / acc["total"].clamp_min(1e-12)).tolist(),
        })
    return {"sentences": n, "slots": slots}


def plot_phrase_share(result: dict[str, Any], path: Path) -> None:
    """Phrase share per layer, one line per slot."""
    fig = Figure(figsize=(5, 3.6), layout="constrained")
    ax = fig.subplots()
    for slot, layers in result["slots"].items():
        ax.plot([r["layer"] for r in layers], [r["phrase_share"] for r in layers], marker="o",
                label=SLOT_TITLES.get(slot, slot))
    ax.set(xlabel="layer", ylabel="attention mass on phrases", ylim=(0, 1), title="Share of attention on phrases")
    ax.xaxis.get_major_locator().set_params(integer=True)  # layers are whole numbers
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=120)


# ---- the command --------------------------------------------------------------------------------------------
def run_attention_analysis(checkpoint: str | Path, out_dir: str | Path, *, src: str | None = None,
                           tgt: str | None = None, data: str | Path | None = None, split: str = "valid",
                           max_sentences: int | None = None, max_tokens: int = 4000,
                           device: str | torch.device = "cpu", src_lang: str | None = None,
                           tgt_lang: str | None = None) -> list[Path]:
    """``nmtflow analyze attention``: heat maps for ``src``/``tgt`` and/or phrase shares over ``data``'s split.

    Without ``tgt`` the heat maps are drawn for the model's own translation of ``src`` (a language model
    needs ``tgt``: it ignores sources). A multilingual checkpoint needs ``src_lang`` and ``tgt_lang``. A model
    without attention modules (ConvS2S, DenseNMT, an LSTM) is an error, as is a ``tgt`` or a sentence of
    ``data``'s split longer than the model's positions.
    """
    if src is None and tgt is None and data is None:
        raise ValueError("analyze attention needs --src/--tgt sentences and/or --data DIR")
    for option, sentence in (("--src", src), ("--tgt", tgt)):
        if sentence is not None and not sentence.strip():  # the maps would show EOS (or BOS) alone
            raise ValueError(f"analyze attention: {option} is empty; give a sentence to draw")
    check_limits(max_sentences, max_tokens)
    translator = open_translator(checkpoint, device, src_lang, tgt_lang)
    model, out = translator.model, Path(out_dir)
    if not any(isinstance(mod, MultiHeadAttention) for mod in model.modules()):
        name = getattr(model.config, "name", type(model).__name__)
        raise ValueError(f"{checkpoint}: the {name!r} model has no attention modules to draw (analyze attention "
                         "covers models built from nmtflow.nn.attention, e.g. Transformers)")
    model.requires_grad_(False)
    files: list[Path] = []
    if src is not None or tgt is not None:
        src_ids = translator.encode_source([src or ""])[0]
        if tgt is not None:
            tgt_ids = translator.tgt_tokenizer.encode(tgt)
            limit = position_limits(model.config)[1]
            if limit is not None and len(tgt_ids) + 1 > limit:  # tgt_in: BOS, then the sub-words
                raise ValueError(f"--tgt: {len(tgt_ids)} sub-words (with BOS {len(tgt_ids) + 1} positions) do not "
                                 f"fit the model's max_positions={limit}; give a shorter --tgt")
        elif getattr(model.config, "name", "") == "lm":
            raise ValueError("analyze attention: a language model needs --tgt (it ignores --src)")
        else:
            tgt_ids = translator.translate_ids([src_ids])[0][0].tokens
        files += draw_heat_maps(model, src_ids, tgt_ids, translator.src_tokenizer, translator.tgt_tokenizer, out,
                                src_prefix=translator.src_prefix)
    if data is not None:
        bitext = open_checkpoint_data(translator, data, split)
        check_positions(translator, bitext, data, split)  # the sentence too long for the model, named
        result = {"checkpoint": str(checkpoint), "split": split,
                  **phrase_share(model, bitext, max_tokens=max_tokens, max_sentences=max_sentences)}
        write_json(result, out / "phrase_share.json")
        plot_phrase_share(result, out / "phrase_share.png")
        files += [out / "phrase_share.json", out / "phrase_share.png"]
    return files
