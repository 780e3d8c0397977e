"""Review of phrasal attention (SPEC §3), ConvS2S / DenseNMT (SPEC §1, §4) and the language model: config errors
that name their option, and the properties the module-level tests leave open at model level (padding of whole
batches, causality and caches of the remaining variants, beam pruning, bf16 autocast)."""
from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from nmtflow.config import ConfigError, load_config
from nmtflow.data.vocab import BOS, EOS, PAD
from nmtflow.decode.search import beam_search, sequence_logprobs
from nmtflow.models.base import Vocabularies, build_model
from tests.conftest import padded_batch
from tests.models.test_convs2s import TINY, V


pytestmark = pytest.mark.usefixtures("one_thread")


CONV = TINY


def phrasal_slots(ngrams: list[int]) -> dict[str, Any]:
    slot = {"type": "phrasal", "ngrams": ngrams}
    return {"encoder_self_attention": slot, "decoder_self_attention": slot, "cross_attention": slot}


MODELS: dict[str, dict[str, Any]] = {
    "phrasal-23": dict(name="transformer", d_model=32, ffn_dim=64, heads=4, encoder_layers=2, decoder_layers=2,
                       **phrasal_slots([2, 3])),  # no unigrams: short sentences have no phrase at all
    "phrasal-1234": dict(name="transformer", d_model=32, ffn_dim=64, heads=4, encoder_layers=1, decoder_layers=2,
                         **phrasal_slots([1, 2, 3, 4])),
    "lm-phrasal-24": dict(name="lm", d_model=32, ffn_dim=64, heads=4, layers=2,
                          self_attention={"type": "phrasal", "ngrams": [2, 4]}),
    "convs2s-k5": dict(name="convs2s", **{**CONV, "kernel_size": 5}),
    "densenmt-1": dict(name="densenmt", attention="dense1", **CONV),
    "densenmt-sumlen2": dict(name="densenmt", **{**CONV, "encoder_layers": 3, "decoder_layers": 3}, sumlen=2),
}


def make(variant: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(load_config(data={"model": MODELS[variant]}).model, Vocabularies(V, V)).eval()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Sources of 9, 6 and 2 tokens (the last shorter than every n-gram of size 3 and 4); targets start with BOS."""
    return padded_batch(V, seed=1, pad_from=(6, 2), tgt_len=8)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ---- config errors name their option ------------------------------------------------------------------
@pytest.mark.parametrize("model,option", [
    (dict(name="convs2s", kernel_size=2), "model.kernel_size"),
    (dict(name="densenmt", kernel_size=4), "model.kernel_size"),
    (dict(name="convs2s", layer_groups=[(2, 16, 3), (1, 16, 2)]), r"model.layer_groups\[1\]"),
])
def test_an_even_encoder_kernel_is_an_error_naming_its_option(model: dict[str, Any], option: str) -> None:
    """The encoder's convolutions are centred (kernel 2r + 1, SPEC §4): an even kernel names ``kernel_size`` or
    the layer group it came from (the error named only ``model``)."""
    with pytest.raises(ConfigError, match=option):
        load_config(data={"model": {**CONV, **model}})


@pytest.mark.parametrize("name", ["convs2s", "densenmt"])
def test_empty_layer_groups_are_an_error_not_the_default_layout(name: str) -> None:
    """``layer_groups: []`` used to fall back silently to ``encoder_layers`` × ``hidden``."""
    with pytest.raises(ConfigError, match="model.layer_groups: empty"):
        load_config(data={"model": {**CONV, "name": name, "layer_groups": []}})


def test_kernel_size_is_not_checked_where_layer_groups_replace_it() -> None:
    cfg = load_config(data={"model": {**CONV, "name": "convs2s", "kernel_size": 2, "layer_groups": [(1, 16, 3)]}})
    assert cfg.model.specs(1, False) == [(16, 3)]


# ---- padding, causality and caches at model level ---------------------------------------------------------
@pytest.mark.parametrize("variant", ["phrasal-23", "phrasal-1234", "convs2s-k5", "densenmt-sumlen2"])
def test_a_sentence_does_not_depend_on_the_padding_or_the_rest_of_its_batch(variant: str) -> None:
    """Phrases with padding are masked (SPEC §3), conv kernels read zeros past a sentence's end (SPEC §4):
    each sentence alone, unpadded, gives what it gives in the padded batch, with or without extra padding; real
    target positions do not depend on the target padding either."""
    model = make(variant)
    src, tgt = batch()
    with torch.no_grad():
        full = model(src, tgt)
        close(model(torch.cat([src, torch.full((3, 4), PAD)], 1), tgt), full)
        for i in range(3):
            length = int(src[i].ne(PAD).sum())
            close(model(src[i:i + 1, :length], tgt[i:i + 1]), full[i:i + 1])
        short = tgt.clone()
        short[1, 5:] = PAD
        close(model(src, short)[1, :5], full[1, :5])


@pytest.mark.parametrize("variant", list(MODELS))
def test_no_future_leakage_and_any_chunking_of_the_cache_equals_the_full_forward(variant: str) -> None:
    """Future target tokens change no earlier output; decoding in steps or chunks (phrases and conv windows
    spanning the cache boundary) gives the full forward's logits."""
    model = make(variant)
    src, tgt = batch()
    with torch.no_grad():
        full = model(src, tgt)
        for t in range(1, tgt.size(1)):
            changed = tgt.clone()
            changed[:, t:] = torch.randint(4, V, changed[:, t:].shape, generator=torch.Generator().manual_seed(t))
            close(model(src, changed)[:, :t], full[:, :t])
        for chunks in ([1] * 8, [2, 3, 3], [3, 5]):
            enc, state, outs, start = model.encode(src), {}, [], 0
            for size in chunks:
                outs.append(model.decode(tgt[:, start:start + size], enc, state))
                start += size
            close(torch.cat(outs, 1), full)


@pytest.mark.parametrize("variant", ["phrasal-23", "convs2s-k5", "densenmt-sumlen2", "lm-phrasal-24"])
def test_beam_search_with_sentences_finishing_at_different_steps_scores_as_the_full_forward(variant: str) -> None:
    """Length limits that differ per sentence prune finished sentences from the caches mid-search (static
    encoder-side caches included); every hypothesis still scores what a full forward scores."""
    model = make(variant)
    src, _ = batch()
    results = beam_search(model, src, beam_size=3, nbest=3, max_len_a=1.0, max_len_b=1)
    for i, hyps in enumerate(results):
        for h in hyps:
            expected = sequence_logprobs(model, src[i:i + 1], torch.tensor([[BOS] + h.tokens]),
                                         torch.tensor([h.tokens + [EOS]]))
            assert math.isclose(h.logprob, float(expected), rel_tol=1e-4, abs_tol=1e-4)


@pytest.mark.parametrize("variant", list(MODELS))
def test_bf16_autocast_on_cpu_is_finite_and_reaches_every_parameter(variant: str) -> None:
    model = make(variant).train()
    src, tgt = batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(src, tgt)
    assert torch.isfinite(logits).all()
    logits.float().logsumexp(-1).mean().backward()
    assert [n for n, p in model.named_parameters()
            if p.grad is None or not torch.isfinite(p.grad).all() or not p.grad.abs().sum() > 0] == []
