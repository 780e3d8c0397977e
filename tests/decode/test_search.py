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
