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
from nmtflow.analysis.states import check_limits, gates_on_target, recording_gates
from nmtflow.data.batching import TokenBatchSampler, collate
from nmtflow.data.bitext import Bitext
from nmtflow.data.tokenizer import Tokenizer
from nmtflow.data.vocab import PAD
from nmtflow.decode.multilingual import open_translator
from nmtflow.decode.translate import Translator
from nmtflow.evaluate.perplexity import check_positions, open_checkpoint_data
from nmtflow.models.base import EncoderDecoder, device_of, position_limits
from nmtflow.nn.attention import AttentionContext, MultiHeadAttention
from nmtflow.nn.phrasal import PhrasalAttention, split_phrasal_weights
from nmtflow.nn.shortcuts import ShortcutAttention

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


@dataclass
class SentenceMaps:
    """One sentence pair through a model: its token labels, every attention module's weights and every lexical
    shortcut's gates (batch of one)."""

    src: list[str]  # encoder positions: any <2xx> tag, the sub-words, then EOS (byte pieces shown as characters)
    tgt_in: list[str]  # decoder inputs: BOS, then the sub-words (the keys of decoder self-attention)
    tgt_out: list[str]  # what each decoder position predicts: the sub-words, then EOS
    maps: list[AttentionMap]
    gates: dict[str, dict[str, Tensor]]  # shortcut module name → {"k": r_k, "v": r_v}, each (S,D) over its keys

    def rows(self, m: AttentionMap) -> list[str]:
        """The labels of a map's queries: source tokens in the encoder, predicted target tokens in the decoder."""
        return self.src if m.slot.startswith("encoder.") else self.tgt_out

    def keys(self, m: AttentionMap) -> list[str]:
        """The labels of a map's keys (n = 1); ``M1`` … ``Mk`` for the cross-attention over an attention bridge."""
        if m.slot == "decoder.self_attn":
            return self.tgt_in
        if m.slot == "decoder.cross_attn" and m.key_length != len(self.src):  # an attention bridge: its k rows of M
            return [f"M{i + 1}" for i in range(m.key_length)]
        return self.src

    def gate_keys(self, mod: ShortcutAttention) -> list[str]:
        return self.tgt_in if gates_on_target(mod) else self.src


@torch.no_grad()
def sentence_maps(model: EncoderDecoder, src_ids: list[int], tgt_ids: list[int], src_tok: Tokenizer,
                  tgt_tok: Tokenizer, *, src_prefix: int | None = None, record: bool = True) -> SentenceMaps:
    """Teacher-forced pass of one sentence pair (ids without BOS/EOS; ``src_prefix``: a language-label model's
    ``<2xx>`` tag before the source) recording attention weights and shortcut gates: what the heat maps and
    ``nmtflow serve``'s flow view show (``record=False``: the labels only, no pass)."""
    b = collate([src_ids], [tgt_ids], src_prefix=src_prefix).to(device_of(model))
    maps: list[AttentionMap] = []
    gates: dict[str, dict[str, Tensor]] = {}
    if record:
        model.eval()
        with recording(model) as maps, recording_gates(model) as shortcuts:
            model(b.src, b.tgt_in)
            gates = {mod.name: {kv: r[0].detach() for kv, r in mod.gates.items()} for mod in shortcuts}
    return SentenceMaps(src_tok.labels(b.src[0].tolist()), tgt_tok.labels(b.tgt_in[0].tolist()),
                        tgt_tok.labels(b.tgt_out[0].tolist()), maps, gates)


def head_phrase_share(m: AttentionMap) -> Tensor:
    """Per head (H,): the share of a one-sentence map's attention mass on n-grams with n ≥ 2."""
    share = phrase_mass(m, torch.ones(1, m.weights.size(2), dtype=torch.bool, device=m.weights.device))
    return share["phrase"] / share["total"].clamp_min(1e-9)


def draw_heat_maps(model: EncoderDecoder, src_ids: list[int], tgt_ids: list[int], src_tok: Tokenizer,
                   tgt_tok: Tokenizer, out_dir: str | Path, *, src_prefix: int | None = None) -> list[Path]:
    """Heat maps of every slot, layer and head for one sentence pair (ids without BOS/EOS; ``src_prefix``: a
    language-label model's ``<2xx>`` tag before the source)."""
    s = sentence_maps(model, src_ids, tgt_ids, src_tok, tgt_tok, src_prefix=src_prefix)
    files = []
    for m in s.maps:
        share = head_phrase_share(m)
        for h in range(m.weights.size(1)):
            path = Path(out_dir) / f"{m.slot}.layer{m.layer + 1}.head{h + 1}.png"
            title = (f"{SLOT_TITLES.get(m.slot, m.slot)}, layer {m.layer + 1}, head {h + 1} "
                     f"(phrase share {float(share[h]):.0%})")
            plot_heat_map(m.weights[0, h].cpu(), m.ngrams, s.rows(m), s.keys(m), title, path)
            files.append(path)
    return files


def refuse_empty(sentences: dict[str, str | None]) -> None:
    """A ValueError naming the option of an empty sentence ({option: sentence or None}): its maps would show EOS (or
    BOS) alone."""
    for option, sentence in sentences.items():
        if sentence is not None and not sentence.strip():
            raise ValueError(f"{option} is empty; give a sentence to draw")


def pair_ids(translator: Translator, src: str | None, tgt: str | None, *, src_option: str = "--src",
             tgt_option: str = "--tgt") -> tuple[list[int], list[int]]:
    """A sentence pair's ids (no BOS/EOS) for the maps: ``tgt``, or without it the model's own beam translation of
    ``src``; ValueErrors naming the option (``src_option``/``tgt_option``) for an empty sentence or a ``tgt`` longer
    than the model's positions."""
    refuse_empty({src_option: src, tgt_option: tgt})
    model = translator.model
    src_ids = translator.encode_source([src or ""])[0]
    if tgt is not None:
        tgt_ids = translator.tgt_tokenizer.encode(tgt)
        limit = position_limits(model.config)[1]
        if limit is not None and len(tgt_ids) + 1 > limit:  # tgt_in: BOS, then the sub-words
            raise ValueError(f"{tgt_option}: {len(tgt_ids)} sub-words (with BOS {len(tgt_ids) + 1} positions) do not "
                             f"fit the model's max_positions={limit}; give a shorter {tgt_option}")
        return src_ids, tgt_ids
    if getattr(model.config, "name", "") == "lm":
        raise ValueError(f"a language model needs {tgt_option} (it ignores {src_option})")
    return src_ids, translator.translate_ids([src_ids])[0][0].tokens


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
    try:
        refuse_empty({"--src": src, "--tgt": tgt})
    except ValueError as exc:
        raise ValueError(f"analyze attention: {exc}") from None
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
        try:
            src_ids, tgt_ids = pair_ids(translator, src, tgt)
        except ValueError as exc:
            raise ValueError(f"analyze attention: {exc}") from None
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
