"""The attentional BiLSTM (Luong et al. 2015; SPEC §1): the host of the attention bridge (SPEC §5).

* :class:`BiLSTMEncoder`: a stack of bidirectional LSTMs over packed sequences (d_h/2 units per direction,
  so ``H`` is n × d_h, as in Vázquez et al. 2020 §3.1); padding never reaches a word's state.
* :class:`LuongDecoder`: a stack of LSTMs with Luong global attention ("general" score, Luong et al.
  2015 Eq. 5–8) over any memory — the encoder states ``H`` here, the bridge's ``M`` in
  :mod:`nmtflow.models.multilingual` — and optional input feeding (Luong §3.3)::

      h_t = LSTM([y_{t-1}; h̃_{t-1}], h_{t-1})      α_t = softmax_s(h_tᵀ W_a m_s)      c_t = Σ_s α_ts m_s
      h̃_t = tanh(W_c [c_t; h_t])                   p(y_t | y_<t, x) = softmax(W_s h̃_t)

  The initial state (a choice the papers leave open) is ``h_0 = tanh(W_init · mean(memory))`` in every layer
  and ``c_0 = 0`` (``init="projected"``), or ``h_0 = c_0 = mean(memory)`` in every layer (``init="mean"``, the
  attention-bridge paper's code: Vázquez et al. 2020, "an initial state computed by mean pooling over M"); the
  mean runs over the memory's non-padding rows.

Both compute their LSTMs either with ``nn.LSTM`` or with their own ``run_steps`` from ``nn.LSTM``'s parameters (one
batched matrix product per layer and step, each weight's gradient once over all steps: :class:`_SharedWeight`), by
default where that is faster: the decoder in CPU training, the encoder in CPU training under bf16 autocast
(``benchmarks/lstm_steps.py``); ``own_steps`` forces either.

Incremental state (batch-first, keyed by the decoder's ``name`` prefix): ``NAME.h`` and ``NAME.c``
(B, layers, d_h) and, with input feeding, ``NAME.feed`` (B, d_h) = h̃ of the last step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from nmtflow.config import ConfigError
from nmtflow.data.vocab import PAD
from nmtflow.models.base import EncoderDecoder, EncoderOut, ModelConfig, State, Vocabularies
from nmtflow.nn.dropout import dropout
from nmtflow.nn.layers import in_dtype_of, masked_softmax, output_logits, token_embedding
from nmtflow.registry import register_model


DECODER_INITS = ("projected", "mean")  # LuongDecoder's initial state (the module docstring)


@dataclass
class RNNConfig(ModelConfig):
    """BiLSTM encoder + LSTM decoder with Luong attention; embeddings have the hidden size d_h."""

    name: str = "rnn"
    hidden_dim: int = 512  # d_h: embeddings, encoder states (both directions), decoder states
    encoder_layers: int = 2
    decoder_layers: int = 2
    dropout: float = 0.3
    input_feeding: bool = True
    tie_embeddings: bool = True  # joint vocab: source = target = output; else target = output
    max_positions: int = 1024  # only caps the decoding length (the LSTMs have no position limit)
    POSITIONS_BOUND_LENGTH: ClassVar[bool] = False  # training takes sentences of any length

    PRESETS: ClassVar[dict[str, dict]] = {"base": dict(hidden_dim=512, encoder_layers=2, decoder_layers=2)}

    def validate(self, where: str) -> None:
        if self.hidden_dim < 2:
            raise ConfigError(f"{where}.hidden_dim: must be at least 2, got {self.hidden_dim}")
        if not 0.0 <= self.dropout < 1.0:
            raise ConfigError(f"{where}.dropout: must be in [0, 1), got {self.dropout}")
        if self.hidden_dim % 2:
            raise ConfigError(f"{where}.hidden_dim: must be even (d_h/2 units per BiLSTM direction), "
                              f"got {self.hidden_dim}")
        if self.encoder_layers < 1 or self.decoder_layers < 1:
            raise ConfigError(f"{where}: the RNN needs at least one encoder and one decoder layer")


def masked_mean(x: Tensor, padding_mask: Tensor | None) -> Tensor:
    """Mean of x (B,S,D) over its non-padding positions (padding_mask (B,S), True = pad) → (B,D)."""
    if padding_mask is None:
        return x.mean(dim=1)
    keep = (~padding_mask).unsqueeze(-1).to(x.dtype)  # (B,S,1)
    return (x * keep).sum(1) / keep.sum(1).clamp(min=1.0)


def run_lstm(lstm: nn.LSTM, x: Tensor | PackedSequence,
             hc: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor | PackedSequence, tuple[Tensor, Tensor]]:
    """``lstm(x, hc)``; under CPU autocast in float32: oneDNN has no bf16 LSTM on most CPUs (PyTorch's "could not
    create a primitive descriptor" error), and where it has one (AMX, AVX-512 BF16) a bf16 encoder trained the
    bridge worse (benchmarks/README.md, ``lstm_steps.py``). On CUDA, or without autocast, it is a plain call."""
    data = x.data if isinstance(x, PackedSequence) else x
    if data.device.type != "cpu" or not torch.is_autocast_enabled("cpu"):
        return lstm(x, hc)
    with torch.autocast("cpu", enabled=False):
        if not isinstance(x, PackedSequence):
            x = x.float()
        elif x.data.dtype != torch.float32:
            x = x._replace(data=x.data.float())
        return lstm(x, None if hc is None else (hc[0].float(), hc[1].float()))


class BiLSTMEncoder(nn.Module):
    """Embeddings → ``layers`` stacked BiLSTMs → ``{"out": H (B,S,d_h), "padding_mask": (B,S)}``.

    Dropout applies to the embeddings, between the layers and, with ``output_dropout`` (the default), to ``H``;
    OpenNMT-py's encoder (the attention-bridge paper's code) has none on ``H``.
    """

    def __init__(self, embedding: nn.Embedding, hidden_dim: int, layers: int, dropout: float, *,
                 output_dropout: bool = True) -> None:
        super().__init__()
        self.embedding = embedding
        self.dropout = dropout
        self.output_dropout = output_dropout
        self.lstm = nn.LSTM(embedding.embedding_dim, hidden_dim // 2, num_layers=layers, batch_first=True,
                            bidirectional=True, dropout=dropout if layers > 1 else 0.0)
        # run_steps (True) or nn.LSTM over packed sequences (False); None: run_steps in CPU training under bf16
        # autocast (×1.19 there; in fp32 on a par with oneDNN's LSTM, which has no bf16 on most CPUs)
        self.own_steps: bool | None = None

    def forward(self, src: Tensor) -> EncoderOut:
        padding_mask = src.eq(PAD)  # (B,S), right padding
        lengths = (~padding_mask).sum(1).clamp(min=1)
        x = dropout(self.embedding(src), self.dropout, self.training)  # (B,S,E)
        own = self.own_steps
        if own is None:
            own = x.device.type == "cpu" and torch.is_grad_enabled() and torch.is_autocast_enabled("cpu")
        if own:
            h = self.run_steps(x, lengths, padding_mask)
        else:
            packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
            out, _ = run_lstm(self.lstm, packed)
            h, _ = pad_packed_sequence(out, batch_first=True, total_length=src.size(1))  # (B,S,d_h), 0 at pads
        if self.output_dropout:
            h = dropout(h, self.dropout, self.training)
        return {"out": h, "padding_mask": padding_mask}

    def run_steps(self, x: Tensor, lengths: Tensor, padding_mask: Tensor) -> Tensor:
        """The stacked BiLSTM over the right-padded x (B,S,E) as over packed sequences → (B,S,d_h), 0 at pads.

        The backward direction reads each sentence reversed within its length (a gather, its own inverse), so
        neither direction meets padding before a word. Per layer: both directions' input gates as one matmul over
        all steps, then per step one batched matmul of the two directions' states (their weight gradient once over
        all steps, :class:`_SharedWeight`) and the cell's update in float32 (:func:`lstm_cell`); nn.LSTM's
        parameters, and its dropout between layers.
        """
        lstm, d = self.lstm, self.lstm.hidden_size
        dtype = autocast_dtype(x)
        x = in_dtype_of(x, lstm.weight_ih_l0)  # the bf16 decoding copy: bf16 LSTM weights, float32 embeddings
        positions = torch.arange(x.size(1), device=x.device)[None]  # (1,S)
        reversed_at = lengths[:, None] - 1 - positions
        order = torch.where(reversed_at >= 0, reversed_at, positions)[:, :, None]  # (B,S,1)
        state = x.new_zeros(2, x.size(0), d, dtype=torch.float32 if dtype is not None else x.dtype)  # (2,B,d)
        out = x
        for k in range(lstm.num_layers):
            if k:
                out = dropout(out, lstm.dropout, self.training)
            def both(name: str) -> list[Tensor]:  # layer k's parameter of both directions, forward first
                return [getattr(lstm, f"{name}_l{k}{suffix}") for suffix in ("", "_reverse")]

            bias = torch.cat([b_ih + b_hh for b_ih, b_hh in zip(both("bias_ih"), both("bias_hh"))])
            forward_in, backward_in = F.linear(out, torch.cat(both("weight_ih")), bias).chunk(2, dim=-1)  # (B,S,4d)
            backward_in = backward_in.gather(1, order.expand(-1, -1, 4 * d))
            steps = torch.stack([forward_in, backward_in]).unbind(2)  # S × (2,B,4d)
            w_hh = torch.stack(both("weight_hh"))  # (2,4d,d)
            w_hh, tape = taped(w_hh if dtype is None else w_hh.to(dtype))
            h, c, outputs = state, state, []
            for gates in steps:
                h, c = lstm_cell(gates + step_linear(h, w_hh, tape), c)
                outputs.append(h)
            both = torch.stack(outputs, dim=2)  # (2,B,S,d)
            backward = both[1].gather(1, order.expand(-1, -1, d))
            out = torch.cat([both[0], backward], dim=-1).masked_fill(padding_mask[:, :, None], 0.0)
        return out


class StepTape:
    """What the steps of a recurrence that share one weight leave for its gradient, filled in backward: each step's
    input and the gradient of its output, by step. Emptied once the weight's gradient is made, so that it never
    holds a tensor beyond a backward pass (no reference cycle through the graph keeps the steps' inputs alive)."""

    def __init__(self) -> None:
        self.steps = 0
        self.inputs: dict[int, Tensor] = {}
        self.grads: dict[int, Tensor] = {}


class _SharedWeight(torch.autograd.Function):
    """Identity on a weight every step multiplies; its backward, which runs after every step's, returns the weight's
    gradient Σ_t g_tᵀ x_t as one matmul over all steps, where autograd would make a small matmul and an
    accumulation per step."""

    @staticmethod
    def forward(ctx: Any, weight: Tensor, tape: StepTape) -> Tensor:
        ctx.tape = tape
        ctx.set_materialize_grads(False)
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, _unused: Tensor | None) -> tuple[Tensor | None, None]:
        tape = ctx.tape
        steps = sorted(tape.grads)
        tape_grads, tape_inputs = tape.grads, tape.inputs
        tape.grads, tape.inputs = {}, {}
        if not steps:
            return None, None
        grads = torch.cat([tape_grads[i] for i in steps], dim=-2)  # (..., Σ rows, out)
        inputs = torch.cat([tape_inputs[i] for i in steps], dim=-2)  # (..., Σ rows, in)
        return grads.transpose(-1, -2) @ inputs.to(grads.dtype), None


class _StepLinear(torch.autograd.Function):
    """x Wᵀ for one step, W the output of :class:`_SharedWeight`: backward gives x its gradient and leaves W's on
    the tape. x (..., rows, in), W (..., out, in): a batch of weights (e.g. an LSTM's two directions) multiplies a
    batch of inputs."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, tape: StepTape) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.tape, ctx.step = tape, tape.steps
        tape.steps += 1
        return x @ weight.transpose(-1, -2)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        x, weight = ctx.saved_tensors
        ctx.tape.grads[ctx.step], ctx.tape.inputs[ctx.step] = grad, x.detach()
        return (grad @ weight.to(grad.dtype) if ctx.needs_input_grad[0] else None), None, None


def taped(weight: Tensor) -> tuple[Tensor, StepTape | None]:
    """``weight`` for the steps of a recurrence and its tape, where autograd will want its gradient (training):
    then through :class:`_SharedWeight`; else ``(weight, None)``."""
    if not (torch.is_grad_enabled() and weight.requires_grad):
        return weight, None
    tape = StepTape()
    return _SharedWeight.apply(weight, tape), tape


def step_linear(x: Tensor, weight: Tensor, tape: StepTape | None) -> Tensor:
    """x Wᵀ (W (..., out, in)): with a tape, W's gradient is computed once for all steps (:class:`_SharedWeight`)."""
    if tape is None:
        return x @ weight.transpose(-1, -2)
    return _StepLinear.apply(x.to(weight.dtype), weight, tape)


def autocast_dtype(x: Tensor) -> torch.dtype | None:
    """The dtype autocast gives matmuls on ``x``'s device, or None outside autocast."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


class LuongDecoder(nn.Module):
    """Stacked LSTM + Luong global attention over a memory (B,K,d_m); see the module docstring."""

    def __init__(self, embedding: nn.Embedding, hidden_dim: int, memory_dim: int, layers: int, dropout: float,
                 output_weight: nn.Parameter, *, input_feeding: bool = True, name: str = "decoder",
                 init: str = "projected") -> None:
        super().__init__()
        if init not in DECODER_INITS:
            raise ValueError(f"unknown decoder init {init!r} (known: {', '.join(DECODER_INITS)})")
        if init == "mean" and memory_dim != hidden_dim:
            raise ValueError(f"init='mean' needs memory_dim == hidden_dim, got {memory_dim} and {hidden_dim}")
        self.embedding = embedding
        self.hidden_dim, self.layers, self.dropout = hidden_dim, layers, dropout
        self.input_feeding = input_feeding
        self.name = name
        feed = hidden_dim if input_feeding else 0
        self.lstm = nn.LSTM(embedding.embedding_dim + feed, hidden_dim, num_layers=layers, batch_first=True,
                            dropout=dropout if layers > 1 else 0.0)
        # W_init: mean(memory) → h_0 of every layer ("projected"); "mean" has no parameters
        self.init = nn.Linear(memory_dim, layers * hidden_dim) if init == "projected" else None
        self.attn_in = nn.Linear(hidden_dim, memory_dim, bias=False)  # W_a ("general" score)
        self.attn_out = nn.Linear(memory_dim + hidden_dim, hidden_dim, bias=False)  # W_c
        self.output_weight = output_weight  # W_s (V,d_h), usually tied to the target embedding
        self._step_weights: tuple[Any, Any] | None = None  # step_weights' cache while decoding
        # steps by run_steps (True) or by nn.LSTM called per step (False); None: run_steps where it pays, in training
        # on the CPU (×1.4 fp32, ×1.5 bf16: benchmarks/lstm_steps.py); nn.LSTM without autograd (decoding: on a par
        # or faster) and on a GPU (cuDNN; run_steps not measured there)
        self.own_steps: bool | None = None

    def initial_state(self, memory: Tensor, memory_mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """h_0 = tanh(W_init mean(memory)), c_0 = 0 (``projected``), or h_0 = c_0 = mean(memory) (``mean``) → two
        (layers,B,d_h) tensors (nn.LSTM layout)."""
        mean = masked_mean(memory, memory_mask)  # (B,d_m)
        if self.init is None:
            h = mean[None].expand(self.layers, -1, -1).contiguous()
            return h, h.clone()
        h = torch.tanh(self.init(mean)).view(mean.size(0), self.layers, self.hidden_dim)
        h = h.transpose(0, 1).contiguous()
        return h, torch.zeros_like(h)

    def attend(self, h: Tensor, memory: Tensor, memory_mask: Tensor | None) -> Tensor:
        """h (B,T,d_h) → h̃ (B,T,d_h) = tanh(W_c [c; h]) with c the attention context over memory."""
        scores = self.attn_in(h) @ memory.transpose(1, 2)  # (B,T,K)
        # an all-padding memory row: zero weights (no context, as in SDPA), not NaN
        weights = scores.softmax(-1) if memory_mask is None else masked_softmax(scores, memory_mask[:, None, :])
        context = weights @ memory  # (B,T,d_m)
        return torch.tanh(self.attn_out(torch.cat([context, h], dim=-1)))

    def step_weights(self, dtype: torch.dtype | None) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor | None]]:
        """The LSTM's parameters arranged for :meth:`run_steps` (nn.LSTM's own, so checkpoints are unchanged):
        ``(W_x, b_0, [W_0, …], [None, b_1, …])`` with ``W_x`` layer 0's input weight for the embedding, ``b_k`` =
        b_ih + b_hh, and ``W_k`` = [W_ih | W_hh] for the input ``[feed; h_{t-1}]`` (layer 0) or
        ``[h^{k-1}_t; h^k_{t-1}]`` (layer k). In ``dtype`` (autocast's) where given. Without autograd (decoding
        with ``own_steps=True``, which calls the decoder once per step) they are kept until a parameter changes."""
        if torch.is_grad_enabled():
            return self._arrange_step_weights(dtype)
        key = (dtype, tuple((p.data_ptr(), p._version) for p in self.lstm.parameters()))
        if self._step_weights is None or self._step_weights[0] != key:
            self._step_weights = (key, self._arrange_step_weights(dtype))
        return self._step_weights[1]

    def _arrange_step_weights(self, dtype: torch.dtype | None
                              ) -> tuple[Tensor, Tensor, list[Tensor], list[Tensor | None]]:
        lstm, e = self.lstm, self.embedding.embedding_dim
        w_ih0 = lstm.weight_ih_l0
        recurrent = [torch.cat([w_ih0[:, e:], lstm.weight_hh_l0], dim=1)]
        biases: list[Tensor | None] = [None]
        for k in range(1, self.layers):
            recurrent.append(torch.cat([getattr(lstm, f"weight_ih_l{k}"), getattr(lstm, f"weight_hh_l{k}")], dim=1))
            biases.append(getattr(lstm, f"bias_ih_l{k}") + getattr(lstm, f"bias_hh_l{k}"))
        w_x, b_0 = w_ih0[:, :e], lstm.bias_ih_l0 + lstm.bias_hh_l0
        if dtype is not None:
            recurrent = [w.to(dtype) for w in recurrent]
            w_x = w_x.to(dtype)
        return w_x, b_0, recurrent, biases

    def run_steps(self, x: Tensor, hc: tuple[Tensor, Tensor], feed: Tensor | None, memory: Tensor,
                  memory_mask: Tensor | None) -> tuple[Tensor, tuple[Tensor, Tensor], Tensor | None]:
        """The stacked LSTM one step at a time, as nn.LSTM computes it (gates i, f, g, o; dropout between layers
        in training), with attention after every step when ``feed`` (input feeding) is given.

        x (B,T,E), hc two (layers,B,d_h), feed (B,d_h) | None → (h̃ (B,T,d_h) with input feeding, else the top
        layer's h (B,T,d_h); hc; feed). The embedding's share of layer 0's gates is one matmul over all T steps,
        each step one matmul per layer, and in training each layer's weight gradient one matmul over all steps
        (:class:`_SharedWeight`); nn.LSTM called on single steps costs several times that on the CPU (oneDNN
        prepares its weights on every call).
        """
        dtype = autocast_dtype(x)
        w_x, b_0, recurrent, biases = self.step_weights(dtype)
        x = in_dtype_of(x, w_x)  # the bf16 decoding copy: bf16 LSTM weights, float32 embeddings
        # every step's W_x y_{t-1} + b at once; unbound, not indexed per step, whose backward would write a zero
        # (B,T,4d_h) tensor per step
        x_gates = F.linear(x, w_x, b_0).unbind(1)  # T × (B,4d_h)
        recurrent, tapes = zip(*[taped(w) for w in recurrent])  # per layer: the weight (taped in training), its tape
        if dtype is not None:  # the state stays float32 under autocast (the initial state may come out of it bf16)
            hc = (hc[0].float(), hc[1].float())
        hs, cs = list(hc[0].unbind(0)), list(hc[1].unbind(0))
        inter_dropout = self.lstm.dropout if self.training else 0.0
        outputs = []
        for t in range(x.size(1)):
            inp = hs[0] if feed is None else torch.cat([feed, hs[0]], dim=-1)
            gates = x_gates[t] + step_linear(inp, recurrent[0], tapes[0])
            for k in range(self.layers):
                if k:
                    below = dropout(hs[k - 1], inter_dropout, True) if inter_dropout else hs[k - 1]
                    gates = step_linear(torch.cat([below, hs[k]], dim=-1), recurrent[k], tapes[k]) + biases[k]
                hs[k], cs[k] = lstm_cell(gates, cs[k])
            if feed is not None:
                feed = self.attend(hs[-1][:, None], memory, memory_mask)[:, 0]  # h̃_t (B,d_h)
            outputs.append(hs[-1] if feed is None else feed)
        return torch.stack(outputs, dim=1), (torch.stack(hs), torch.stack(cs)), feed

    def lstm_steps(self, x: Tensor, hc: tuple[Tensor, Tensor], feed: Tensor, memory: Tensor,
                   memory_mask: Tensor | None) -> tuple[Tensor, tuple[Tensor, Tensor], Tensor]:
        """:meth:`run_steps` with input feeding by nn.LSTM, called once per step (``own_steps=False``)."""
        outputs = []
        for t in range(x.size(1)):
            h, hc = run_lstm(self.lstm, torch.cat([x[:, t:t + 1], feed[:, None]], dim=-1), hc)  # (B,1,d_h)
            feed = self.attend(h, memory, memory_mask)[:, 0]  # (B,d_h)
            outputs.append(feed)
        return torch.stack(outputs, dim=1), hc, feed

    def forward(self, tgt_in: Tensor, memory: Tensor, memory_mask: Tensor | None = None,
                state: State | None = None) -> Tensor:
        """tgt_in (B,T), memory (B,K,d_m), memory_mask (B,K) True = pad | None → logits (B,T,V)."""
        b = tgt_in.size(0)
        keys = (f"{self.name}.h", f"{self.name}.c", f"{self.name}.feed")
        if state is not None and keys[0] in state:
            hc = (state[keys[0]].transpose(0, 1).contiguous(), state[keys[1]].transpose(0, 1).contiguous())
            feed = state.get(keys[2])
        else:
            hc = self.initial_state(memory, memory_mask)
            feed = memory.new_zeros(b, self.hidden_dim)
        x = dropout(self.embedding(tgt_in), self.dropout, self.training)  # (B,T,E)
        own = self.own_steps if self.own_steps is not None else (x.device.type == "cpu" and torch.is_grad_enabled())
        if own and (self.input_feeding or tgt_in.size(1) == 1):  # step by step, or an incremental decoding step
            out, hc, feed = self.run_steps(x, hc, feed if self.input_feeding else None, memory, memory_mask)
            h_tilde = out if self.input_feeding else self.attend(out, memory, memory_mask)
        elif self.input_feeding:  # h̃_{t-1} is an input of step t: one step at a time
            h_tilde, hc, feed = self.lstm_steps(x, hc, feed, memory, memory_mask)
        else:
            h, hc = run_lstm(self.lstm, x, hc)
            h_tilde = self.attend(h, memory, memory_mask)
        if state is not None:
            state[keys[0]], state[keys[1]] = hc[0].transpose(0, 1), hc[1].transpose(0, 1)  # (B,layers,d_h)
            if self.input_feeding:
                state[keys[2]] = feed
        return output_logits(dropout(h_tilde, self.dropout, self.training), self.output_weight)  # (B,T,V)


def lstm_cell(gates: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """One LSTM step from its pre-activations ``gates`` (B,4d) in nn.LSTM's order i, f, g, o and the cell c (B,d):
    c' = σ(f)⊙c + σ(i)⊙tanh(g), h' = σ(o)⊙tanh(c') (in c's dtype: float32 under autocast) → (h', c')."""
    i, f, g, o = gates.to(c.dtype).chunk(4, dim=-1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c


def output_projection(embedding: nn.Embedding, tie: bool) -> nn.Parameter:
    """The output matrix W_s (V,d): the embedding's own weight when tied, else a new N(0, d^-1/2) matrix."""
    if tie:
        return embedding.weight
    v, d = embedding.weight.shape
    return nn.Parameter(nn.init.normal_(embedding.weight.new_empty(v, d), std=d ** -0.5))


@register_model("rnn", RNNConfig)
class RNNModel(EncoderDecoder):
    """Attentional BiLSTM encoder–decoder for one direction (SPEC §1)."""

    def __init__(self, cfg: RNNConfig, vocabs: Vocabularies) -> None:
        super().__init__()
        self.config = cfg
        src_emb = token_embedding(vocabs.src_size, cfg.hidden_dim)
        share_all = cfg.tie_embeddings and vocabs.joint and vocabs.src_size == vocabs.tgt_size
        tgt_emb = src_emb if share_all else token_embedding(vocabs.tgt_size, cfg.hidden_dim)
        self.encoder = BiLSTMEncoder(src_emb, cfg.hidden_dim, cfg.encoder_layers, cfg.dropout)
        self.decoder = LuongDecoder(tgt_emb, cfg.hidden_dim, cfg.hidden_dim, cfg.decoder_layers, cfg.dropout,
                                    output_projection(tgt_emb, cfg.tie_embeddings), input_feeding=cfg.input_feeding)

    def encode(self, src: Tensor) -> EncoderOut:
        return self.encoder(src)

    def decode(self, tgt_in: Tensor, enc: EncoderOut, state: State | None = None) -> Tensor:
        return self.decoder(tgt_in, enc["out"], enc["padding_mask"], state)
