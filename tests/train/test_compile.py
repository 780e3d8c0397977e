"""train.compile: the compiled layers and loss compute what the eager ones do, share one graph per layer class, and
leave validation and decoding eager."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters

from nmtflow.config import ConfigError, load_config
from nmtflow.data.vocab import PAD
from nmtflow.decode.search import beam_search
from nmtflow.models.base import Vocabularies, build_model
from nmtflow.nn import compiled as compiled_mod
from nmtflow.nn.compiled import compile_regions, compiler_missing
from nmtflow.train.loss import SmoothedCrossEntropy, label_smoothed_nll, smoothed_nll_terms
from nmtflow.train.trainer import Trainer
from tests.conftest import padded_batch, tiny_config

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(compiler_missing(torch.device("cpu")) is not None, reason="no C++ compiler")]


def unique_graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


@pytest.mark.parametrize("epsilon", [0.0, 0.1])
def test_loss_terms_equal_the_fused_loss_and_its_gradient(epsilon: float) -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(11, 37, generator=g, dtype=torch.float64) * 3
    target = torch.randint(4, 37, (11,), generator=g)
    target[[2, 7]] = PAD
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    loss_a, nll_a = SmoothedCrossEntropy.apply(a, target, epsilon)
    loss_b, nll_b = smoothed_nll_terms(b, target, epsilon)
    (loss_a * 0.7).backward()
    (loss_b * 0.7).backward()
    torch.testing.assert_close(loss_b, loss_a)
    torch.testing.assert_close(nll_b, nll_a)
    torch.testing.assert_close(b.grad, a.grad)
    assert b.grad[[2, 7]].abs().max() == 0  # PAD positions get no gradient


def test_compiled_loss_equals_the_eager_loss_in_float32_and_bf16() -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 9, 41, generator=g) * 2
    target = torch.randint(4, 41, (3, 9), generator=g)
    target[1, 5:] = PAD
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        a = logits.to(dtype).clone().requires_grad_()
        b = logits.to(dtype).clone().requires_grad_()
        loss_a, nll_a = label_smoothed_nll(a, target, 0.1)
        loss_b, nll_b = label_smoothed_nll(b, target, 0.1, compiled=True)
        loss_a.backward()
        loss_b.backward()
        assert b.grad.dtype == dtype
        torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(nll_b, nll_a, rtol=1e-5, atol=1e-4)
        torch.testing.assert_close(b.grad.float(), a.grad.float(), rtol=tol, atol=tol)


def small_model(dropout: float = 0.0, slot: dict | None = None) -> torch.nn.Module:
    slots = {name: slot for name in ("encoder_self_attention", "decoder_self_attention", "cross_attention")}
    cfg = load_config(data={"model": {"name": "transformer", "d_model": 32, "ffn_dim": 64, "heads": 4,
                                      "encoder_layers": 3, "decoder_layers": 2, "dropout": dropout,
                                      **(slots if slot else {})}})
    torch.manual_seed(5)
    return build_model(cfg.model, Vocabularies(50, 50, joint=True))


def assert_same_training_pass(eager: torch.nn.Module, ours: torch.nn.Module, src: torch.Tensor,
                              tgt: torch.Tensor, out_rtol: float = 1e-4, out_atol: float = 1e-5,
                              grad_rtol: float = 1e-3, grad_atol: float = 1e-5) -> None:
    """The compiled model's logits and every parameter's gradient equal the eager model's (no dropout)."""
    outs = []
    for model in (eager, ours):
        model.train()
        model.zero_grad()
        logits = model(src, tgt)
        logits.float().square().mean().backward()
        outs.append((logits, {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(outs[1][0], outs[0][0], rtol=out_rtol, atol=out_atol)
    for name, grad in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][name], grad, rtol=grad_rtol, atol=grad_atol, msg=name)


def test_compiled_layers_compute_the_eager_outputs_and_gradients_with_one_graph_per_layer_class() -> None:
    torch._dynamo.reset()
    compiled_mod._GRAPHS.clear()
    eager = small_model()
    ours = copy.deepcopy(eager)
    assert compile_regions(ours) == ["DecoderLayer", "EncoderLayer"]
    assert compile_regions(torch.nn.Linear(2, 2)) == []
    before = unique_graphs()
    g = torch.Generator().manual_seed(1)
    # the first batch has as many sentences as source and target tokens (9): a compiler that tied equal sizes
    # together (duck sizing) would compile again for the second, whose sizes differ
    for b, s, t in ((9, 9, 9), (4, 11, 6)):
        src, tgt = torch.randint(4, 50, (b, s), generator=g), torch.randint(4, 50, (b, t), generator=g)
        src[1, s // 2:] = PAD
        assert_same_training_pass(eager, ours, src, tgt)
    # one graph per class (encoder layer, decoder layer) for all 5 layers and both batch shapes
    assert unique_graphs() - before == 2


@pytest.mark.parametrize("slot", [{"type": "phrasal", "ngrams": [1, 2]}, {"type": "phrasal", "ngrams": [2, 3]},
                                  {"type": "shortcut"}, {"type": "shortcut", "feature_fusion": True}],
                         ids=["phrasal-12", "phrasal-23", "shortcuts", "feature-fusion"])
def test_attention_variants_compute_the_eager_outputs_and_gradients_compiled(slot: dict) -> None:
    """Phrasal {2,3} has causal queries that see no phrase at all (the first position): its dead-query path."""
    torch._dynamo.reset()
    eager = small_model(slot=slot)
    ours = copy.deepcopy(eager)
    compile_regions(ours)
    before = unique_graphs()
    assert_same_training_pass(eager, ours, *padded_batch(50, tgt_len=8))
    assert unique_graphs() > before


def test_validation_and_decoding_stay_eager_and_unchanged() -> None:
    eager = small_model()
    ours = copy.deepcopy(eager)
    compile_regions(ours)
    src, _ = padded_batch(50)
    before = unique_graphs()
    for model in (eager, ours):
        model.eval()
    hyps = [beam_search(m, src, beam_size=3, max_len_a=1.0, max_len_b=5) for m in (eager, ours)]
    assert [[h.tokens for h in row] for row in hyps[0]] == [[h.tokens for h in row] for row in hyps[1]]
    with torch.no_grad():
        ours.train()
        ours(src, src)  # training mode without gradients: eager as well
    assert unique_graphs() == before


def test_training_with_compile_follows_the_eager_losses(copy_data: Path, tmp_path: Path) -> None:
    losses = {}
    torch._dynamo.reset()
    before = unique_graphs()
    for compiled in (False, True):
        cfg = tiny_config(copy_data, tmp_path / str(compiled), compile=compiled, max_updates=6, validate_every=0,
                          save_every=0)
        cfg.model.dropout = 0.0
        trainer = Trainer(cfg)
        trainer.train()
        losses[compiled] = [e["loss"] for e in read_train_log(trainer.save_dir)]
    assert len(losses[True]) == 6 and unique_graphs() > before
    assert losses[True] == pytest.approx(losses[False], rel=2e-3)


def test_a_compiled_run_with_dropout_resumes_exactly(copy_data: Path, tmp_path: Path) -> None:
    """The compiled graphs draw their dropout masks from torch's generator, which checkpoints keep."""
    torch._dynamo.reset()
    before = unique_graphs()
    full = tmp_path / "full"
    Trainer(tiny_config(copy_data, full, compile=True, max_updates=8, validate_every=0, valid_bleu=False)).train()
    cut = tmp_path / "cut"
    Trainer(tiny_config(copy_data, cut, compile=True, max_updates=3, validate_every=0, valid_bleu=False)).train()
    Trainer(tiny_config(copy_data, cut, compile=True, max_updates=8, validate_every=0, valid_bleu=False)).train()
    assert [e["loss"] for e in read_train_log(cut)] == [e["loss"] for e in read_train_log(full)]
    assert unique_graphs() > before


def read_train_log(save_dir: Path) -> list[dict]:
    from nmtflow.train.trainer import read_log

    return [e for e in read_log(save_dir) if e.get("kind") == "train"]


def test_compile_without_a_compiler_is_a_clear_config_error(copy_data: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled_mod.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="train.compile: torch.compile needs a C\\+\\+ compiler"):
        Trainer(tiny_config(copy_data, tmp_path, compile=True, device="cpu"))
