"""Beam search and greedy search over the incremental-state contract."""
from __future__ import annotations

import torch

from nmtflow.decode.search import beam_search, greedy_search, length_penalty, sequence_logprobs
from nmtflow.data.vocab import BOS, EOS, PAD

from tests.models.test_transformer import batch, make


def test_beam_one_equals_greedy() -> None:
    model = make(seed=5)
    src, _ = batch()
    greedy = greedy_search(model, src, max_len_a=1.0, max_len_b=5)
    beam = beam_search(model, src, beam_size=1, max_len_a=1.0, max_len_b=5, len_penalty=0.0)
    assert [h.tokens for h in greedy] == [b[0].tokens for b in beam]
    for g, b in zip(greedy, beam):
        assert abs(g.logprob - b[0].logprob) < 1e-4


def test_nbest_sorted_and_within_length_limits() -> None:
    model = make(seed=6)
    src, _ = batch()
    results = beam_search(model, src, beam_size=4, nbest=4, max_len_a=0.0, max_len_b=6)
    for hyps in results:
        assert len(hyps) == 4
        assert [h.score for h in hyps] == sorted((h.score for h in hyps), reverse=True)
        assert all(len(h.tokens) <= 6 and EOS not in h.tokens and PAD not in h.tokens for h in hyps)
        assert all(abs(h.score - h.logprob / length_penalty(len(h.tokens) + 1, 0.6)) < 1e-5 for h in hyps)


def test_batched_search_equals_one_sentence_at_a_time() -> None:
    """Finished-sentence pruning and beam reordering must not mix sentences up."""
    model = make(seed=7)
    src, _ = batch()
    together = beam_search(model, src, beam_size=3, nbest=2)
    for i in range(src.size(0)):
        row = src[i:i + 1, : int(src[i].ne(PAD).sum())]
        alone = beam_search(model, row, beam_size=3, nbest=2)[0]
        assert [h.tokens for h in alone] == [h.tokens for h in together[i]]


def test_best_hypothesis_score_is_its_model_logprob() -> None:
    model = make(seed=8)
    src, _ = batch()
    hyp = beam_search(model, src[:1], beam_size=3, len_penalty=0.0)[0][0]
    tgt_in = torch.tensor([[BOS] + hyp.tokens])
    tgt_out = torch.tensor([hyp.tokens + [EOS]])
    lp = sequence_logprobs(model, src[:1], tgt_in, tgt_out)
    assert abs(float(lp) - hyp.logprob) < 1e-4


def test_top_candidates_equals_topk() -> None:
    from nmtflow.decode.search import top_candidates

    g = torch.Generator().manual_seed(0)
    for n, width, count in [(3, 5 * 8000, 10), (4, 40000, 2), (2, 997, 10), (1, 64 * 40, 10)]:
        scores = torch.randn(n, width, generator=g)
        scores[0, : width // 2] = float("-inf")  # long runs of impossible candidates
        values, indices = top_candidates(scores, count)
        ref_values, ref_indices = scores.topk(count, dim=1)
        torch.testing.assert_close(values, ref_values)
        assert torch.equal(indices, ref_indices)


def test_extend_cache_gathers_then_appends() -> None:
    from nmtflow.nn.attention import extend_cache

    cache, new = torch.randn(4, 2, 3, 5), torch.randn(4, 2, 1, 5)
    rows = torch.tensor([2, 2, 0, 3])
    assert torch.equal(extend_cache(cache, new, rows), torch.cat([cache[rows], new], dim=2))
    assert torch.equal(extend_cache(cache, new), torch.cat([cache, new], dim=2))


def test_deferred_reorders_compose_with_sentence_pruning() -> None:
    """Two reorders before the cache is next extended read the cache as if gathered twice."""
    from nmtflow.decode.search import _reorder_state
    from nmtflow.nn.attention import extend_cache

    cache = torch.randn(6, 2, 3, 4)
    state = {"dec.attn.k": cache, "dec.attn.v": cache + 1, "dec.static_k": torch.randn(6, 2, 5, 4)}
    first, second = torch.tensor([1, 1, 0, 5, 4, 3]), torch.tensor([2, 3, 4])
    state = _reorder_state(_reorder_state(state, first, False), second, True)
    assert state["dec.attn.k"] is cache  # nothing copied yet
    new = torch.randn(3, 2, 1, 4)
    got = extend_cache(state["dec.attn.k"], new, state["dec.attn.rows"])
    assert torch.equal(got, torch.cat([cache[first][second], new], dim=2))
    assert state["dec.static_k"].size(0) == 3
