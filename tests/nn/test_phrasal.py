"""Phrasal attention (SPEC §3): the vectorised module against the literal equations, masks, caches, sizes."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from nmtflow.cli import main
from nmtflow.config import ConfigError, load_config
from nmtflow.data.vocab import BOS, PAD
from nmtflow.decode.search import _reorder_state, beam_search, greedy_search, sequence_logprobs
from nmtflow.models.base import Vocabularies, build_model
from nmtflow.nn.attention import AttentionContext, MultiHeadAttention
from nmtflow.nn.phrasal import (PhrasalAttention, PhrasalOptions, phrase_counts, phrase_visibility,
                                split_phrasal_weights)
from tests.conftest import padded_batch

REPO = Path(__file__).resolve().parents[2]
D, H = 16, 2
WEIGHTS = AttentionContext(need_weights=True)


def module(ngrams: list[int], seed: int = 0, self_attention: bool = True) -> PhrasalAttention:
    torch.manual_seed(seed)
    return PhrasalAttention(D, H, self_attention=self_attention, options=PhrasalOptions(ngrams=ngrams)).double()


def reference(m: PhrasalAttention, query: torch.Tensor, source: torch.Tensor, pad: torch.Tensor | None,
              causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """SPEC §3 written out position by position (slow; tests only; differentiable)."""
    b_size, t_len, _ = query.shape
    s_len, dh = source.size(1), m.head_dim
    wq, wk, wv = m.q_proj.weight, m.k_proj.weight, m.v_proj.weight
    heads = torch.zeros(b_size, t_len, D, dtype=query.dtype)
    weights = torch.zeros(b_size, H, t_len, sum(phrase_counts(m.ngrams, s_len)), dtype=query.dtype)
    for b in range(b_size):
        for h in range(H):
            hs = slice(h * dh, (h + 1) * dh)
            for i in range(t_len):
                scores, values = [], []
                row = 0
                for n in m.ngrams:
                    wq_n = wq[row * D:(row + n) * D]  # (n·D, D) laid out (H, n, Dh)
                    q_n = [wq_n[h * n * dh + t * dh:h * n * dh + (t + 1) * dh] @ query[b, i] for t in range(n)]
                    wv_n = [wv[(row + t) * D:(row + t + 1) * D] for t in range(n)]  # W_{v,n}[t], (D, D)
                    for j in range(s_len - n + 1):
                        a = sum(q_n[t] @ (wk[hs] @ source[b, j + t]) for t in range(n)) / math.sqrt(dh * n)
                        ok = pad is None or not bool(pad[b, j:j + n].any())
                        if causal:
                            ok = ok and j + n - 1 <= i + s_len - t_len
                        scores.append(a if ok else torch.tensor(float("-inf"), dtype=query.dtype))
                        values.append(sum(wv_n[t][hs] @ source[b, j + t] for t in range(n)))
                    row += n
                if not scores or bool(torch.stack(scores).isneginf().all()):
                    continue
                p = torch.stack(scores).softmax(0)
                weights[b, h, i] = p
                heads[b, i, hs] = (p[:, None] * torch.stack(values)).sum(0)
    return heads @ m.out_proj.weight.T, weights  # heads/weights written in place: autograd follows the copies


def inputs(t_len: int = 5, s_len: int = 7, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    query = torch.randn(3, t_len, D, generator=g, dtype=torch.float64)
    source = torch.randn(3, s_len, D, generator=g, dtype=torch.float64)
    pad = torch.zeros(3, s_len, dtype=torch.bool)
    pad[1, s_len - 2:] = True
    pad[2, 2:] = True  # only two real keys: no 3-grams at all
    return query, source, pad


@pytest.mark.parametrize("ngrams", [[1, 2], [1, 2, 3], [2, 3]])
@pytest.mark.parametrize("kind", ["self", "causal", "cross"])
def test_matches_the_literal_equations(ngrams: list[int], kind: str) -> None:
    m = module(ngrams, self_attention=kind != "cross")
    query, source, pad = inputs()
    if kind == "self":
        query, args = source, dict(key_padding_mask=pad)
    elif kind == "causal":
        query, pad, args = source, None, dict(causal=True)
    else:
        args = dict(key_padding_mask=pad)
    out, weights = m(query, source, ctx=WEIGHTS, **args)
    ref_out, ref_weights = reference(m, query, source, pad, kind == "causal")
    torch.testing.assert_close(weights, ref_weights)
    torch.testing.assert_close(out, ref_out)


@pytest.mark.parametrize("ngrams", [[1, 2, 3], [2, 3]])
@pytest.mark.parametrize("kind", ["self", "causal", "cross"])
def test_gradients_match_the_literal_equations(ngrams: list[int], kind: str) -> None:
    m = module(ngrams, self_attention=kind != "cross")
    query, source, pad = inputs(t_len=4, s_len=6)
    source.requires_grad_(True)
    query = source if kind != "cross" else query.requires_grad_(True)
    args = dict(causal=True) if kind == "causal" else dict(key_padding_mask=pad)
    out, weights = m(query, source, ctx=WEIGHTS, **args)
    ref_out, ref_weights = reference(m, query, source, None if kind == "causal" else pad, kind == "causal")
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=out.dtype)
    gw = torch.randn(weights.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    wrt = {"source": source, **({"query": query} if kind == "cross" else {}), **dict(m.named_parameters())}
    grads = torch.autograd.grad((out * g).sum() + (weights * gw).sum(), list(wrt.values()))
    ref_grads = torch.autograd.grad((ref_out * g).sum() + (ref_weights * gw).sum(), list(wrt.values()))
    for name, grad, ref_grad in zip(wrt, grads, ref_grads):
        torch.testing.assert_close(grad, ref_grad, msg=lambda text, name=name: f"{name}: {text}")


def test_unigrams_only_is_standard_attention() -> None:
    m = module([1])
    std = MultiHeadAttention(D, H).double()
    std.load_state_dict(m.state_dict())
    _, source, pad = inputs()
    for kwargs in (dict(key_padding_mask=pad), dict(causal=True)):
        torch.testing.assert_close(m(source, source, **kwargs)[0], std(source, source, **kwargs)[0])


def test_no_future_leakage() -> None:
    m = module([1, 2, 3])
    _, source, _ = inputs(s_len=8)
    out, weights = m(source, source, causal=True, ctx=WEIGHTS)
    for p in range(1, 8):
        changed = source.clone()
        changed[:, p:] = torch.randn_like(changed[:, p:])
        torch.testing.assert_close(m(changed, changed, causal=True)[0][:, :p], out[:, :p])
    # a phrase is visible only when all its tokens are in the past or present
    for n, w in split_phrasal_weights(weights, m.ngrams, 8).items():
        last = torch.arange(w.size(-1)) + n - 1
        future = last[None, :] > torch.arange(8)[:, None]  # (T,S_n)
        assert w[..., future].abs().max() == 0


@pytest.mark.parametrize("self_attention", [True, False])
def test_padding_never_enters_a_phrase(self_attention: bool) -> None:
    m = module([1, 2, 3], self_attention=self_attention)
    query, source, pad = inputs()
    query = source if self_attention else query
    out, weights = m(query, source, key_padding_mask=pad, ctx=WEIGHTS)
    garbage = source.masked_fill(pad[..., None], 1e3)
    query2 = garbage if self_attention else query
    out2, _ = m(query2, garbage, key_padding_mask=pad)
    real = ~pad if self_attention else torch.ones_like(pad[:, :query.size(1)])
    torch.testing.assert_close(out2[real], out[real])
    for n, w in split_phrasal_weights(weights, m.ngrams, source.size(1)).items():
        has_pad = pad.unfold(1, n, 1).any(-1)  # (B,S_n)
        assert w.masked_select(has_pad[:, None, None, :]).abs().max() == 0
    torch.testing.assert_close(weights.sum(-1), torch.ones_like(weights.sum(-1)))


@pytest.mark.parametrize("s_len", [1, 2])
def test_keys_shorter_than_n(s_len: int) -> None:
    m = module([1, 2, 3], self_attention=False)
    query, source, _ = inputs(t_len=3, s_len=s_len)
    out, weights = m(query, source, ctx=WEIGHTS)
    assert weights.shape[-1] == sum(phrase_counts([1, 2, 3], s_len)) == (1 if s_len == 1 else 3)
    torch.testing.assert_close(out, reference(m, query, source, None, False)[0])
    # no key has an n-gram at all: nothing to attend to, a zero context (no NaN)
    m = module([2, 3], self_attention=False)
    out, weights = m(query, source[:, :1], ctx=WEIGHTS)
    assert weights.shape[-1] == 0 and out.abs().max() == 0
    # causal: the first query sees no bigram yet, and gets zero weights instead of NaN
    m = module([2])
    _, source, _ = inputs(s_len=5)
    out, weights = m(source, source, causal=True, ctx=WEIGHTS)
    assert torch.isfinite(out).all() and weights[:, :, 0].abs().max() == 0


@pytest.mark.parametrize("ngrams", [[1, 2, 3], [2, 4]])
@pytest.mark.parametrize("chunks", [[1] * 7, [3, 1, 3], [2, 5]])
@pytest.mark.parametrize("grad", [True, False])
def test_module_cache_equals_full_forward(ngrams: list[int], chunks: list[int], grad: bool) -> None:
    """Without autograd (decoding) one-position steps complete their phrases from the tail without PhraseSums."""
    m = module(ngrams)
    _, source, _ = inputs(s_len=7)
    full, full_w = m(source, source, causal=True, ctx=WEIGHTS)
    state: dict[str, torch.Tensor] = {}
    outs, start = [], 0
    for size in chunks:
        x = source[:, start:start + size]
        with torch.set_grad_enabled(grad):
            y, w = m(x, x, causal=True, state=state, ctx=WEIGHTS)
        outs.append(y)
        start += size
    torch.testing.assert_close(torch.cat(outs, 1), full)
    torch.testing.assert_close(w, full_w[:, :, -chunks[-1]:])
    assert all(k.startswith("attn.") and v.size(0) == 3 for k, v in state.items())
    # keys transposed and contiguous, one value slot per position and n, raw value projections of the last N-1 only
    assert state["attn.k"].shape == (3, H, D // H, 7) and state["attn.k"].is_contiguous()
    assert state["attn.v"].shape == (3, H, 7, len(ngrams) * D // H)
    assert state["attn.tail"].size(1) == max(ngrams) - 1


def test_cross_attention_cache_equals_full_forward() -> None:
    """Cached encoder keys, slot values and mask, over steps, with a sentence that has no bigram (a query that
    sees nothing: zero context) and one of padding only."""
    m = module([2, 3], self_attention=False)
    query, source, pad = inputs(t_len=4, s_len=6)
    pad[2, 1:] = True  # one real key: no 2- or 3-gram
    pad[0] = True
    full, full_w = m(query, source, key_padding_mask=pad, ctx=WEIGHTS)
    torch.testing.assert_close(full, reference(m, query, source, pad, False)[0])
    assert full[[0, 2]].abs().max() == 0 and full[1].abs().min() > 0
    state: dict[str, torch.Tensor] = {}
    steps = [m(query[:, i:i + 1], source, key_padding_mask=pad, state=state, ctx=WEIGHTS) for i in range(4)]
    torch.testing.assert_close(torch.cat([y for y, _ in steps], 1), full)
    torch.testing.assert_close(torch.cat([w for _, w in steps], 2), full_w)
    assert {k for k in state} == {"attn.static_k", "attn.static_v", "attn.static_bias", "attn.static_dead"}
    assert all(v.size(0) == 3 for v in state.values())


@pytest.mark.parametrize("ngrams", [[1, 2], [2, 3]])
@torch.no_grad()  # as beam search (the gather writes into its output)
def test_beam_reordered_caches_equal_decoding_the_reordered_prefixes(ngrams: list[int]) -> None:
    """Beam search's reordering (deferred for the transposed key and the slot value caches, then one gather and
    append; the tail by the search) gives what decoding the reordered prefixes from the start gives."""
    m = module(ngrams)
    _, source, _ = inputs(s_len=6)
    rows = torch.tensor([2, 0, 2])
    state: dict[str, torch.Tensor] = {}
    for i in range(3):
        m(source[:, i:i + 1], source[:, i:i + 1], causal=True, state=state)
    state = _reorder_state(state, rows, sentences_changed=False)
    assert "attn.rows" in state and state["attn.k"].size(0) == 3  # the gather is still pending
    source = torch.cat([source[rows, :3], source[:, 3:]], 1)
    steps = [m(source[:, i:i + 1], source[:, i:i + 1], causal=True, state=state)[0] for i in range(3, 6)]
    full, _ = m(source, source, causal=True)
    torch.testing.assert_close(torch.cat(steps, 1), full[:, 3:])


@pytest.mark.parametrize("ngrams", [[1, 2, 3], [2, 3]])
def test_decoding_step_bias_equals_the_general_mask(ngrams: list[int]) -> None:
    """The per-step bias taken from a table (grown past its first 64 positions) hides exactly the slots
    :func:`phrase_visibility` hides for the last query, and flags a query that sees nothing."""
    m = module(ngrams)
    for length in (1, 2, 5, 64, 65, 200, 3):
        bias, dead = m.unpadded_step_bias(length, torch.float64)
        visible = phrase_visibility(ngrams, length, 1, None, True, torch.device("cpu"))
        assert bias.shape == visible.shape and torch.equal(bias == 0, visible)
        assert bool((bias[~visible] == torch.finfo(torch.float64).min).all())
        assert (dead is not None and bool(dead.all())) == (not bool(visible.any()))


# ---- the whole Transformer with phrasal attention in every slot ------------------------------------------
V = 40


def transformer(ngrams: list[int], seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    slot = {"type": "phrasal", "ngrams": ngrams}
    cfg = load_config(data={"model": {"name": "transformer", "d_model": 32, "ffn_dim": 64, "heads": 4,
                                      "encoder_layers": 2, "decoder_layers": 2, "encoder_self_attention": slot,
                                      "decoder_self_attention": slot, "cross_attention": slot}})
    return build_model(cfg.model, Vocabularies(V, V)).eval()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    return padded_batch(V, seed=3, pad_from=(6, 2))


@pytest.mark.parametrize("ngrams", [[1, 2], [1, 2, 3]])
def test_transformer_incremental_equals_full(ngrams: list[int]) -> None:
    model = transformer(ngrams)
    src, tgt = batch()
    full = model(src, tgt)
    enc, state = model.encode(src), {}
    steps = [model.decode(tgt[:, t:t + 1], enc, state) for t in range(tgt.size(1))]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    enc, state = model.encode(src), {}
    chunks = [model.decode(tgt[:, :3], enc, state), model.decode(tgt[:, 3:], enc, state)]
    torch.testing.assert_close(torch.cat(chunks, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("ngrams", [[1, 2, 3], [2, 3]])
def test_transformer_decoder_sees_no_future_tokens(ngrams: list[int]) -> None:
    model = transformer(ngrams)
    src, tgt = batch()
    full = model(src, tgt)
    g = torch.Generator().manual_seed(4)
    for p in range(1, tgt.size(1)):
        changed = tgt.clone()
        changed[:, p:] = torch.randint(4, V, changed[:, p:].shape, generator=g)
        out = model(src, changed)
        torch.testing.assert_close(out[:, :p], full[:, :p])
        assert not torch.allclose(out[:, p:], full[:, p:])


def test_beam_and_greedy_search_agree_with_full_forward_scores() -> None:
    model = transformer([1, 2, 3])
    src, _ = batch()
    results = beam_search(model, src, beam_size=3, nbest=3, max_len_a=0.5, max_len_b=3)
    assert [len(nbest) for nbest in results] == [3, 3, 3]
    hyps = [h for nbest in results for h in nbest]
    rows = torch.arange(3).repeat_interleave(3)
    length = max(len(h.tokens) for h in hyps) + 1
    tgt_in = torch.full((len(hyps), length), PAD)
    tgt_out = torch.full((len(hyps), length), PAD)
    for r, h in enumerate(hyps):
        tgt_in[r, :len(h.tokens) + 1] = torch.tensor([BOS] + h.tokens)
        tgt_out[r, :len(h.tokens) + 1] = torch.tensor(h.tokens + [3])
    scores = sequence_logprobs(model, src[rows], tgt_in, tgt_out)
    torch.testing.assert_close(scores, torch.tensor([h.logprob for h in hyps]), atol=1e-4, rtol=1e-4)
    greedy = greedy_search(model, src, max_len_a=0.5, max_len_b=3)
    assert [h.tokens for h in greedy] == [nb[0].tokens for nb in beam_search(model, src, beam_size=1,
                                                                             max_len_a=0.5, max_len_b=3)]


def test_every_parameter_gets_a_gradient() -> None:
    model = transformer([1, 2, 3]).train()
    src, tgt = batch()
    model(src, tgt).logsumexp(-1).mean().backward()
    assert [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0] == []


# ---- sizes and configs ------------------------------------------------------------------------------------
def parameters(config: str, capsys: pytest.CaptureFixture[str]) -> int:
    assert main(["info", str(REPO / "configs" / config), "--vocab-size", "1000", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["parameters"]


@pytest.mark.parametrize("preset,delta", [("phrasal-12-base.yaml", 18_874_368), ("phrasal-123-base.yaml", 47_185_920),
                                          ("phrasal-1234-base.yaml", 18 * 2 * 9 * 512 ** 2),
                                          ("phrasal-12-small.yaml", 18 * 2 * 2 * 256 ** 2)])
def test_exact_parameter_deltas(preset: str, delta: int, capsys: pytest.CaptureFixture[str]) -> None:
    base = "transformer-base.yaml" if "base" in preset else "transformer-small.yaml"
    assert parameters(preset, capsys) - parameters(base, capsys) == delta


def test_bad_ngrams_are_config_errors() -> None:
    for bad in ([], [0, 1], [2, 1], [1, 1]):
        with pytest.raises(ConfigError, match="ngrams"):
            load_config(data={"model": {"name": "transformer", "cross_attention": {"type": "phrasal", "ngrams": bad}}})


@pytest.mark.parametrize("ngrams", [[1, 2, 3], [2, 4]])
@pytest.mark.parametrize("kind", ["self", "causal", "cross"])
@pytest.mark.parametrize("s_len", [5, 3])
def test_scores_without_autograd_equal_the_autograd_path(ngrams: list[int], kind: str, s_len: int) -> None:
    """Decoding writes the scaled phrase sums and the bias straight into the scores (no PhraseSums): the same
    outputs and weights, padding and keys shorter than n included."""
    m = module(ngrams, self_attention=kind != "cross")
    query, source, pad = inputs(t_len=4, s_len=s_len)
    query = source if kind != "cross" else query
    args = dict(key_padding_mask=pad, causal=kind == "causal")
    with_grad = m(query, source, ctx=WEIGHTS, **args)
    with torch.no_grad():
        without = m(query, source, ctx=WEIGHTS, **args)
    for a, b in zip(with_grad, without):
        torch.testing.assert_close(a.detach(), b)
