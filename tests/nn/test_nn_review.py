"""Review of the attention interface, its variants combined in one Transformer, the registry and cache reordering
(SPEC §1-§3, §6): causality with a padding mask, weights for an all-padding source, plugin (re)registration, and
beam orders left pending by beam search."""
from __future__ import annotations

import dataclasses
import importlib
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from nmtflow.config import load_config
from nmtflow.data.vocab import BOS, EOS, PAD
from nmtflow.decode.search import beam_search, sequence_logprobs
from nmtflow.models.base import Vocabularies, build_model, reorder
from nmtflow.nn.attention import (ROWS, AttentionConfig, AttentionContext, MultiHeadAttention,
                                  defer_cache_reorder)
from nmtflow.registry import ATTENTIONS, register_attention
from tests.conftest import padded_batch

pytestmark = pytest.mark.usefixtures("one_thread")

V = 50
PH = {"type": "phrasal", "ngrams": [1, 2, 3]}
SC = {"type": "shortcut"}
FF = {"type": "shortcut", "feature_fusion": True}
NL = {"type": "shortcut", "source": "nonlexical"}
# (encoder self, decoder self, cross): every variant in some slot, next to another in the other slots
COMBOS: dict[str, tuple[dict[str, Any], ...]] = {
    "phrasal+fusion+shortcut": (PH, FF, SC),
    "nonlexical+phrasal+fusion": (NL, {"type": "phrasal", "ngrams": [2, 3]}, FF),
}


def make(slots: tuple[dict[str, Any], ...], pre_norm: bool = True, seed: int = 0, **model: Any) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = {"name": "transformer", "d_model": 32, "ffn_dim": 64, "heads": 4, "encoder_layers": 3, "decoder_layers": 3,
           "pre_norm": pre_norm, "encoder_self_attention": slots[0], "decoder_self_attention": slots[1],
           "cross_attention": slots[2], **model}
    return build_model(load_config(data={"model": cfg}).model, Vocabularies(V, V)).eval()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Sources of 9, 6 and 2 tokens, targets of 8 starting with BOS."""
    return padded_batch(V, seed=1, pad_from=(6, 2), tgt_len=8)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def reorder_like_beam_search(state: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """What beam search does between steps: self-attention caches deferred, everything else gathered."""
    state = dict(state)
    deferred = defer_cache_reorder(state, rows)
    return {k: v if k in deferred else v.index_select(0, rows) for k, v in state.items()}


# ---- the attention interface: causality and weights ------------------------------------------------------
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_causal_attention_is_aligned_to_the_last_keys_with_or_without_a_mask(need_weights: bool,
                                                                              padded: bool) -> None:
    """Causal attention with a key padding mask, or with fewer queries than keys (no cache), used to drop the
    causal mask (SDPA got ``is_causal=False`` beside a mask) or align it to the first keys (SDPA's ``is_causal``
    with T < S): query i must see keys 0 … S − T + i only, by SDPA and by the weights path alike."""
    torch.manual_seed(0)
    attn = MultiHeadAttention(16, 2).eval()
    x = torch.randn(2, 6, 16)
    pad = torch.zeros(2, 6, dtype=torch.bool)
    pad[1, 5] = True
    mask = pad if padded else None
    ctx = AttentionContext(need_weights=need_weights)
    with torch.no_grad():
        out, _ = attn(x, x, key_padding_mask=mask, causal=True, ctx=ctx)
        changed = x.clone()
        changed[:, 3:] = torch.randn(2, 3, 16)
        close(attn(changed, changed, key_padding_mask=mask, causal=True, ctx=ctx)[0][:, :3], out[:, :3])
        close(attn(changed[:, :3], changed[:, :3], causal=True, ctx=ctx)[0][0], out[0, :3])  # row 0: no padding
        # the last 2 queries against all 6 keys, no cache: what the full sequence gives at positions 4 and 5
        last, _ = attn(x[:, 4:], x, key_padding_mask=mask, causal=True, ctx=ctx)
        close(last, out[:, 4:])
        reference, _ = attn(x, x, key_padding_mask=mask, causal=True, ctx=AttentionContext(need_weights=True))
    close(out, reference)


@pytest.mark.parametrize("slots", [("standard",) * 3, ("shortcut",) * 3])
def test_weights_path_gives_the_sdpa_output_for_an_all_padding_source(slots: tuple[str, ...]) -> None:
    """With ``need_weights`` (analysis: attention maps, gate statistics) a query that may attend to nothing got
    NaN weights and a NaN output, where SDPA gives zero weights and context; both paths must agree."""
    model = make(tuple({"type": s} for s in slots), encoder_layers=2, decoder_layers=2)
    src = torch.tensor([[PAD, PAD, PAD], [5, 6, 7]])
    tgt = torch.tensor([[BOS, 5], [BOS, 6]])
    with torch.no_grad():
        plain, weighted = model.encoder(src), model.encoder(src, need_weights=True)
        close(weighted["out"], plain["out"])
        assert weighted["self_attn.0"][0].abs().max() == 0
        features, cross = model.decoder.features(tgt, plain, need_weights=True)
        close(features, model.decoder.features(tgt, plain)[0])
        assert all(torch.isfinite(w).all() and w[0].abs().max() == 0 for w in cross)
        torch.testing.assert_close(cross[0][1].sum(-1), torch.ones(4, 2))


# ---- variants combined in one Transformer -----------------------------------------------------------------
@pytest.mark.parametrize("pre_norm", [True, False])
@pytest.mark.parametrize("combo", list(COMBOS))
def test_combined_variants_keep_causality_padding_caching_and_beam_order(combo: str, pre_norm: bool) -> None:
    """Phrasal, (fused, non-lexical) shortcut and standard attention in different slots of one model: no future
    leakage, a sentence alone = padded in its batch, incremental (in steps and chunks, rows permuted between
    steps as beam search does) = full forward."""
    model = make(COMBOS[combo], pre_norm, tie_embeddings=not pre_norm)
    src, tgt = batch()
    with torch.no_grad():
        full = model(src, tgt)
        for t in (1, 4, 7):
            changed = tgt.clone()
            changed[:, t:] = torch.randint(4, V, changed[:, t:].shape, generator=torch.Generator().manual_seed(t))
            close(model(src, changed)[:, :t], full[:, :t])
        for i in range(3):
            length = int(src[i].ne(PAD).sum())
            close(model(src[i:i + 1, :length], tgt[i:i + 1]), full[i:i + 1])
        first, second = torch.tensor([2, 0, 0, 1]), torch.tensor([3, 1, 0, 2])
        rows = first[second]
        enc, state = model.encode(src), {}
        outs = [model.decode(tgt[:, :3], enc, state)[rows]]
        enc, state = reorder(enc, first), reorder_like_beam_search(state, first)
        outs.append(model.decode(tgt[first, 3:4], enc, state)[second])
        enc, state = reorder(enc, second), reorder_like_beam_search(state, second)
        for t in range(4, tgt.size(1)):
            outs.append(model.decode(tgt[rows, t:t + 1], enc, state))
        close(torch.cat(outs, 1), model(src[rows], tgt[rows]))


@pytest.mark.parametrize("combo", list(COMBOS))
def test_combined_variants_beam_search_scores_match_forced_decoding(combo: str) -> None:
    model = make(COMBOS[combo], encoder_layers=2, decoder_layers=2)
    src, _ = batch()
    for i, hyps in enumerate(beam_search(model, src, beam_size=3, nbest=3, max_len_a=1.0, max_len_b=2)):
        for h in hyps:
            expected = sequence_logprobs(model, src[i:i + 1], torch.tensor([[BOS, *h.tokens]]),
                                         torch.tensor([[*h.tokens, EOS]]))
            assert math.isclose(h.logprob, float(expected), abs_tol=1e-4)


# ---- cache reordering ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("slot", [{"type": "standard"}, SC, PH])
def test_generic_reorder_honours_a_beam_order_left_pending(slot: dict[str, Any]) -> None:
    """``reorder`` (the contract's one reordering function, base.py) on a state whose self-attention caches
    still wait for a beam order (``.rows``) gathered the caches as well: an IndexError, or the wrong rows."""
    model = make((slot,) * 3, encoder_layers=1, decoder_layers=2)
    src, tgt = batch()
    first, second = torch.tensor([2, 0, 0, 1]), torch.tensor([3, 1, 2])
    rows = first[second]
    with torch.no_grad():
        enc, state = model.encode(src), {}
        head = model.decode(tgt[:, :3], enc, state)[rows]
        state = reorder_like_beam_search(state, first)
        assert any(k.endswith(ROWS) for k in state)
        enc, state = reorder(reorder(enc, first), second), reorder(state, second)  # e.g. finished sentences pruned
        tail = model.decode(tgt[rows, 3:], enc, state)
        close(torch.cat([head, tail], 1), model(src[rows], tgt[rows]))


def test_phrasal_caches_are_reordered_when_extended_not_copied_each_step() -> None:
    """Beam search defers the reordering of self-attention caches to the next step's extension (one copy, not
    two); the phrasal phrase caches (Σn·Dh + N·Dh per position, most of the decoding state) were gathered eagerly
    every step. Measured on the 2-core CPU (base size, decoder {1,2,3}, 16 sentences × beam 5 × 40 steps, 1 thread,
    alternating): 26.4 s eager vs 18.1 s deferred. Phrasal self-attention now caches its keys and phrase-slot values
    as ``NAME.k``/``NAME.v`` (Dh + N'·Dh per position); only the small ``.tail`` (N − 1 positions) is gathered."""
    model = make((PH,) * 3, encoder_layers=1, decoder_layers=1)
    src, tgt = batch()
    order = torch.tensor([1, 1, 0])
    with torch.no_grad():
        enc, state = model.encode(src), {}
        model.decode(tgt[:, :4], enc, state)
        before = dict(state)
        state = reorder_like_beam_search(state, order)
        phrase_caches = [k for k in state if ".self_attn." in k and k.endswith((".k", ".v"))]
        assert len(phrase_caches) == 2 and state["decoder.0.self_attn.v"].size(-1) == 3 * model.config.d_model // 4
        assert all(state[k] is before[k] for k in phrase_caches)
        assert state["decoder.0.self_attn.tail"] is not before["decoder.0.self_attn.tail"]
        rest = model.decode(tgt[order, 4:], reorder(enc, order), state)
        close(rest, model(src[order], tgt[order])[:, 4:])


# ---- the registry --------------------------------------------------------------------------------------------
PLUGIN = '''
from dataclasses import dataclass
from nmtflow.nn.attention import AttentionConfig, MultiHeadAttention
from nmtflow.registry import register_attention

@dataclass
class ReviewOptions(AttentionConfig):
    temperature: float = {temperature}

@register_attention("review_reloaded", ReviewOptions)
class ReviewAttention(MultiHeadAttention):
    def project_kv(self, source, ctx):
        k, v = super().project_kv(source, ctx)
        return k / self.options.temperature, v
'''


def test_a_reloaded_plugin_module_registers_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Re-importing a plugin (``importlib.reload``, a notebook's autoreload or re-run cell) raised "already
    registered"; its new definition now replaces the old one, while another class under a taken name still fails."""
    (tmp_path / "review_plugin.py").write_text(PLUGIN.format(temperature=2.0))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("review_plugin")
    (tmp_path / "review_plugin.py").write_text(PLUGIN.format(temperature=3.0))
    importlib.invalidate_caches()
    module = importlib.reload(module)
    entry = ATTENTIONS.get("review_reloaded")
    assert entry.cls is module.ReviewAttention and entry.config_cls().temperature == 3.0

    with pytest.raises(ValueError, match="'review_reloaded' is already registered"):
        @register_attention("review_reloaded", AttentionConfig)
        class Other(MultiHeadAttention):
            pass


def test_registering_what_could_never_be_configured_is_an_error() -> None:
    """An options class without a ``type`` field registered fine and then failed every config with "unknown key
    'type'"; a non-string name broke the sorted list of names in every later "unknown attention" error."""
    @dataclasses.dataclass
    class NoType:
        scale: float = 1.0

    with pytest.raises(TypeError, match="dataclass with a 'type' field"):
        register_attention("review_no_type", NoType)
    with pytest.raises(TypeError, match="dataclass with a 'type' field"):
        register_attention("review_not_a_dataclass", dict)
    with pytest.raises(TypeError, match="non-empty string"):
        register_attention(3, AttentionConfig)  # type: ignore[arg-type]
    assert "review_no_type" not in ATTENTIONS and all(isinstance(n, str) for n in ATTENTIONS.names())
