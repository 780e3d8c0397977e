"""Sampling, forced target prefixes and min_len in the search functions, for every kind of decoder state and for
an ensemble; the sampling distribution (temperature, top-k, nucleus) on hand-built distributions."""
from __future__ import annotations

import pytest
import torch

from nmtflow.data.vocab import BOS, EOS
from nmtflow.decode.ensemble import Ensemble
from nmtflow.decode.search import (beam_search, draw, greedy_search, sample_search, sampling_distribution,
                                   sequence_logprobs)

from tests.conftest import padded_batch
from tests.decode.test_ensemble import V, member

pytestmark = pytest.mark.usefixtures("one_thread")
ARCHITECTURES = ["transformer", "feature-fusion", "phrasal", "convs2s", "rnn"]
LIMIT = {"max_len_a": 0.0, "max_len_b": 8}


@pytest.fixture(scope="module", params=ARCHITECTURES + ["ensemble"])
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    if request.param == "ensemble":
        return Ensemble([member("transformer", 1), member("rnn", 2)]).eval()
    return member(request.param, 3)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tokens(results: list[list]) -> list[list[list[int]]]:
    return [[h.tokens for h in hyps] for hyps in results]


def test_samples_are_reproducible_for_a_seed_and_differ_across_seeds(model: torch.nn.Module) -> None:
    src, _ = padded_batch(V)
    first = sample_search(model, src, nbest=4, generator=seeded(1), **LIMIT)
    assert [len(hyps) for hyps in first] == [4, 4, 4]
    assert tokens(sample_search(model, src, nbest=4, generator=seeded(1), **LIMIT)) == tokens(first)
    assert tokens(sample_search(model, src, nbest=4, generator=seeded(2), **LIMIT)) != tokens(first)
    assert len({tuple(h.tokens) for hyps in first for h in hyps}) > 3  # the samples of one sentence differ too


def test_a_sample_scores_its_model_logprob(model: torch.nn.Module) -> None:
    """The B·N samples decode as one batch through the incremental state; each one's score is log P(y|x) of the
    model (no temperature, no length normalisation), as the teacher-forced full forward gives it."""
    src, _ = padded_batch(V)
    for i, hyps in enumerate(sample_search(model, src, nbest=3, temperature=1.5, generator=seeded(3), **LIMIT)):
        for h in hyps:
            assert len(h.tokens) <= 8 and EOS not in h.tokens and BOS not in h.tokens
            lp = sequence_logprobs(model, src[i:i + 1], torch.tensor([[BOS] + h.tokens]), torch.tensor([h.tokens + [EOS]]))
            assert h.score == h.logprob and abs(float(lp) - h.logprob) < 1e-3


def test_one_forward_per_step_for_all_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    model = member("transformer", 3)
    src, _ = padded_batch(V)
    rows: list[int] = []
    decode = model.decode
    monkeypatch.setattr(model, "decode", lambda tgt_in, enc, state=None: rows.append(tgt_in.size(0))
                        or decode(tgt_in, enc, state))
    results = sample_search(model, src, nbest=5, generator=seeded(4), **LIMIT)
    assert rows[0] == 15 and len(rows) == max(len(h.tokens) for hyps in results for h in hyps) + 1
    assert rows == sorted(rows, reverse=True)  # finished samples leave the batch


def test_top_k_one_and_a_tiny_temperature_sample_the_greedy_output(model: torch.nn.Module) -> None:
    src, _ = padded_batch(V)
    greedy = greedy_search(model, src, **LIMIT)
    for options in ({"top_k": 1}, {"temperature": 1e-4}, {"top_p": 0.0}):
        for g, hyps in zip(greedy, sample_search(model, src, nbest=2, generator=seeded(5), **options, **LIMIT)):
            assert all(h.tokens == g.tokens and abs(h.logprob - g.logprob) < 1e-4 for h in hyps)
    plain = sample_search(model, src, nbest=2, generator=seeded(5), **LIMIT)
    assert any(h.tokens != g.tokens for g, hyps in zip(greedy, plain) for h in hyps)  # (the test can fail)


def test_min_len_holds_for_every_search(model: torch.nn.Module) -> None:
    src, _ = padded_batch(V)
    limit = {"max_len_a": 0.0, "max_len_b": 12, "min_len": 6}
    outputs = [h.tokens for h in greedy_search(model, src, **limit)]
    outputs += [h.tokens for hyps in beam_search(model, src, beam_size=3, nbest=3, **limit) for h in hyps]
    outputs += [h.tokens for hyps in sample_search(model, src, nbest=4, generator=seeded(6), **limit) for h in hyps]
    assert min(len(t) for t in outputs) >= 6 and max(len(t) for t in outputs) <= 12
    short = [len(h.tokens) for hyps in sample_search(model, src, nbest=4, generator=seeded(6), max_len_a=0.0,
                                                      max_len_b=12, min_len=20) for h in hyps]
    assert short == [12] * 12  # the length limit wins over min_len


def test_a_prefix_of_the_greedy_output_continues_as_the_greedy_output(model: torch.nn.Module) -> None:
    src, _ = padded_batch(V)
    free = greedy_search(model, src, **LIMIT)
    prefixes = [free[0].tokens[:3], [], free[2].tokens[:1]]
    forced = greedy_search(model, src, prefixes=prefixes, **LIMIT)
    assert [h.tokens for h in forced] == [h.tokens for h in free]
    assert all(abs(f.logprob - h.logprob) < 1e-4 for f, h in zip(forced, free))


def test_every_search_starts_with_its_prefix(model: torch.nn.Module) -> None:
    """Arbitrary prefixes (one longer than the length limit, which is raised to hold it), beside a sentence
    without one, which decodes as without prefixes."""
    src, _ = padded_batch(V)
    prefixes = [[7, 7, 9], [], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]
    results = [[[h] for h in greedy_search(model, src, prefixes=prefixes, **LIMIT)],
               beam_search(model, src, beam_size=3, nbest=3, prefixes=prefixes, **LIMIT),
               sample_search(model, src, nbest=3, generator=seeded(7), prefixes=prefixes, **LIMIT)]
    for found in results:
        for hyps, prefix in zip(found, prefixes):
            assert hyps and all(h.tokens[:len(prefix)] == prefix for h in hyps)
            assert all(len(h.tokens) <= max(8, len(prefix)) for h in hyps)
    free = beam_search(model, src, beam_size=3, nbest=3, **LIMIT)
    assert tokens(results[1])[1] == tokens(free)[1]
    hyp = results[1][2][0]  # a forced prefix counts in the score: log P(prefix + continuation | x)
    lp = sequence_logprobs(model, src[2:3], torch.tensor([[BOS] + hyp.tokens]), torch.tensor([hyp.tokens + [EOS]]))
    assert abs(float(lp) - hyp.logprob) < 1e-3


def test_a_prefix_longer_than_the_decoder_writes_is_an_error() -> None:
    model = member("transformer", 3)  # max_positions 1024 by default: 1023 output tokens
    src, _ = padded_batch(V)
    with pytest.raises(ValueError, match="a prefix of 1024 tokens; the model writes at most 1023"):
        greedy_search(model, src, prefixes=[[5] * 1024, [], []])


# ---- the sampling distribution ----------------------------------------------------------------------------------
P = torch.tensor([[0.5, 0.3, 0.15, 0.05]])


@pytest.mark.parametrize("options, kept", [
    ({"top_p": 0.7}, [0, 1]),
    ({"top_p": 0.85}, [0, 1, 2]),
    ({"top_p": 0.4}, [0]),
    ({"top_p": 0.0}, [0]),
    ({"top_p": 1.0}, [0, 1, 2, 3]),
    ({"top_k": 2}, [0, 1]),
    ({"top_k": 3, "top_p": 0.7}, [0, 1]),
    ({"top_k": 0}, [0, 1, 2, 3]),
])
def test_top_k_and_the_nucleus_keep_the_most_likely_tokens(options: dict, kept: list[int]) -> None:
    order = torch.tensor([2, 0, 3, 1])  # the same distribution, not in rank order
    weights = sampling_distribution(P[:, order].log(), **options)
    finite = sorted(order[i].item() for i in weights[0].isfinite().nonzero().flatten().tolist())
    assert finite == kept
    expect = P[0, kept] / P[0, kept].sum()  # the kept tokens renormalised
    torch.testing.assert_close(weights[0].softmax(-1)[order.argsort()][kept], expect)


def test_temperature_sharpens_and_flattens() -> None:
    for t in (0.5, 2.0):
        expect = P ** (1 / t) / (P ** (1 / t)).sum()
        torch.testing.assert_close(sampling_distribution(P.log(), temperature=t).softmax(-1), expect)


def test_draws_follow_the_nucleus_distribution() -> None:
    weights = sampling_distribution(P.log().expand(40000, -1), top_p=0.7)
    counts = torch.bincount(draw(weights, seeded(8)), minlength=4).double() / 40000
    assert counts[2:].sum() == 0
    assert abs(counts[0] - 0.5 / 0.8) < 0.015  # 0.625 ± 6 standard deviations
    counts = torch.bincount(draw(P.log().expand(40000, -1), seeded(9)), minlength=4).double() / 40000
    torch.testing.assert_close(counts, P[0].double(), atol=0.015, rtol=0)
