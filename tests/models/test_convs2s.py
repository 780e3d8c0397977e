"""ConvS2S and DenseNMT: causality, incremental decoding and beam search, summary layers, dense attention,
presets and their parameter budgets, gradient flow, and training through the Trainer."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from nmtflow.cli import main as cli
from nmtflow.config import load_config, to_dict
from nmtflow.data.vocab import BOS, EOS
from nmtflow.decode.search import beam_search, greedy_search, sequence_logprobs
from nmtflow.decode.translate import Translator
from nmtflow.models.base import Vocabularies, build_model, count_parameters
from nmtflow.nn.conv import GLUConv
from nmtflow.train.trainer import Trainer, read_log

from tests.conftest import padded_batch

from tests.conftest import tiny_config

REPO = Path(__file__).resolve().parents[2]


pytestmark = pytest.mark.usefixtures("one_thread")


V = 40
TINY = dict(embed_dim=32, hidden=32, growth=16, encoder_layers=2, decoder_layers=2, dropout=0.1)
VARIANTS: dict[str, dict[str, object]] = {
    "convs2s": dict(name="convs2s"),
    "densenmt-1": dict(name="densenmt", attention="dense1"),
    "densenmt-2": dict(name="densenmt", attention="dense2"),
    "densenmt-summary": dict(name="densenmt", encoder_layers=5, decoder_layers=5, sumlen=3),
    "encoder-only": dict(name="convs2s", dense_encoder=True),
    "decoder-only": dict(name="convs2s", dense_decoder=True),
    "attention-only": dict(name="convs2s", attention="dense2"),
    "small-embeddings-tied": dict(name="densenmt", embed_small=8, tie_embeddings=True, weight_norm=False),
    "layer-groups": dict(name="densenmt", layer_groups=[(2, 16, 3), (1, 24, 1)], sumlen=3, attention="dense1"),
    "residual-layer-groups": dict(name="convs2s", layer_groups=[(2, 16, 3), (1, 24, 1)]),
}


def make(variant: str = "densenmt-2", seed: int = 0, **model: object) -> nn.Module:
    torch.manual_seed(seed)
    cfg = load_config(data={"model": {**TINY, **VARIANTS[variant], **model}})
    return build_model(cfg.model, Vocabularies(V, V)).eval()


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return padded_batch(V, seed)


# ---- causality and incremental decoding -------------------------------------------------------------
@pytest.mark.parametrize("variant", ["convs2s", "densenmt-2", "densenmt-summary", "layer-groups"])
def test_no_future_leakage(variant: str) -> None:
    model = make(variant)
    src, tgt = batch()
    ref = model(src, tgt)
    for t in range(1, tgt.size(1)):
        perturbed = tgt.clone()
        perturbed[:, t:] = torch.randint(4, V, perturbed[:, t:].shape)
        out = model(src, perturbed)
        torch.testing.assert_close(out[:, :t], ref[:, :t], atol=1e-5, rtol=1e-5)
        assert not torch.allclose(out[:, t:], ref[:, t:])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_incremental_decoding_equals_full_forward(variant: str) -> None:
    model = make(variant)
    src, tgt = batch()
    full = model(src, tgt)
    enc, state = model.encode(src), {}
    steps = [model.decode(tgt[:, t:t + 1], enc, state) for t in range(tgt.size(1))]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    convs = [m for m in model.decoder.modules() if isinstance(m, GLUConv) and m.kernel_size > 1]
    assert {m.cache_key for m in convs} <= set(state)  # one cache per causal convolution
    for m in convs:
        assert state[m.cache_key].shape == (3, m.kernel_size - 1, m.in_dim)  # only the last k−1 inputs
    enc, state = model.encode(src), {}
    chunks = [model.decode(tgt[:, :3], enc, state), model.decode(tgt[:, 3:], enc, state)]
    torch.testing.assert_close(torch.cat(chunks, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_beam_search_scores_equal_the_full_forward(variant: str) -> None:
    """Beam search (incremental, with reordering and pruning) scores what a full forward scores."""
    model = make(variant)
    src, _ = batch()
    nbest = beam_search(model, src, beam_size=3, nbest=3, max_len_a=0.0, max_len_b=5)
    for i, hyps in enumerate(nbest):
        assert len(hyps) == 3
        for h in hyps:
            tgt_in = torch.tensor([[BOS] + h.tokens])
            tgt_out = torch.tensor([h.tokens + [EOS]])
            expected = sequence_logprobs(model, src[i:i + 1], tgt_in, tgt_out)
            assert math.isclose(h.logprob, float(expected), rel_tol=1e-4, abs_tol=1e-4)
    greedy = greedy_search(model, src, max_len_a=0.0, max_len_b=5)
    beam1 = beam_search(model, src, beam_size=1, max_len_a=0.0, max_len_b=5)
    assert [g.tokens for g in greedy] == [b[0].tokens for b in beam1]


@pytest.mark.parametrize("variant", ["convs2s", "densenmt-2", "attention-only", "densenmt-summary"])
def test_source_padding_is_invisible(variant: str) -> None:
    model = make(variant)
    src, tgt = batch()
    torch.testing.assert_close(model(src[2:3, :4], tgt[2:3]), model(src, tgt)[2:3], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_parameter_gets_a_gradient(variant: str) -> None:
    model = make(variant).train()
    src, tgt = batch()
    model(src, tgt).logsumexp(-1).mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []


def test_dense_attention_passes_gradient_to_every_encoder_layer_directly() -> None:
    """DenseAtt reads every encoder layer above the last summary, not only the top one (Shen et al. §3.4)."""
    model = make("densenmt-2", encoder_layers=3)
    outputs: list[torch.Tensor] = []
    src, tgt = batch()
    enc = model.encoder(src, layer_outputs=outputs)
    for h in outputs:
        h.retain_grad()
    grads = torch.autograd.grad(model.decode(tgt, enc).sum(), enc["sources"])[0]
    assert enc["sources"].size(-1) == 3 * 16  # h_3, h_2, h_1 (no summary: e is the separate h_0 term)
    for block in grads.split(16, -1):
        assert block.abs().sum() > 0


# ---- summary layers, dense attention parameters ---------------------------------------------------
def layer_input_widths(stack: nn.Module) -> list[int]:
    """Input features of every conv and summary layer of a stack during one forward pass."""
    seen: list[int] = []
    for m in stack.modules():
        if isinstance(m, GLUConv):
            m.register_forward_pre_hook(lambda _m, args: seen.append(args[0].size(-1)))
    for m in stack.summaries.values():
        m.register_forward_pre_hook(lambda _m, args: seen.append(args[0].size(-1)))
    return seen


def test_summary_layers_bound_every_layer_input() -> None:
    sumlen, d, d0, layers = 3, 16, 32, 5
    model = make("densenmt-summary")
    assert set(model.encoder.stack.summaries) == set(model.decoder.stack.summaries) == {"1", "3"}  # after 2 and 4
    enc_widths, dec_widths = (layer_input_widths(s) for s in (model.encoder.stack, model.decoder.stack))
    src, tgt = batch()
    enc = model.encode(src)
    model.decode(tgt, enc)
    assert len(enc_widths) == len(dec_widths) == layers + 2
    assert max(enc_widths) == (sumlen - 1) * d + d0  # the paper's bound (§3.3), reached by the summary layers
    assert max(dec_widths) == 2 * (sumlen - 1) * d + d0  # the decoder also concatenates a_l (d features each)
    assert enc["sources"].size(-1) == d + d0  # layer 5 and the summary below it
    unbounded = make("densenmt-summary", sumlen=0)
    assert max(unbounded.encoder.stack.input_widths) == (layers - 1) * d + d0


def test_dense_attention_1_and_2_have_the_same_parameters() -> None:
    for variant in ("densenmt-2", "densenmt-summary", "layer-groups", "attention-only"):
        one, two = make(variant, attention="dense1"), make(variant, attention="dense2")
        assert count_parameters(one) == count_parameters(two)
    one, two = make("densenmt-1", encoder_layers=1), make("densenmt-2", encoder_layers=1)
    two.load_state_dict(one.state_dict())  # one source layer: Eq. 9 and Eq. 10 coincide
    src, tgt = batch()
    torch.testing.assert_close(one(src, tgt), two(src, tgt))


# ---- presets ------------------------------------------------------------------------------------------
def config_dict(name: str) -> dict:
    return to_dict(load_config(REPO / "configs" / f"{name}.yaml"))


@pytest.mark.parametrize("name,expected", [
    ("densenmt-4l-encoder-only", {"dense_encoder"}),
    ("densenmt-4l-decoder-only", {"dense_decoder"}),
    ("densenmt-4l-attention-only", {"attention"}),
    ("densenmt-4l-1", {"name", "preset", "dense_encoder", "dense_decoder", "attention"}),
    ("densenmt-4l-2", {"name", "preset", "dense_encoder", "dense_decoder", "attention"}),
    ("densenmt-8l-2", {"name", "preset", "dense_encoder", "dense_decoder", "attention", "growth", "encoder_layers",
                       "decoder_layers", "sumlen"}),
])
def test_presets_differ_from_base_only_where_they_should(name: str, expected: set[str]) -> None:
    base, other = config_dict("convs2s-4l"), config_dict(name)
    assert {k for k in base if k != "model" and base[k] != other[k]} == set()  # same data, training, decoding
    assert {k for k, v in base["model"].items() if other["model"][k] != v} == expected


_PARAMS: dict[str, int] = {}


def info_parameters(name: str, capsys: pytest.CaptureFixture[str]) -> int:
    """``nmtflow info CONFIG --vocab-size 16000 --json`` → parameter count (cached per config).

    A 16k vocabulary puts BASE-4L at 16.8M, the paper's model size for De-En with embeddings 256 (Table 1: 17±1M).
    """
    if name not in _PARAMS:
        assert cli(["info", str(REPO / "configs" / f"{name}.yaml"), "--vocab-size", "16000", "--json"]) == 0
        _PARAMS[name] = json.loads(capsys.readouterr().out)["parameters"]
    return _PARAMS[name]


@pytest.mark.parametrize("name,base", [
    ("convs2s-8l", "convs2s-4l"),  # §4.2: hidden 192 "such that both 4-layer models and 8-layer models have similar
    ("densenmt-4l-1", "convs2s-4l"), ("densenmt-4l-2", "convs2s-4l"),  # number of parameters"
    ("densenmt-8l-1", "convs2s-8l"), ("densenmt-8l-2", "convs2s-8l"),
    ("densenmt-4l-encoder-only", "convs2s-4l"), ("densenmt-4l-decoder-only", "convs2s-4l"),
    ("densenmt-4l-attention-only", "convs2s-4l"),
])
def test_presets_stay_within_ten_percent_of_base(name: str, base: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    ratio = info_parameters(name, capsys) / info_parameters(base, capsys)
    assert 0.9 <= ratio <= 1.1, (name, ratio)


def test_wmt_preset_is_20_percent_smaller_than_convs2s_and_summarises_every_five_layers() -> None:
    def build(name: str) -> nn.Module:
        with torch.device("meta"):  # count parameters without allocating 200M of them
            return build_model(load_config(REPO / "configs" / f"{name}.yaml").model, Vocabularies(40000, 40000))

    dense, conv = build("densenmt-wmt-15l"), build("convs2s-wmt-15l")
    assert 0.78 <= count_parameters(dense) / count_parameters(conv) <= 0.82  # "20% fewer parameters" (Table 5)
    assert set(dense.encoder.stack.summaries) == set(dense.decoder.stack.summaries) == {"4", "9"}
    assert max(dense.encoder.stack.input_widths) <= 5 * 640 + 768


def test_8l_dense_presets_summarise_after_layer_four() -> None:
    with torch.device("meta"):
        dense = build_model(load_config(REPO / "configs" / "densenmt-8l-2.yaml").model, Vocabularies(16000, 16000))
    assert set(dense.encoder.stack.summaries) == set(dense.decoder.stack.summaries) == {"3"}  # sumlen 5
    assert max(dense.encoder.stack.input_widths) == 4 * 96 + 256  # no layer reads more than (sumlen − 1)·d + d0


# ---- training -----------------------------------------------------------------------------------------
def test_tiny_densenmt_trains_with_nesterov_and_reduce_on_rise(copy_data: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A few Trainer updates; scripted validation losses drive the schedule: ÷10 at each rise, stop < 1e-4."""
    config = tiny_config(copy_data, tmp_path / "dense", max_updates=100, validate_every=2, save_every=100,
                         valid_bleu=False, optimizer="nesterov", lr=0.25, lr_scheduler="reduce_on_rise",
                         clip_norm=0.1, label_smoothing=0.0)
    config.model = load_config(data={"model": {"name": "densenmt", **TINY}}).model
    scripted = iter([5.0, 4.0, 4.5, 4.4, 4.6, 4.7, 4.8, 1.0])
    monkeypatch.setattr(Trainer, "validation_loss", lambda self: (next(scripted), 1))
    result = Trainer(config).train()
    assert result.progress.update == 14  # stopped at the 7th validation: 0.25 → … → 2.5e-5 < 1e-4
    assert "min_lr" in result.progress.stopped
    train = [e for e in result.history if e["kind"] == "train"]
    assert all(math.isfinite(e["loss"]) for e in train)
    assert train[-1]["loss"] < train[0]["loss"]
    lr = {e["update"]: e["lr"] for e in train}  # logged before that update's validation
    assert [lr[u] for u in (2, 4, 6, 8, 10, 12, 14)] == pytest.approx([0.25, 0.25, 0.25, 0.025, 0.025, 2.5e-3, 2.5e-4])
    assert [e["nll"] for e in read_log(tmp_path / "dense") if e["kind"] == "valid"][:3] == [5.0, 4.0, 4.5]
    translator = Translator.from_checkpoint(tmp_path / "dense" / "checkpoint_last.pt")
    assert len(translator.translate(["alpha bravo charlie"])) == 1
