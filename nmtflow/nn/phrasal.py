"""Multi-headed phrasal attention (Nguyen et al., ICLR 2020 submission; SPEC §3): token-to-phrase attention.

Per head (head size ``Dh``) and for each n in ``ngrams`` (SPEC §3; paper Eq. 7-12)::

    Q_n = Q W_{q,n}                                   d → n·Dh per head: one kernel row Q_n[i, t] per offset t
    K'  = K W_k                                       shared by every n
    A_n[i, j] = Σ_{t<n} Q_n[i, t] · K'[j + t] / √(Dh·n)        j = 0 … S − n   (S_n = S − n + 1 phrases)
    V_n[j]    = Σ_{t<n} W_{v,n}[t] V[j + t]           a width-n convolution over the values, W_{v,n} ∈ R^{n×d×d}
    P = softmax([A_1 ; … ; A_N])                      one distribution over all tokens and phrases
    C = P [V_1 ; … ; V_N]                             then the usual output projection W_o

Here Q, K, V are the module inputs (d-dimensional; K = V = the key/value source), as in the paper's Eq. 5-6.
For n = 1 this is exactly standard attention, so ``ngrams: [1]`` reproduces :class:`MultiHeadAttention`.

**Weights and the exact parameter delta.** ``W_{q,n}`` maps d → n·d over all heads (``n·d²``), ``W_{v,n}``
holds n kernel matrices of d×d (``n·d²``), ``W_k`` and ``W_o`` are d×d, none has a bias (SPEC §1). A module
thus has ``(2·Σn + 2)·d²`` parameters against the standard ``4·d²``: a delta of ``2·(Σn − 1)·d²`` per
attention module (SPEC §3). With all 18 modules of a 6+6 base model (d = 512): {1,2} adds 18·4·d² =
18,874,368 and {1,2,3} adds 18·10·d² = 47,185,920. All ``W_{q,n}`` live in one fused ``q_proj``
(d → Σn·d; per n the features are laid out (H, n, Dh)) and all ``W_{v,n}[t]`` in one fused ``v_proj``
(d → Σn·d; per n laid out (n, H, Dh)), so each side is one matmul.

**Slots by last token.** Phrase j of size n is kept in slot (e, n) of its last token e = j + n − 1, so
that every key position e holds one slot per n (slot (e, n) is empty while e < n − 1): scores (B,H,T,S,N')
and values (B,H,S,N',Dh) (N' = len(ngrams)) are laid out position-major and flattened to S·N' for one
softmax and one matmul. A new token completes exactly its own slots, so a decoding cache grows by appending,
like a standard one, and causality is the standard rule on e (slot e visible to position p iff e ≤ p).

**Vectorised, no copies of keys per n.** One matmul gives R = Q_n[i, t] · K'[s] for all n, t and s
(B,H,T,Σn,S); A_n is the sum of R along a diagonal (a strided view of R, :func:`ngram_windows`), and V_n is
the same diagonal sum over the per-offset value projections (a width-n convolution). :class:`PhraseSums`
writes these sums straight into the slot layout and scatters its gradient back in place, so neither R nor
any per-n copy of the keys is kept for backward. The only Python loops run over the few n values.

**Masks** (no padding of the sequences, SPEC §3), built once per stack forward (``ctx.shared``) or once per
sentence (cross-attention caches) as an additive bias: an empty slot, a phrase containing a padding
position, and with ``causal`` a phrase ending after the query (``j + n − 1 > p``), get weight 0. A query
that sees nothing (e.g. position 0 with ``ngrams: [2]`` under ``causal``) gets all-zero weights and a zero
context.

**Incremental decoding.** Self-attention keeps, batch-first, the keys K' transposed, ``state[name + ".k"]``
(B,H,Dh,S) contiguous (Q·K'ᵀ then runs several times faster on a CPU than from (B,H,S,Dh)), and the slot values
``state[name + ".v"]`` (B,H,S,N'·Dh), like a standard key/value cache (beam search's deferred reordering applies:
:func:`~nmtflow.nn.attention.defer_cache_reorder`), and ``.tail``, the per-offset value projections of the
last N − 1 positions (N = max n): new tokens complete their phrases with the tail, nothing is recomputed over
the prefix. Cross-attention caches K', the slot values and the mask of the encoder output once (``.static_k``,
transposed too, ``.static_v``/``.static_bias``, and ``.static_dead`` if some sentence has nothing to attend to).
A decoding step without padding takes its mask as a prefix of one table (:meth:`PhrasalAttention.unpadded_step_bias`).

**Weights for analysis** (``ctx.need_weights``): one tensor (B,H,T,ΣS_n), the softmax over the concatenation
in ``ngrams`` order — ``[:S_1]`` token-to-token, the rest token-to-phrase, each block by phrase start j.
:func:`phrase_counts` gives the split sizes from the key length, :func:`split_phrasal_weights` splits it per n.

Initialisation (the paper is silent): every d×d block is Xavier-uniform with gain 1/√2 like the standard
projections, the value kernels scaled by 1/√n so that V_n starts with the variance of a single value.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmtflow.config import ConfigError
from nmtflow.nn.attention import (AttentionConfig, AttentionContext, MultiHeadAttention, append_to_cache, merge_heads,
                                   split_heads)
from nmtflow.nn.dropout import dropout
from nmtflow.registry import register_attention


@dataclass
class PhrasalOptions(AttentionConfig):
    """``{type: phrasal, ngrams: [1, 2]}``: the n-gram sizes every head attends to, in increasing order."""

    type: str = "phrasal"
    ngrams: list[int] = field(default_factory=lambda: [1, 2])

    def validate(self, where: str) -> None:
        ok = bool(self.ngrams) and all(n >= 1 for n in self.ngrams)
        if not ok or any(a >= b for a, b in zip(self.ngrams, self.ngrams[1:])):
            raise ConfigError(f"{where}.ngrams: expected distinct positive integers in increasing order, "
                              f"got {self.ngrams!r}")


# ---- phrases as slots of their last token ----------------------------------------------------------------
def phrase_counts(ngrams: list[int], length: int) -> list[int]:
    """Number of n-grams S_n = max(length − n + 1, 0) of a key sequence, per n."""
    return [max(length - n + 1, 0) for n in ngrams]


def split_phrasal_weights(weights: Tensor, ngrams: list[int], key_length: int) -> dict[int, Tensor]:
    """(…, ΣS_n) weights of a phrasal module → {n: (…, S_n)}; ``[1]`` for standard attention weights."""
    return dict(zip(ngrams, weights.split(phrase_counts(ngrams, key_length), dim=-1)))


def ngram_windows(x: Tensor, pos_dim: int, slot_dim: int, first_slot: int, n: int, start: int,
                  count: int) -> Tensor:
    """A strided view v of ``x`` with ``v[…e…t…] = x[pos = start + e + t, slot = first_slot + t]``:
    ``count`` windows along ``pos_dim``, their n offsets t along ``slot_dim`` (one diagonal per window)."""
    size, stride = list(x.shape), list(x.stride())
    size[pos_dim], size[slot_dim] = count, n
    stride[slot_dim] += stride[pos_dim]
    return x.as_strided(size, stride, x.storage_offset() + start * x.stride(pos_dim)
                        + first_slot * x.stride(slot_dim))


class PhraseSums(torch.autograd.Function):
    """Diagonal sums per n-gram, in the slot layout. ``x`` has positions along ``pos_dim`` and the Σn kernel
    rows along ``slot_dim`` (those of the k-th n = ``ngrams[k]`` from o_k = Σ_{i<k} ngrams[i] on);
    ``out[…e…k…] = Σ_{t<n} x[pos = first + e − n + 1 + t, slot = o_k + t]`` for e < ``count``: the phrase of size
    n ending at position ``first + e`` (0 where it would start before x). ``out`` has x's dims with ``pos_dim`` →
    count and ``slot_dim`` → one per n, its memory laid out in the dim order ``order``. Backward scatters into
    one zero gradient in place: nothing is saved, no per-n copy of ``x`` or of its gradient is made."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, pos_dim: int, slot_dim: int, ngrams: tuple[int, ...], first: int,
                count: int, order: tuple[int, ...]) -> Tensor:
        ctx.geometry = (x.shape, pos_dim, slot_dim, ngrams, first, count)
        shape = list(x.shape)
        shape[pos_dim], shape[slot_dim] = count, len(ngrams)
        out = x.new_empty([shape[d] for d in order]).permute([order.index(d) for d in range(len(order))])
        for k, (n, offset, empty) in enumerate(_windows_per_n(ngrams, first, count)):
            slots = out.narrow(slot_dim, k, 1)
            if empty:
                slots.narrow(pos_dim, 0, empty).zero_()
            if empty < count:
                window = ngram_windows(x, pos_dim, slot_dim, offset, n, first + empty - n + 1, count - empty)
                sum_into(slots.narrow(pos_dim, empty, count - empty).squeeze(slot_dim), window.unbind(slot_dim))
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        shape, pos_dim, slot_dim, ngrams, first, count = ctx.geometry
        grad_x = grad.new_zeros(shape)
        for k, (n, offset, empty) in enumerate(_windows_per_n(ngrams, first, count)):
            if empty < count:
                window = ngram_windows(grad_x, pos_dim, slot_dim, offset, n, first + empty - n + 1, count - empty)
                window.add_(grad.narrow(slot_dim, k, 1).narrow(pos_dim, empty, count - empty))
        return grad_x, None, None, None, None, None, None


def sum_into(dst: Tensor, terms: tuple[Tensor, ...] | list[Tensor]) -> Tensor:
    """``dst = terms[0] + terms[1] + …`` in place, left to right (n − 1 additions, or a copy: a reduction into
    ``out=`` would zero-fill it first)."""
    if len(terms) == 1:
        return dst.copy_(terms[0])
    torch.add(terms[0], terms[1], out=dst)
    for term in terms[2:]:
        dst.add_(term)
    return dst


def phrase_sums(x: Tensor, pos_dim: int, slot_dim: int, ngrams: tuple[int, ...], first: int, count: int,
                order: tuple[int, ...]) -> Tensor:
    """:class:`PhraseSums`; in a compiled layer (``train.compile``) the same sums as shifted slices added up, which
    the compiler fuses (its strided views and in-place backward are opaque to it)."""
    if not torch.compiler.is_compiling():
        return PhraseSums.apply(x, pos_dim, slot_dim, ngrams, first, count, order)
    per_n = []
    for n, offset, empty in _windows_per_n.__wrapped__(ngrams, first, count):  # (the cache is opaque to it)
        shape = list(x.shape)
        shape[pos_dim], shape[slot_dim] = empty, 1
        parts = [x.new_zeros(shape)] if empty or not count else []
        if empty < count:
            parts.append(sum(x.narrow(slot_dim, offset + t, 1).narrow(pos_dim, first + empty - n + 1 + t,
                                                                      count - empty) for t in range(n)))
        per_n.append(torch.cat(parts, pos_dim) if len(parts) > 1 else parts[0])
    return torch.cat(per_n, slot_dim)


@functools.lru_cache(maxsize=4096)
def _windows_per_n(ngrams: tuple[int, ...], first: int, count: int) -> list[tuple[int, int, int]]:
    """Per n: (n, its first kernel row in Σn, how many of the ``count`` slots from ``first`` on are empty)."""
    offsets = [sum(ngrams[:k]) for k in range(len(ngrams))]
    return [(n, o, min(max(n - 1 - first, 0), count)) for n, o in zip(ngrams, offsets)]


def phrase_visibility(ngrams: list[int], length: int, t: int, key_padding_mask: Tensor | None, causal: bool,
                      device: torch.device) -> Tensor:
    """True = may attend, (B|1, 1, T|1, S, len(ngrams)) over the slots (e, n) of ``length`` keys: the phrase
    ending at e exists (e ≥ n − 1), holds no padding position, and with ``causal`` ends no later than the query
    (queries at absolute positions length − T … length − 1)."""
    n = torch.tensor(ngrams, device=device)
    end = torch.arange(length, device=device)
    if key_padding_mask is None:
        visible = (end[:, None] >= n - 1)[None, None, None]
    else:  # pads counted by prefix sums, positions before the sequence counting as padding
        big = max(ngrams)
        pads = F.pad(key_padding_mask, (big, 0), value=True).long().cumsum(1)  # (B, N+S)
        visible = (pads[:, end + big, None] == pads[:, end[:, None] + big - n])[:, None, None]  # (B,1,1,S,K)
    if causal:
        position = torch.arange(length - t, length, device=device)
        visible = visible & (end[None, :] <= position[:, None])[..., None]  # (…,T,S,K)
    return visible


@register_attention("phrasal", PhrasalOptions)
class PhrasalAttention(MultiHeadAttention):
    """Attention over tokens and n-gram phrases of the keys in one softmax (module docstring; SPEC §3)."""

    options: PhrasalOptions

    def __init__(self, d_model: int, heads: int, *, dropout: float = 0.0, self_attention: bool = True,
                 name: str = "attn", options: AttentionConfig | None = None) -> None:
        options = options if isinstance(options, PhrasalOptions) else PhrasalOptions()
        super().__init__(d_model, heads, dropout=dropout, self_attention=self_attention, name=name, options=options)
        self.ngrams = list(options.ngrams)
        total = sum(self.ngrams)
        self.q_proj = nn.Linear(d_model, total * d_model, bias=False)  # all W_{q,n}
        self.v_proj = nn.Linear(d_model, total * d_model, bias=False)  # all W_{v,n}[t]
        self._scales: dict[tuple[torch.dtype, torch.device], Tensor] = {}  # 1/√(Dh·n) per n, per dtype and device
        self._step_biases: dict[tuple[torch.dtype, torch.device], Tensor] = {}  # see unpadded_step_bias
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if not hasattr(self, "ngrams"):  # the base constructor, before the phrasal projections exist
            return super().reset_parameters()
        bound = math.sqrt(6.0 / (2 * self.d_model)) / math.sqrt(2)  # Xavier-uniform of a d×d block, gain 1/√2
        nn.init.xavier_uniform_(self.k_proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.out_proj.weight)
        with torch.no_grad():
            self.q_proj.weight.uniform_(-bound, bound)
            for n, rows in zip(self.ngrams, self.v_proj.weight.split([n * self.d_model for n in self.ngrams])):
                rows.uniform_(-bound / math.sqrt(n), bound / math.sqrt(n))

    def scales(self, like: Tensor) -> Tensor:
        """1/√(Dh·n) per n, in the dtype and on the device of ``like``."""
        key = (like.dtype, like.device)
        compiling = torch.compiler.is_compiling()  # a constant in a compiled graph: the cache would cost a recompile
        if compiling or key not in self._scales:
            values = torch.tensor([1 / math.sqrt(self.head_dim * n) for n in self.ngrams], dtype=like.dtype,
                                  device=like.device)
            if compiling:
                return values
            self._scales[key] = values
        return self._scales[key]

    # ---- projections ----------------------------------------------------------------------------------
    def project_queries(self, query: Tensor) -> Tensor:
        """query (B,T,D) → Q (B,H,T,Σn,Dh): per head the kernel rows Q_n[i, t] of every n, in ``ngrams`` order."""
        b, t, _ = query.shape
        parts = self.q_proj(query).split([n * self.d_model for n in self.ngrams], dim=-1)
        return torch.cat([p.view(b, t, self.heads, n, self.head_dim).transpose(1, 2)
                          for n, p in zip(self.ngrams, parts)], dim=3)

    def project_kv(self, source: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        """source (B,S,D) → K'ᵀ (B,H,Dh,S) (a view) and the slot values (B,H,S,N'·Dh): V_n of the phrase ending
        at e. Keys are handled transposed: Q·K'ᵀ runs several times faster from a contiguous (B,H,Dh,S) cache."""
        return self.keys_t(source), self.phrase_values(self.v_proj(source), 0)

    def keys_t(self, source: Tensor) -> Tensor:
        """source (B,S,D) → K'ᵀ (B,H,Dh,S), a view."""
        return split_heads(self.k_proj(source), self.heads).transpose(-1, -2)

    def phrase_values(self, p: Tensor, first: int) -> Tensor:
        """Per-offset value projections p (B,L,Σn·D) of L positions → slot values (B,H,L − first,N'·Dh) of the
        phrases ending at positions ``first`` … L − 1 (V_n; zero where one would start before p)."""
        b, length, _ = p.shape
        x = p.view(b, length, sum(self.ngrams), self.heads, self.head_dim)
        out = phrase_sums(x, 1, 2, tuple(self.ngrams), first, length - first, (0, 3, 1, 2, 4))
        return out.permute(0, 3, 1, 2, 4).reshape(b, self.heads, length - first, -1)  # a view

    def step_values(self, tail: Tensor, p: Tensor) -> Tensor:
        """Without autograd: the slot values (B,H,1,N'·Dh) of one new position from its per-offset value
        projections p (B,1,Σn·D) and the cached ones of the positions before it, ``tail`` (B,L,Σn·D), L ≤ N − 1:
        :meth:`phrase_values` of their concatenation, without concatenating (0 for a phrase that would start
        before the sequence)."""
        b, length = tail.size(0), tail.size(1)
        new = p.view(b, sum(self.ngrams), self.heads, self.head_dim)
        old = tail.view(b, length, sum(self.ngrams), self.heads, self.head_dim)
        out = p.new_empty(b, self.heads, len(self.ngrams), self.head_dim)
        for k, (n, offset, _) in enumerate(_windows_per_n(tuple(self.ngrams), 0, 0)):
            if n - 1 > length:
                out[:, :, k].zero_()
            else:  # offset t of the phrase: position length − n + 1 + t of the tail, the new one for t = n − 1
                terms = [old[:, length - n + 1 + t, offset + t] for t in range(n - 1)] + [new[:, offset + n - 1]]
                sum_into(out[:, :, k], terms)
        return out.view(b, self.heads, 1, -1)

    # ---- the interface --------------------------------------------------------------------------------
    def forward(self, query: Tensor, source: Tensor, *, key_padding_mask: Tensor | None = None,
                causal: bool = False, state: dict[str, Tensor] | None = None,
                ctx: AttentionContext | None = None) -> tuple[Tensor, Tensor | None]:
        """query (B,T,D), source (B,S,D) → (B,T,D) and, with ``ctx.need_weights``, weights (B,H,T,ΣS_n)."""
        ctx = ctx or AttentionContext()
        q = self.project_queries(query)
        kt, v = self._keys_values(source, state, ctx)
        length = kt.size(3)
        if key_padding_mask is not None and key_padding_mask.size(1) != length:
            raise ValueError(f"{self.name}: key_padding_mask covers {key_padding_mask.size(1)} keys, not {length}")
        bias, dead = self.mask(q.size(0), length, query.size(1), key_padding_mask, causal, q.dtype, state, ctx)
        out, weights = self.attend_phrases(q, kt, v, bias, dead, ctx)
        return self.out_proj(merge_heads(out)), weights

    def mask(self, batch: int, length: int, t: int, key_padding_mask: Tensor | None, causal: bool,
             dtype: torch.dtype, state: dict[str, Tensor] | None,
             ctx: AttentionContext) -> tuple[Tensor, Tensor | None]:
        """Additive bias (B|1, 1, T|1, S, N'): 0 or the dtype's minimum (:func:`phrase_visibility`), and the
        queries that see nothing (B|1, 1, T|1, 1) or None. Built once per stack forward (``ctx.shared``), for a
        cross-attention cache once per sentence."""
        cached = state is not None and not self.self_attention
        if cached and self.name + ".static_bias" in state:
            return state[self.name + ".static_bias"], state.get(self.name + ".static_dead")
        if torch.compiler.is_compiling():  # in a compiled layer (train.compile): no cache, no data-dependent branch
            return self.visibility_bias(length, t, key_padding_mask, causal, dtype)
        key = ("phrasal.mask", tuple(self.ngrams), length, t, causal, dtype)
        hit = ctx.shared.get(key)
        if hit is not None and hit[0] is key_padding_mask:
            bias, dead = hit[1:]
        elif key_padding_mask is None and t == 1:
            bias, dead = self.unpadded_step_bias(length, dtype)
            ctx.shared[key] = (None, bias, dead)
        else:
            bias, dead = self.visibility_bias(length, t, key_padding_mask, causal, dtype)
            dead = dead if bool(dead.any()) else None
            ctx.shared[key] = (key_padding_mask, bias, dead)
        if cached:  # batch-first, as every state entry
            state[self.name + ".static_bias"] = bias.expand(batch, *bias.shape[1:])
            if dead is not None:
                state[self.name + ".static_dead"] = dead.expand(batch, *dead.shape[1:])
        return bias, dead

    def visibility_bias(self, length: int, t: int, key_padding_mask: Tensor | None, causal: bool,
                        dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """The additive bias of :meth:`mask` from :func:`phrase_visibility`, and which queries see nothing."""
        visible = phrase_visibility(self.ngrams, length, t, key_padding_mask, causal, self.k_proj.weight.device)
        bias = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible,
                                                                                          torch.finfo(dtype).min)
        return bias, ~visible.flatten(-2).any(-1, keepdim=True)

    def unpadded_step_bias(self, length: int, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
        """:meth:`mask` for one query over ``length`` keys without padding, causal or not (the query is the last
        position: causality hides nothing), as in every decoding step: only the empty slots (e < n − 1) are
        hidden. A prefix of one table per dtype and device, grown by doubling, instead of a new mask per step."""
        device = self.k_proj.weight.device
        table = self._step_biases.get((dtype, device))
        if table is None or table.size(3) < length:
            size = max(length, 64 if table is None else 2 * table.size(3))
            visible = phrase_visibility(self.ngrams, size, 1, None, False, device)  # (1,1,1,size,N')
            table = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible,
                                                                                      torch.finfo(dtype).min)
            self._step_biases[(dtype, device)] = table
        dead = None if length >= self.ngrams[0] else torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device)
        return table[:, :, :, :length], dead

    def phrase_scores(self, r: Tensor, bias: Tensor) -> Tensor:
        """Without autograd (decoding): bias + A_n / √(Dh·n) from R (B,H,T,Σn,S) → scores (B,H,T,S,N'), what
        :class:`PhraseSums` and one ``addcmul`` give, with the diagonal sums, the scale and the bias of each n
        written straight into the scores (one pass and one intermediate fewer)."""
        b, h, t, _, s = r.shape
        scores = r.new_empty(b, h, t, s, len(self.ngrams))
        for k, (n, offset, empty) in enumerate(_windows_per_n(tuple(self.ngrams), 0, s)):
            dst, bias_k = scores[..., k], bias[..., k]
            if empty:  # slots of phrases that would start before the keys: the bias alone
                dst[..., :empty].copy_(bias_k[..., :empty])
            if empty == s:
                continue
            terms = ngram_windows(r, 4, 3, offset, n, empty - n + 1, s - empty).unbind(3)
            dst, bias_k, scale = dst[..., empty:], bias_k[..., empty:], 1 / math.sqrt(self.head_dim * n)
            torch.add(bias_k, terms[0] if n == 1 else sum_into(dst, terms), alpha=scale, out=dst)
        return scores

    def attend_phrases(self, q: Tensor, kt: Tensor, v: Tensor, bias: Tensor, dead: Tensor | None,
                       ctx: AttentionContext) -> tuple[Tensor, Tensor | None]:
        """Q (B,H,T,Σn,Dh), K'ᵀ (B,H,Dh,S), slot values (B,H,S,N'·Dh), bias → context (B,H,T,Dh) and weights:
        A_n from diagonal sums of Q K'ᵀ, one softmax over all slots (SPEC §3), C = P V."""
        b, h, t, total, dh = q.shape
        s, kinds = kt.size(3), len(self.ngrams)
        r = torch.matmul(q.view(b, h, t * total, dh), kt).view(b, h, t, total, s)
        if torch.is_grad_enabled():
            sums = phrase_sums(r, 4, 3, tuple(self.ngrams), 0, s, (0, 1, 2, 4, 3)).permute(0, 1, 2, 4, 3)
            scores = torch.addcmul(bias, sums, self.scales(sums))  # (B,H,T,S,N')
        else:
            scores = self.phrase_scores(r, bias)
        weights = scores.view(b, h, t, s * kinds).softmax(-1)
        if dead is not None:
            weights = weights.masked_fill(dead, 0.0)
        p = self.dropout if self.training else 0.0
        out = dropout(weights, p, self.training) @ v.reshape(b, h, s * kinds, dh)  # (B,H,T,Dh)
        if not ctx.need_weights:
            return out, None
        by_slot = weights.view(b, h, t, s, kinds)  # → per n the phrases by start j, in ngrams order
        return out, torch.cat([by_slot[..., n - 1:, i] for i, n in enumerate(self.ngrams)], dim=-1)

    # ---- keys and values, with or without a cache --------------------------------------------------------
    def _keys_values(self, source: Tensor, state: dict[str, Tensor] | None,
                     ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        """K'ᵀ and slot values over the whole key sequence; a self-attention step completes the phrases of its
        new positions with the cached tail of per-offset value projections and appends to the caches. Cached
        keys are contiguous (B,H,Dh,S)."""
        if state is None:
            return self.project_kv(source, ctx)
        if not self.self_attention:
            key = self.name + ".static_k"
            if key not in state:
                kt, state[self.name + ".static_v"] = self.project_kv(source, ctx)
                state[key] = kt.contiguous()
            return state[key], state[self.name + ".static_v"]
        p = self.v_proj(source)  # (B,T,Σn·D)
        tail = state.get(self.name + ".tail")
        keep = max(self.ngrams) - 1
        if tail is not None and source.size(1) == 1 and not torch.is_grad_enabled():  # a decoding step
            v = self.step_values(tail, p)
            p = p if keep == 1 else torch.cat([tail[:, 1 - keep:], p], dim=1)
        else:
            if tail is not None:
                p = torch.cat([tail, p], dim=1)
            v = self.phrase_values(p, p.size(1) - source.size(1))
        if keep:
            state[self.name + ".tail"] = p[:, max(p.size(1) - keep, 0):]
        return append_to_cache(state, self.name, self.keys_t(source), v, key_dim=3)
