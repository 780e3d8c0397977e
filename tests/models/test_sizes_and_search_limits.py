"""Model sizes that cannot work are config errors when read; the searches at their length and beam limits."""
from __future__ import annotations

import pytest
import torch

from nmtflow.config import ConfigError, load_config
from nmtflow.data.vocab import BOS, EOS, PAD
from nmtflow.decode.search import beam_search, greedy_search, sequence_logprobs
from nmtflow.models.base import Vocabularies, build_model

V = 30
TINY = {"name": "transformer", "d_model": 16, "ffn_dim": 32, "heads": 2, "encoder_layers": 1, "decoder_layers": 1}


def make(vocab: int = V, **model: object) -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = load_config(data={"model": {**TINY, **model}})
    return build_model(cfg.model, Vocabularies(vocab, vocab)).eval()


@pytest.mark.parametrize("model", [
    {**TINY, "heads": 0},
    {**TINY, "heads": -2},
    {**TINY, "heads": 3},
    {**TINY, "d_model": 0},
    {**TINY, "activation": "tanh"},
    {**TINY, "dropout": 1.0},
    {**TINY, "max_positions": 0},
    {"name": "lm", "d_model": 16, "ffn_dim": 32, "heads": 0, "layers": 1},
    {"name": "lm", "d_model": 16, "ffn_dim": 32, "heads": -2, "layers": 1},
    {"name": "language_label", "backbone": {**TINY, "heads": 0}},
    {"name": "bridge", "hidden_dim": 16, "heads": 0, "encoder": "transformer"},
    {"name": "bridge", "hidden_dim": 16, "heads": -2, "decoder": "transformer"},
    {"name": "bridge", "hidden_dim": 16, "encoder_layers": 0},
    {"name": "rnn", "hidden_dim": 0},
    {"name": "convs2s", "embed_dim": 16, "hidden": 16, "dropout": 1.0},
    {"name": "convs2s", "embed_dim": 16, "hidden": 16, "layer_groups": [[0, 8, 3]]},
    {"name": "convs2s", "embed_dim": 16, "hidden": 16, "layer_groups": [[1, 0, 3]]},
])
def test_invalid_model_sizes_are_config_errors(model: dict) -> None:
    """A bad size is a ConfigError when the config is read, not a crash while building or running the model."""
    with pytest.raises(ConfigError):
        load_config(data={"model": model})


def sources() -> torch.Tensor:
    src = torch.randint(4, V, (3, 6), generator=torch.Generator().manual_seed(1))
    src[1, 4:] = PAD
    src[2, 2:] = PAD
    return src


def test_length_limit_wins_over_min_len() -> None:
    """With min_len beyond a sentence's length limit the limit still ends every hypothesis with a real EOS."""
    model, src = make(), sources()
    kw = dict(max_len_a=0.0, max_len_b=2, min_len=5)
    beams = beam_search(model, src, beam_size=3, nbest=2, **kw)
    greedy = greedy_search(model, src, **kw)
    for i, (nbest, g) in enumerate(zip(beams, greedy)):
        assert len(nbest) == 2
        for h in nbest + [g]:
            assert len(h.tokens) == 2 and h.logprob > float("-inf")
            tgt_in, tgt_out = torch.tensor([[BOS] + h.tokens]), torch.tensor([h.tokens + [EOS]])
            ref = float(sequence_logprobs(model, src[i:i + 1], tgt_in, tgt_out)[0])
            assert h.logprob == pytest.approx(ref, abs=1e-4)
    assert [b[0].tokens for b in beam_search(model, src, beam_size=1, **kw)] == [g.tokens for g in greedy]


def test_beam_wider_than_the_vocabulary() -> None:
    """A beam wider than the vocabulary keeps the hypotheses it can find instead of failing in topk."""
    model = make(vocab=6)
    src = torch.tensor([[4, 5, 3], [5, 3, 0]])
    for nbest in beam_search(model, src, beam_size=8, nbest=2, max_len_b=3):
        assert len(nbest) == 2 and all(h.logprob > float("-inf") for h in nbest)


@pytest.mark.parametrize("model", [{}, {"name": "convs2s", "embed_dim": 16, "hidden": 16,
                                        "layer_groups": [[1, 16, 3]]}], ids=["transformer", "convs2s"])
def test_outputs_may_fill_the_positions_training_allows(model: dict) -> None:
    """A target of P − 1 tokens plus EOS trains in P positions (BOS + P − 1 inputs); decoding reaches it too."""
    positions = 8
    torch.manual_seed(0)
    cfg = load_config(data={"model": {**(model or TINY), "max_positions": positions}})
    net = build_model(cfg.model, Vocabularies(V, V)).eval()
    src = torch.randint(4, V, (2, 5))
    beam = beam_search(net, src, beam_size=3, max_len_a=0.0, max_len_b=100, min_len=100)
    assert [len(hyps[0].tokens) for hyps in beam] == [positions - 1] * 2
    assert all(len(h.tokens) <= positions - 1 for h in greedy_search(net, src, max_len_a=0.0, max_len_b=100))
