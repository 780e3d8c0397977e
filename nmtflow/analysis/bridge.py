"""Analyses of the attention bridge (Vázquez et al. 2020 §3.2.2 and §5, Table 13; SPEC §5).

* **BLEU by source length** (the paper's Figure 3): the sentences of a source file are grouped by their length
  in words (whitespace-separated tokens of the raw line) into buckets, by default 1-10, 11-15, 16-20, 21-25,
  26+. Every checkpoint translates the whole file once with its
  :class:`~nmtflow.decode.translate.Translator` (the checkpoint's beam search unless overridden) and
  sacreBLEU is computed per bucket: the corpus BLEU of the bucket's sentences. Any model works; multilingual
  ones translate ``src_lang → tgt_lang``, trained or zero-shot.
* **Bridge heat maps** (one sentence): the bridge's A (k × n) of Eq. 8, ``A = softmax(W_2 ReLU(W_1 Hᵀ))``
  over positions: row i is head i's distribution over the n source positions (the sub-words, then EOS), one
  panel per checkpoint.
* **Head entropy** (the paper's Table 13): ``H_i = −Σ_j A_ij log A_ij`` (nats; 0·log 0 = 0, so padding adds
  nothing) of every head i of every sentence, averaged three ways. For a sentence with n source positions
  (the columns of A: sub-words plus EOS):

  - ``all_heads``: the mean over its k heads (the paper's k ∈ [1, k]);
  - ``within_length``: the mean over the heads with 0-based index i < n (the paper's k ∈ [1, n_i]: the first
    n heads, as many as there are positions for them to cover);
  - ``beyond_length``: the mean over the heads i ≥ n (the paper's k ∈ [n_i, k]); a sentence with n ≥ k has
    no such head and is left out of this mean.

  Each is then averaged over the sentences (each sentence counts once); ``per_head`` is the mean entropy of
  head i over all sentences.

A is read from what the bridge model's encoder returns (``encode(src)["bridge_attention"]``, (B,k,S) with
zero weight on padding; see :class:`~nmtflow.models.multilingual.AttentionBridgeModel`): nothing is patched.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import Tensor

from nmtflow.analysis import plots
from nmtflow.analysis.report import write_report
from nmtflow.analysis.states import check_limits, default_labels
from nmtflow.checkpoint import load_checkpoint
from nmtflow.data.batching import collate
from nmtflow.data.corpus import CorpusError, read_lines
from nmtflow.data.multilingual import Direction
from nmtflow.data.vocab import PAD
from nmtflow.decode.multilingual import is_multilingual, load_multilingual
from nmtflow.decode.translate import Translator, batches_by_length
from nmtflow.evaluate.metrics import bleu
from nmtflow.models.base import EncoderDecoder
from nmtflow.nn.bridge import AttentionBridge

DEFAULT_BUCKETS = ("1-10", "11-15", "16-20", "21-25", "26+")


# ---- loading ------------------------------------------------------------------------------------------------
@dataclass
class Loaded:
    """A checkpoint ready for analysis: its label, the translator of one direction, and that direction."""

    label: str
    path: Path
    translator: Translator
    direction: str  # SRC-TGT


def _pick_direction(path: str | Path, trained: list[str], zero_shot: list[str], src_lang: str | None,
                    tgt_lang: str | None) -> tuple[str, str]:
    """The direction of a multilingual checkpoint to use when ``src_lang``/``tgt_lang`` are (partly) missing."""
    if src_lang and tgt_lang:
        return src_lang, tgt_lang
    known = [Direction.parse(d) for d in [*trained, *zero_shot]]
    fits = [d for d in known if not d.is_copy and d.src == (src_lang or d.src) and d.tgt == (tgt_lang or d.tgt)]
    if len(fits) == 1:
        return fits[0].src, fits[0].tgt
    names = f"trained: {', '.join(trained) or 'none'}"  # copy directions too, as translate lists them
    names += f"; zero-shot: {', '.join(zero_shot)}" if zero_shot else ""
    if not fits and (src_lang or tgt_lang):
        raise ValueError(f"{path}: no direction {src_lang or '*'}-{tgt_lang or '*'} ({names})")
    raise ValueError(f"{path}: a multilingual model ({names}): name --src-lang and --tgt-lang")


def _pick_encoder(path: str | Path, ckpt: dict[str, Any], src_lang: str | None) -> tuple[str, str]:
    """The encoder language of a multilingual checkpoint (``src_lang``, or its only encoder) and a target
    language to pair it with (the encoder and bridge do not depend on the target)."""
    vocab, langs = ckpt.get("vocab") or {}, ckpt.get("langs") or {}
    known = [Direction.parse(d) for d in [*langs.get("directions", []), *langs.get("zero_shot", [])]]
    encoders = list(vocab.get("encoders") or dict.fromkeys(d.src for d in known))
    decoders = list(vocab.get("decoders") or dict.fromkeys(d.tgt for d in known))
    if src_lang is None:
        if len(encoders) != 1:
            raise ValueError(f"{path}: a multilingual model with encoders {', '.join(encoders) or 'none'}: "
                             "name --src-lang")
        src_lang = encoders[0]
    elif src_lang not in encoders:
        raise ValueError(f"{path}: no {src_lang} encoder (the model has {', '.join(encoders) or 'none'})")
    targets = [d.tgt for d in known if d.src == src_lang and not d.is_copy]
    targets += [lang for lang in decoders if lang != src_lang] + decoders + [src_lang]
    return src_lang, targets[0]


def open_translator(path: str | Path, src_lang: str | None = None, tgt_lang: str | None = None,
                    device: str | torch.device = "cpu", *, encoder_only: bool = False) -> tuple[Translator, str]:
    """A checkpoint's translator for ``src_lang → tgt_lang`` and the direction it translates.

    A multilingual checkpoint with a single trained direction needs no languages; with ``encoder_only`` (the
    bridge analyses) ``src_lang`` names one of the model's encoders (needed when it has more than one) and
    the target does not matter; a bilingual one translates its own direction, which the given
    languages, if any, must match.
    """
    ckpt = load_checkpoint(path)
    if is_multilingual(ckpt):
        langs = ckpt.get("langs", {})
        if encoder_only:  # the encoder named by --src-lang (and the bridge), whatever the target
            src, tgt = _pick_encoder(path, ckpt, src_lang)
        else:
            src, tgt = _pick_direction(path, list(langs.get("directions", [])), list(langs.get("zero_shot", [])),
                                       src_lang, tgt_lang)
        try:
            translator = load_multilingual(path, device).translator(src, tgt)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
        return translator, str(Direction(src, tgt))
    translator = Translator.from_checkpoint(path, device)
    dc = translator.config.data if translator.config is not None else None
    src, tgt = (dc.src_lang, dc.tgt_lang) if dc is not None else ("src", "tgt")
    if (src_lang and src_lang != src) or (tgt_lang and tgt_lang != tgt and not encoder_only):
        raise ValueError(f"{path}: a bilingual {src}-{tgt} model cannot translate "
                         f"{src_lang or src}-{tgt_lang or tgt}")
    return translator, str(Direction(src, tgt))


def path_labels(paths: Sequence[str | Path]) -> list[str]:
    """Default labels of checkpoints: :func:`nmtflow.analysis.states.default_labels`."""
    return default_labels(paths)


def load_checkpoints(paths: Sequence[str | Path], labels: Sequence[str] | None = None, *,
                     src_lang: str | None = None, tgt_lang: str | None = None, device: str | torch.device = "cpu",
                     encoder_only: bool = False) -> list[Loaded]:
    """:func:`open_translator` for every checkpoint, labelled (default: :func:`path_labels`); ``encoder_only``
    (the bridge analyses) also requires an attention bridge."""
    if not paths:
        raise ValueError("name at least one checkpoint")
    if labels is not None and len(labels) != len(paths):
        raise ValueError(f"{len(labels)} labels given for {len(paths)} checkpoints")
    given = labels is not None
    labels = list(labels) if labels is not None else path_labels(paths)
    if len(set(labels)) != len(labels):
        raise ValueError(f"--labels must differ, got {', '.join(labels)}" if given else
                         f"labels must differ, got {', '.join(labels)} (name them with --labels)")
    out = []
    for label, path in zip(labels, paths):
        translator, direction = open_translator(path, src_lang, tgt_lang, device, encoder_only=encoder_only)
        if encoder_only and not any(isinstance(mod, AttentionBridge) for mod in translator.model.modules()):
            name = getattr(translator.model.config, "name", type(translator.model).__name__)
            raise ValueError(f"{path}: the {name!r} model has no attention bridge")
        translator.model.requires_grad_(False)
        out.append(Loaded(label, Path(path), translator, direction))
    return out


# ---- BLEU by source length ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bucket:
    """Source lengths ``low`` … ``high`` words, both included (``high`` None: no upper limit)."""

    low: int
    high: int | None

    @property
    def name(self) -> str:
        return f"{self.low}+" if self.high is None else f"{self.low}-{self.high}"

    def __contains__(self, length: int) -> bool:
        return self.low <= length and (self.high is None or length <= self.high)


def parse_buckets(specs: Sequence[str] | None = None) -> list[Bucket]:
    """``["1-10", "11-15", "26+"]`` (items may also be comma-separated) → ascending, non-overlapping buckets."""
    items = [s.strip() for spec in (specs or DEFAULT_BUCKETS) for s in spec.split(",") if s.strip()]
    if not items:
        raise ValueError("buckets: give at least one, e.g. 1-10 11-20 21+")
    buckets = []
    for item in items:
        match = re.fullmatch(r"(\d+)(?:-(\d+)|(\+))", item)
        if not match:
            raise ValueError(f"bucket {item!r}: expected LOW-HIGH or LOW+ (source words), e.g. 1-10 or 26+")
        low, high = int(match[1]), None if match[3] else int(match[2])
        if high is not None and high < low:
            raise ValueError(f"bucket {item!r}: the upper end is below the lower one")
        previous = buckets[-1] if buckets else None
        if previous is not None and (previous.high is None or low <= previous.high):
            raise ValueError(f"bucket {item!r} overlaps {previous.name} (give buckets in ascending order)")
        buckets.append(Bucket(low, high))
    return buckets


def word_length(line: str) -> int:
    """The length of a raw source sentence in words (whitespace-separated tokens)."""
    return len(line.split())


def assign_buckets(lengths: Sequence[int], buckets: Sequence[Bucket]) -> list[int | None]:
    """The index of each length's bucket (None: in no bucket)."""
    return [next((b for b, bucket in enumerate(buckets) if n in bucket), None) for n in lengths]


def bleu_by_bucket(hypotheses: Sequence[str], references: Sequence[str], lengths: Sequence[int],
                   buckets: Sequence[Bucket]) -> dict[str, Any]:
    """Corpus sacreBLEU of the sentences of each bucket (None for an empty bucket), and over all sentences."""
    if not len(hypotheses) == len(references) == len(lengths):
        raise ValueError(f"{len(hypotheses)} hypotheses, {len(references)} references and {len(lengths)} lengths")
    where = assign_buckets(lengths, buckets)
    rows = []
    for b, bucket in enumerate(buckets):
        keep = [i for i, w in enumerate(where) if w == b]
        score = bleu([hypotheses[i] for i in keep], [references[i] for i in keep]).score if keep else None
        rows.append({"bucket": bucket.name, "sentences": len(keep), "bleu": score})
    overall = bleu(list(hypotheses), list(references))
    return {"bleu": overall.score, "signature": overall.signature, "buckets": rows,
            "outside_buckets": sum(w is None for w in where)}


def run_length_bleu(checkpoints: Sequence[str | Path], src: str | Path, ref: str | Path, out_dir: str | Path, *,
                    src_lang: str | None = None, tgt_lang: str | None = None, buckets: Sequence[str] | None = None,
                    labels: Sequence[str] | None = None, beam_size: int | None = None, greedy: bool = False,
                    max_tokens: int | None = None, max_sentences: int | None = None,
                    device: str | torch.device = "cpu") -> dict[str, Any]:
    """``nmtflow analyze length-bleu``: write ``length_bleu.json`` and ``length_bleu.png``."""
    spec = parse_buckets(buckets)
    check_limits(max_sentences, max_tokens)
    sources, references = read_lines(src), read_lines(ref)
    if len(sources) != len(references):
        raise ValueError(f"{src} has {len(sources)} lines but {ref} has {len(references)}")
    if max_sentences is not None:
        sources, references = sources[:max_sentences], references[:max_sentences]
    if not sources:
        raise CorpusError(src, "no sentences")
    lengths = [word_length(s) for s in sources]
    where = assign_buckets(lengths, spec)
    result: dict[str, Any] = {
        "analysis": "length_bleu", "src": str(src), "ref": str(ref), "sentences": len(sources),
        "length": "source words (whitespace-separated)",
        "buckets": [{"bucket": b.name, "low": b.low, "high": b.high, "sentences": where.count(i)}
                    for i, b in enumerate(spec)],
        "models": {}}
    for m in load_checkpoints(checkpoints, labels, src_lang=src_lang, tgt_lang=tgt_lang, device=device):
        d = m.translator.decode
        d.nbest = 1
        if beam_size is not None:
            d.beam_size = beam_size
        if greedy:
            d.greedy = True
        if max_tokens is not None:
            d.max_tokens = max_tokens
        hypotheses = [nbest[0][0] for nbest in m.translator.translate(sources)]
        result["models"][m.label] = {"checkpoint": str(m.path), "direction": m.direction,
                                     "beam_size": 1 if d.greedy else d.beam_size,
                                     **bleu_by_bucket(hypotheses, references, lengths, spec)}
    return write_report(result, out_dir, "length_bleu", plots.plot_length_bleu)


def length_table(result: dict[str, Any]) -> str:
    """Rows = models, columns = buckets (with their sentence counts) and ``all``."""
    heads = [f"{b['bucket']} ({b['sentences']})" for b in result["buckets"]] + ["all"]
    width = max(10, *(len(h) + 2 for h in heads))
    name_width = max(12, *(len(label) + 2 for label in result["models"]))
    lines = [f"{'':<{name_width}}" + "".join(f"{h:>{width}}" for h in heads)]
    for label, m in result["models"].items():
        cells = [b["bleu"] for b in m["buckets"]] + [m["bleu"]]
        lines.append(f"{label:<{name_width}}" + "".join(f"{'-':>{width}}" if c is None else f"{c:>{width}.2f}"
                                                        for c in cells))
    return "\n".join(lines)


# ---- bridge attention ---------------------------------------------------------------------------------------
def bridge_attention(model: EncoderDecoder, src: Tensor) -> Tensor:
    """A (B,k,S) of Eq. 8 for src (B,S) (one direction's model, e.g. a LanguagePair); padding columns hold 0."""
    enc = model.encode(src)
    if "bridge_attention" not in enc:
        name = getattr(model.config, "name", type(model).__name__)
        raise ValueError(f"the {name!r} model has no attention bridge")
    return enc["bridge_attention"]


def unpadded(attention: Tensor, src: Tensor) -> list[Tensor]:
    """A (B,k,S) → per sentence its (k, n) matrix over the n non-padding source positions."""
    return [a[:, :n] for a, n in zip(attention, src.ne(PAD).sum(1).tolist())]


@torch.no_grad()
def sentence_attention(translator: Translator, sentence: str) -> tuple[list[str], Tensor]:
    """One sentence → its source tokens (sub-words, then EOS) and the bridge's A (k, n) over them."""
    model = translator.model.eval()
    ids = translator.encode_source([sentence])[0]
    src = collate([ids], [[]], src_prefix=translator.src_prefix).src.to(translator.device)
    tokens = translator.src_tokenizer.labels(src[0].tolist())
    return tokens, unpadded(bridge_attention(model, src), src)[0].float().cpu()


def run_bridge_heat_maps(checkpoints: Sequence[str | Path], sentence: str, out_dir: str | Path, *,
                         src_lang: str | None = None, labels: Sequence[str] | None = None,
                         device: str | torch.device = "cpu") -> dict[str, Any]:
    """``nmtflow analyze bridge-attention``: write ``bridge_attention.json`` (A per checkpoint) and its PNG."""
    if not sentence.strip():
        raise ValueError("analyze bridge-attention: --sentence is empty")
    result: dict[str, Any] = {"analysis": "bridge_attention", "sentence": sentence,
                              "rows": "bridge heads (k)", "columns": "source positions (sub-words, then EOS)",
                              "models": {}}
    for m in load_checkpoints(checkpoints, labels, src_lang=src_lang, device=device, encoder_only=True):
        tokens, attention = sentence_attention(m.translator, sentence)
        result["models"][m.label] = {"checkpoint": str(m.path), "lang": Direction.parse(m.direction).src,
                                     "tokens": tokens, "attention": attention.tolist(),
                                     "entropy": head_entropy(attention[None])[0].tolist()}
    return write_report(result, out_dir, "bridge_attention", plots.plot_bridge_attention)


# ---- head entropy -------------------------------------------------------------------------------------------
def head_entropy(attention: Tensor) -> Tensor:
    """H_i = −Σ_j A_ij log A_ij (nats) of A (B,k,S) → (B,k); zero weights (padding) add nothing."""
    a = attention.double()
    return -torch.special.xlogy(a, a).sum(-1)


class EntropyStats:
    """Running means of head entropies (see the module docstring for the three groups)."""

    GROUPS = ("all_heads", "within_length", "beyond_length")

    def __init__(self, heads: int) -> None:
        self.heads = heads
        self.sums = {g: 0.0 for g in self.GROUPS}
        self.counts = {g: 0 for g in self.GROUPS}
        self.per_head = torch.zeros(heads, dtype=torch.float64)
        self.sentences = 0
        self.uniform = 0.0  # Σ log n: the entropy a head spread evenly over the sentence would have

    def add(self, entropy: Tensor, lengths: Tensor) -> None:
        """entropy (B,k) of sentences with ``lengths`` (B,) source positions."""
        entropy, lengths = entropy.double().cpu(), lengths.cpu()
        within = torch.arange(self.heads)[None, :] < lengths[:, None]  # (B,k): head index i < n
        beyond = ~within
        has_beyond = beyond.any(1)
        means = {"all_heads": entropy.mean(1),
                 "within_length": (entropy * within).sum(1) / within.sum(1).clamp_min(1),
                 "beyond_length": ((entropy * beyond).sum(1) / beyond.sum(1).clamp_min(1))[has_beyond]}
        for group, values in means.items():
            self.sums[group] += float(values.sum())
            self.counts[group] += values.numel()
        self.per_head += entropy.sum(0)
        self.sentences += entropy.size(0)
        self.uniform += float(lengths.double().log().sum())

    def result(self) -> dict[str, Any]:
        n = max(self.sentences, 1)
        return {"sentences": self.sentences, "heads": self.heads,
                **{g: self.sums[g] / self.counts[g] if self.counts[g] else math.nan for g in self.GROUPS},
                "sentences_per_group": dict(self.counts),
                "per_head": (self.per_head / n).tolist() if self.sentences else [math.nan] * self.heads,
                "uniform": self.uniform / n if self.sentences else math.nan}


@torch.no_grad()
def entropy_stats(translator: Translator, sentences: Sequence[str], max_tokens: int = 4000) -> EntropyStats:
    """Head entropies of the bridge over ``sentences`` (batched by length; padding is masked)."""
    model = translator.model.eval()
    ids = translator.encode_source(list(sentences))
    stats: EntropyStats | None = None
    for rows in batches_by_length([len(s) for s in ids], max_tokens):
        src = collate([ids[r] for r in rows], [[]] * len(rows), src_prefix=translator.src_prefix).src
        src = src.to(translator.device)
        attention = bridge_attention(model, src)  # (B,k,S)
        stats = stats or EntropyStats(attention.size(1))
        stats.add(head_entropy(attention), src.ne(PAD).sum(1))
    assert stats is not None
    return stats


def run_head_entropy(checkpoints: Sequence[str | Path], src: str | Path, out_dir: str | Path, *,
                     src_lang: str | None = None, labels: Sequence[str] | None = None,
                     max_sentences: int | None = None, max_words: int | None = None, max_tokens: int = 4000,
                     device: str | torch.device = "cpu") -> dict[str, Any]:
    """``nmtflow analyze bridge-entropy``: write ``bridge_entropy.json`` and ``bridge_entropy.png``.

    Uses the non-empty lines of ``src`` with at most ``max_words`` words (the paper: up to 40), the first
    ``max_sentences`` of them.
    """
    check_limits(max_sentences, max_tokens)
    sentences = [s for s in read_lines(src) if s.strip() and (max_words is None or word_length(s) <= max_words)]
    sentences = sentences[:max_sentences] if max_sentences is not None else sentences
    if not sentences:
        raise CorpusError(src, "no sentences to analyse" + (f" of at most {max_words} words" if max_words else ""))
    result: dict[str, Any] = {
        "analysis": "bridge_entropy", "src": str(src), "sentences": len(sentences), "max_words": max_words,
        "unit": "nats", "length": "n = source positions of the sentence (sub-words plus EOS)",
        "groups": {"all_heads": "mean over all k heads", "within_length": "mean over heads with index i < n",
                   "beyond_length": "mean over heads with index i >= n (sentences with n < k only)"},
        "models": {}}
    for m in load_checkpoints(checkpoints, labels, src_lang=src_lang, device=device, encoder_only=True):
        stats = entropy_stats(m.translator, sentences, max_tokens)
        result["models"][m.label] = {"checkpoint": str(m.path), "lang": Direction.parse(m.direction).src,
                                     **stats.result()}
    return write_report(result, out_dir, "bridge_entropy", plots.plot_head_entropy)


def entropy_table(result: dict[str, Any]) -> str:
    """Rows = models; columns = the three mean entropies and the sentences behind ``beyond_length``."""
    heads = [*EntropyStats.GROUPS, "k", "sentences"]
    name_width = max(12, *(len(label) + 2 for label in result["models"]))
    lines = [f"{'':<{name_width}}" + "".join(f"{h:>15}" for h in heads)]
    for label, m in result["models"].items():
        values = "".join(f"{'-':>15}" if m[g] is None or not math.isfinite(m[g]) else f"{m[g]:>15.4f}"
                         for g in EntropyStats.GROUPS)
        lines.append(f"{label:<{name_width}}{values}{m['heads']:>15}{m['sentences']:>15}")
    return "\n".join(lines)
