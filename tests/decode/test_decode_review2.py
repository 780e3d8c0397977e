"""Second review of decoding: ensembles against brute force, ensemble directions, contrastive ties and NaN scores,
perplexity against a hand computation, host round trips of the searches."""
from __future__ import annotations

import itertools
import math
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nmtflow.checkpoint import CheckpointError
from nmtflow.config import DecodeConfig, load_config
from nmtflow.data.bitext import open_bitext
from nmtflow.data.prepare import load_meta
from nmtflow.data.tokenizer import Tokenizer
from nmtflow.data.vocab import BOS, EOS, PAD
from nmtflow.decode import search
from nmtflow.decode.contrastive import contrastive_accuracy
from nmtflow.decode.ensemble import Ensemble, ensemble_translator
from nmtflow.decode.search import beam_search, greedy_search, length_penalty
from nmtflow.decode.translate import Translator
from nmtflow.evaluate.perplexity import corpus_perplexity
from nmtflow.models.base import Vocabularies, build_model

from tests.conftest import padded_batch, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = {"name": "transformer", "d_model": 16, "ffn_dim": 32, "heads": 2, "encoder_layers": 1, "decoder_layers": 1}


def make(vocab: int, seed: int, scale: float = 1.0, **model: object) -> torch.nn.Module:
    """A tiny random Transformer; ``scale`` sharpens its distributions (clear winners, no near-ties)."""
    torch.manual_seed(seed)
    net = build_model(load_config(data={"model": {**TINY, **model}}).model, Vocabularies(vocab, vocab)).eval()
    with torch.no_grad():
        for p in net.parameters():
            p.mul_(scale)
    return net


# ---- ensembles -------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_ensemble_beam_search_is_the_brute_force_best_of_the_mean_probabilities() -> None:
    """On a 6-id vocabulary (3 outputs besides EOS) and at most 3 output tokens, a beam of 64 holds every
    hypothesis: its n-best list must be the exact top of all 40 outputs under log mean_i p_i, length-normalised."""
    vocab, limit = 6, 3
    members = [make(vocab, 0, 3.0), make(vocab, 1, 3.0)]
    ensemble = Ensemble(members).eval()
    src = torch.tensor([[4, 5, 4, EOS], [5, EOS, PAD, PAD]])
    outputs = [seq for n in range(limit + 1) for seq in itertools.product([1, 4, 5], repeat=n)]
    for alpha in (0.0, 1.0):
        found = beam_search(ensemble, src, beam_size=64, nbest=8, max_len_a=0, max_len_b=limit, len_penalty=alpha)
        for i, hyps in enumerate(found):
            row = src[i:i + 1, :int(src[i].ne(PAD).sum())]
            brute = []
            for seq in outputs:
                tgt_in = torch.tensor([[BOS, *seq]])
                mean = torch.stack([m(row, tgt_in).double().softmax(-1) for m in members]).mean(0)[0]
                logprob = sum(math.log(mean[t, tok]) for t, tok in enumerate([*seq, EOS]))
                brute.append((logprob / length_penalty(len(seq) + 1, alpha), list(seq)))
            brute.sort(key=lambda x: -x[0])
            assert [h.tokens for h in hyps] == [seq for _, seq in brute[:8]]
            assert [h.score for h in hyps] == pytest.approx([s for s, _ in brute[:8]], abs=1e-4)


def _translator(copy_data: Path, tmp_path: Path, src: str, tgt: str) -> Translator:
    cfg = tiny_config(copy_data, tmp_path)
    cfg.data.src_lang, cfg.data.tgt_lang = src, tgt
    tok = Tokenizer(copy_data / load_meta(copy_data)["tokenizers"]["src"])  # joint: one model for both sides
    return Translator(make(len(tok), 0), tok, tok, DecodeConfig(), cfg)


def test_ensemble_members_must_translate_the_same_direction(copy_data: Path, tmp_path: Path) -> None:
    """Before: with a joint vocabulary a src→tgt and a tgt→src model ensembled silently (and the perplexity of
    such an "ensemble" was reported in the first one's direction)."""
    forward = _translator(copy_data, tmp_path, "src", "tgt")
    backward = _translator(copy_data, tmp_path, "tgt", "src")
    assert isinstance(ensemble_translator([forward, forward], ["a.pt", "b.pt"]).model, Ensemble)
    with pytest.raises(CheckpointError, match=r"^b\.pt: translates tgt→src, unlike a\.pt \(src→tgt\)"):
        ensemble_translator([forward, backward], ["a.pt", "b.pt"])


# ---- contrastive scoring ---------------------------------------------------------------------------------------
class NoisyScorer:
    """Scores ``-len(target)`` plus batch-composition noise (1e-6 · position in the call), like a real batched
    model scoring the same pair in two batches; whitespace tokenizer."""

    class tgt_tokenizer:  # noqa: N801 - the Translator attribute it stands for
        @staticmethod
        def encode_batch(lines: list[str]) -> list[list[int]]:
            return [[len(w) for w in line.split()] for line in lines]

    def __init__(self, nan_at: str | None = None) -> None:
        self.nan_at = nan_at

    def score(self, sources: list[str], targets: list[str], *, where: object = None) -> list[float]:
        return [math.nan if t == self.nan_at else -len(t.split()) - 1e-6 * n for n, t in enumerate(targets)]


def test_a_candidate_that_tokenises_as_the_correct_one_is_a_tie(tmp_path: Path) -> None:
    """Before: an incorrect candidate equal to the correct translation (or differing in spacing only) scored a
    hair lower or higher depending on the batch it landed in, so the tie counted as correct at some
    ``--batch-tokens``."""
    cands = tmp_path / "c.tsv"
    cands.write_text("a b\tx y\tx y\n"  # the same string: a tie
                     "a b\tx y\tx  y\tz\n"  # spacing only: a tie
                     "a b\tx y\tx y z\n", encoding="utf-8")  # really worse: correct
    result = contrastive_accuracy(NoisyScorer(), cands)
    assert (result["correct"], result["total"]) == (1, 3)


def test_a_nan_score_in_contrastive_scoring_is_an_error_naming_the_line(tmp_path: Path) -> None:
    """Before: NaN compared false, so a diverged model's lines silently counted as wrong."""
    cands = tmp_path / "c.tsv"
    cands.write_text("a\tx\ty\nb\tx\ty\na\tx\tboom\n", encoding="utf-8")  # (a blank line is an error)
    message = f"{cands}:3: field 3 (an incorrect translation): the model's score is NaN"
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        contrastive_accuracy(NoisyScorer(nan_at="boom"), cands)


# ---- perplexity ------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_perplexity_is_exp_of_the_mean_token_nll_whatever_the_batching(copy_data: Path) -> None:
    """Label smoothing (the config's default 0.1) must not enter: plain NLL over every non-pad target token."""
    data = open_bitext(copy_data, "valid", "src", "tgt")
    model = make(len(Tokenizer(copy_data / load_meta(copy_data)["tokenizers"]["tgt"])), 3)
    nll, tokens = 0.0, 0
    for i in range(len(data)):
        b = data.batch(np.array([i]))
        lp = F.log_softmax(model(b.src, b.tgt_in).double(), -1).gather(-1, b.tgt_out[..., None])
        nll -= float(lp.sum())
        tokens += int(b.tgt_out.ne(PAD).sum())
    for max_tokens in (1, 64, 100000):  # batches of one, padded batches, one batch
        result = corpus_perplexity(model, data, max_tokens)
        assert result.tokens == tokens and result.sentences == len(data)
        assert result.nll == pytest.approx(nll / tokens, rel=1e-5)
        assert result.ppl == pytest.approx(math.exp(nll / tokens), rel=1e-5)


# ---- host round trips in the searches --------------------------------------------------------------------------
def _count_host_reads(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of ``Tensor.tolist`` and ``int(tensor)`` called by the search module itself (not the models): each
    a device → host copy (a sync on a GPU)."""
    calls = {"tolist": 0, "int": 0}
    tolist, to_int = torch.Tensor.tolist, torch.Tensor.__int__

    def by_search() -> bool:
        return sys._getframe(2).f_code.co_filename == search.__file__

    def counted_tolist(self: torch.Tensor) -> object:
        calls["tolist"] += by_search()
        return tolist(self)

    def counted_int(self: torch.Tensor) -> int:
        calls["int"] += by_search()
        return to_int(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)
    monkeypatch.setattr(torch.Tensor, "__int__", counted_int)
    return calls


def test_greedy_search_reads_its_output_once_not_per_step_and_sentence(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: two ``tolist`` per step and an ``int(alive[i])`` per sentence and step (a Python loop over the
    batch in the hot loop); now the picks stay on the device until the end."""
    model = make(24, 0)
    src, _ = padded_batch(24)
    expected = greedy_search(model, src, max_len_a=0, max_len_b=12)
    calls = _count_host_reads(monkeypatch)
    found = greedy_search(model, src, max_len_a=0, max_len_b=12)
    assert [(h.tokens, h.logprob) for h in found] == [(h.tokens, h.logprob) for h in expected]
    assert max(len(h.tokens) for h in found) >= 5  # several steps were taken
    assert calls["tolist"] <= 3 and calls["int"] <= 1


def test_beam_search_reads_no_tensor_per_sentence_and_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: ``int(sentence_ids[i])`` for every live sentence at every step (the finished counts) and the whole
    token matrix as lists whenever a hypothesis ended."""
    model = make(24, 0)
    src, _ = padded_batch(24)
    expected = beam_search(model, src, beam_size=3, nbest=3, max_len_a=0, max_len_b=12)
    calls = _count_host_reads(monkeypatch)
    found = beam_search(model, src, beam_size=3, nbest=3, max_len_a=0, max_len_b=12)
    assert [[(h.tokens, h.logprob) for h in hyps] for hyps in found] == \
        [[(h.tokens, h.logprob) for h in hyps] for hyps in expected]
    assert calls["int"] <= 1
