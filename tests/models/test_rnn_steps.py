"""The Luong decoder's own LSTM steps (``LuongDecoder.run_steps``) compute what ``nn.LSTM`` computes with the same
parameters: logits, final states and every parameter's gradient, with and without input feeding, 1–3 layers; and
they are used where they pay (CPU training) by default. The BiLSTM encoder's own steps (``BiLSTMEncoder.run_steps``,
the default in CPU training under bf16 autocast) equal ``nn.LSTM`` over packed sequences."""
from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmtflow.data.vocab import PAD
from nmtflow.models import rnn
from nmtflow.models.rnn import BiLSTMEncoder, LuongDecoder, output_projection
from nmtflow.nn.layers import output_logits


pytestmark = pytest.mark.usefixtures("one_thread")

B, T, K, D, V = 3, 6, 4, 16, 23


def decoder(layers: int, input_feeding: bool, dropout: float = 0.0) -> LuongDecoder:
    torch.manual_seed(layers * 10 + input_feeding)
    emb = nn.Embedding(V, D)
    dec = LuongDecoder(emb, D, D, layers, dropout, output_projection(emb, True), input_feeding=input_feeding)
    dec.own_steps = True  # run_steps with and without autograd (by default only with)
    return dec


def nn_lstm_reference(dec: LuongDecoder, tgt_in: Tensor, memory: Tensor,
                      mask: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """The decoder computed with nn.LSTM itself: one call per step with input feeding, one call without."""
    hc = dec.initial_state(memory, mask)
    x = dec.embedding(tgt_in)
    if dec.input_feeding:
        feed, outputs = memory.new_zeros(tgt_in.size(0), D), []
        for t in range(tgt_in.size(1)):
            h, hc = dec.lstm(torch.cat([x[:, t:t + 1], feed[:, None]], dim=-1), hc)
            feed = dec.attend(h, memory, mask)[:, 0]
            outputs.append(feed)
        h_tilde = torch.stack(outputs, dim=1)
    else:
        h, hc = dec.lstm(x, hc)
        h_tilde = dec.attend(h, memory, mask)
    return output_logits(h_tilde, dec.output_weight), hc


def inputs() -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(5)
    tgt_in = torch.randint(4, V, (B, T), generator=g)
    memory = torch.randn(B, K, D, generator=g)
    mask = torch.zeros(B, K, dtype=torch.bool)
    mask[1, 3:] = True
    return tgt_in, memory, mask


@pytest.mark.parametrize("layers", [1, 2, 3])
@pytest.mark.parametrize("input_feeding", [True, False], ids=["feed", "no-feed"])
def test_steps_equal_nn_lstm_in_outputs_states_and_gradients(layers: int, input_feeding: bool) -> None:
    dec = decoder(layers, input_feeding).eval()
    tgt_in, memory, mask = inputs()
    memory.requires_grad_(True)

    ref_logits, ref_hc = nn_lstm_reference(dec, tgt_in, memory, mask)
    ref_logits.square().mean().backward()
    ref_grads = {n: p.grad.clone() for n, p in dec.named_parameters()}
    ref_memory_grad = memory.grad.clone()
    dec.zero_grad()
    memory.grad = None

    state: dict[str, Tensor] = {}
    logits = dec(tgt_in, memory, mask, state)
    logits.square().mean().backward()
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state["decoder.h"].transpose(0, 1), ref_hc[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state["decoder.c"].transpose(0, 1), ref_hc[1], atol=1e-5, rtol=1e-5)
    for name, p in dec.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name], atol=1e-6, rtol=1e-4, msg=name)
    torch.testing.assert_close(memory.grad, ref_memory_grad, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("input_feeding", [True, False], ids=["feed", "no-feed"])
def test_one_step_at_a_time_equals_the_whole_sequence(input_feeding: bool) -> None:
    dec = decoder(2, input_feeding).eval()
    tgt_in, memory, mask = inputs()
    with torch.no_grad():
        full = dec(tgt_in, memory, mask)
        state: dict[str, Tensor] = {}
        steps = torch.cat([dec(tgt_in[:, t:t + 1], memory, mask, state) for t in range(T)], dim=1)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)


def test_dropout_between_layers_only_in_training_and_only_below_the_top() -> None:
    """nn.LSTM's dropout (0.5 here; the decoder's own dropout on embeddings and h̃ off) changes a training pass of a
    two-layer stack and leaves a one-layer stack, which has no layer below another, as in evaluation."""
    tgt_in, memory, mask = inputs()
    two = decoder(2, True)
    two.lstm.dropout = 0.5
    with torch.no_grad():
        evaluated = two.eval()(tgt_in, memory, mask)
        torch.manual_seed(0)
        trained = two.train()(tgt_in, memory, mask)
    assert not torch.allclose(trained, evaluated, atol=1e-4)
    one = decoder(1, True)
    one.lstm.dropout = 0.5
    with torch.no_grad():
        torch.testing.assert_close(one.train()(tgt_in, memory, mask), one.eval()(tgt_in, memory, mask))


def test_bf16_autocast_keeps_the_cell_in_float32_and_stays_near_fp32() -> None:
    dec = decoder(2, True).eval()
    tgt_in, memory, mask = inputs()
    with torch.no_grad():
        fp32 = F.log_softmax(dec(tgt_in, memory, mask), -1)
        state: dict[str, Tensor] = {}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16 = dec(tgt_in, memory, mask, state)
    assert state["decoder.c"].dtype == torch.float32 and state["decoder.h"].dtype == torch.float32
    torch.testing.assert_close(F.log_softmax(bf16.float(), -1), fp32, atol=5e-2, rtol=5e-2)


def test_bf16_autocast_gradients_are_float32_and_near_fp32() -> None:
    """Under autocast the steps' weight gradients (one bf16 matmul over all steps) reach every parameter in float32
    and point where fp32's do."""
    dec = decoder(2, True).eval()
    tgt_in, memory, mask = inputs()
    dec(tgt_in, memory, mask).logsumexp(-1).mean().backward()
    fp32 = {n: p.grad.clone() for n, p in dec.named_parameters()}
    dec.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = dec(tgt_in, memory, mask)
    logits.float().logsumexp(-1).mean().backward()
    for name, p in dec.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        cosine = F.cosine_similarity(p.grad.flatten(), fp32[name].flatten(), dim=0)
        assert cosine > 0.99, (name, float(cosine))


def test_decoding_sees_a_parameter_changed_in_place_after_an_earlier_call() -> None:
    """Without autograd the arranged step weights are cached; an in-place change (an optimiser step,
    load_state_dict) must reach the next call."""
    dec = decoder(2, True).eval()
    tgt_in, memory, mask = inputs()
    with torch.no_grad():
        dec(tgt_in, memory, mask)
        dec.lstm.weight_hh_l1.mul_(0.5)
        dec.lstm.bias_ih_l0.add_(0.1)
        after = dec(tgt_in, memory, mask)
        expected, _ = nn_lstm_reference(dec, tgt_in, memory, mask)
    torch.testing.assert_close(after, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("grad", [True, False], ids=["training", "decoding"])
def test_by_default_own_steps_train_on_the_cpu_and_nn_lstm_decodes(grad: bool, monkeypatch: pytest.MonkeyPatch
                                                                     ) -> None:
    dec = decoder(2, True)
    dec.own_steps = None
    used: list[str] = []
    for name in ("run_steps", "lstm_steps"):
        method = getattr(dec, name)
        monkeypatch.setattr(dec, name, lambda *a, _m=method, _n=name: used.append(_n) or _m(*a))
    tgt_in, memory, mask = inputs()
    with torch.set_grad_enabled(grad):
        dec(tgt_in, memory, mask)
    assert used == (["run_steps"] if grad else ["lstm_steps"])


def test_training_steps_leave_nothing_alive_behind() -> None:
    """The steps' tape holds tensors only between a backward's step nodes and its weight gradient: no reference
    cycle through the autograd graph keeps a step's inputs alive after the step (a leak of ~10 MB per update at
    d_h 512)."""
    dec = decoder(2, True).train()
    enc = encoder(2).train()
    enc.own_steps = True
    tgt_in, memory, mask = inputs()
    for _ in range(3):
        dec(tgt_in, memory, mask).square().mean().backward()
        enc(sources())["out"].square().mean().backward()
    gc.collect()
    assert not [obj for obj in gc.get_objects() if type(obj) is rnn.StepTape]


# ---- the encoder's own steps (BiLSTMEncoder.run_steps) --------------------------------------------------------------
def encoder(layers: int, dropout: float = 0.0) -> BiLSTMEncoder:
    torch.manual_seed(layers)
    return BiLSTMEncoder(nn.Embedding(V, D), D, layers, dropout)


def sources() -> Tensor:
    """Sentences of 7, 4, 1 and 7 tokens, right-padded."""
    src = torch.randint(4, V, (4, 7), generator=torch.Generator().manual_seed(3))
    src[1, 4:] = PAD
    src[2, 1:] = PAD
    return src


@pytest.mark.parametrize("layers", [1, 2, 3])
def test_encoder_steps_equal_nn_lstm_over_packed_sequences(layers: int) -> None:
    """The backward direction reads each sentence reversed within its length: padding changes nothing, as with
    packed sequences; outputs (0 at pads) and every parameter's gradient agree."""
    enc = encoder(layers).train()
    src = sources()
    results = []
    for own in (False, True):
        enc.own_steps = own
        enc.zero_grad()
        out = enc(src)["out"]
        out.square().sum().backward()
        results.append((out, {n: p.grad.clone() for n, p in enc.named_parameters()}))
    (packed, packed_grads), (steps, steps_grads) = results
    torch.testing.assert_close(steps, packed, atol=1e-6, rtol=1e-5)
    assert steps[1, 4:].eq(0).all() and steps[2, 1:].eq(0).all()
    for name, grad in packed_grads.items():
        torch.testing.assert_close(steps_grads[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_encoder_steps_apply_dropout_between_layers_in_training_only() -> None:
    enc = encoder(2)
    enc.own_steps, enc.dropout = True, 0.0  # embedding and output dropout off; nn.LSTM's inter-layer dropout 0.5
    enc.lstm.dropout = 0.5
    src = sources()
    with torch.no_grad():
        evaluated = enc.eval()(src)["out"]
        torch.manual_seed(0)
        trained = enc.train()(src)["out"]
    assert not torch.allclose(trained, evaluated, atol=1e-4)
    enc.lstm.dropout = 0.0
    with torch.no_grad():
        torch.testing.assert_close(enc.train()(src)["out"], evaluated)


def test_encoder_steps_under_bf16_autocast_by_default_in_cpu_training_and_near_fp32() -> None:
    """Under CPU autocast in training the encoder steps by default (nn.LSTM otherwise); its state stays float32 and
    its gradients point where fp32's do."""
    enc = encoder(2).train()
    src = sources()
    used: list[bool] = []
    run_steps = enc.run_steps
    enc.run_steps = lambda *a: used.append(True) or run_steps(*a)  # type: ignore[method-assign]
    fp32 = enc(src)["out"]
    fp32.square().sum().backward()
    reference = {n: p.grad.clone() for n, p in enc.named_parameters()}
    assert used == []
    enc.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = enc(src)["out"]
    assert used == [True] and bf16.dtype == torch.float32
    bf16.square().sum().backward()
    torch.testing.assert_close(bf16, fp32, atol=5e-2, rtol=5e-2)
    for name, p in enc.named_parameters():
        cosine = F.cosine_similarity(p.grad.flatten(), reference[name].flatten(), dim=0)
        assert p.grad.dtype == torch.float32 and cosine > 0.99, (name, float(cosine))
