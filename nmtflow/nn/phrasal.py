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

**Vectorised.** Phrase keys are strided windows of K' (``unfold``: (B,H,S_n,n·Dh)), so A_n is one batched
matmul; V_n sums the window diagonal of the per-offset value projections (``unfold`` + ``diagonal``). The
only Python loops run over the few n values.

**Masks** (no padding of the sequences, SPEC §3). A key sequence shorter than n has no n-grams (S_n = 0).
A phrase containing a padding position is masked. With ``causal``, phrase j of size n is visible to the
query at absolute position p only if ``j + n − 1 ≤ p``. A query that sees nothing (e.g. position 0 with
``ngrams: [2]`` under ``causal``) gets all-zero weights and a zero context.

**Incremental decoding.** Self-attention keeps, batch-first under ``state[name + …]``: ``.tail_k``/``.tail_v``,
the key and per-offset value projections of the last N − 1 positions (N = max n), and per n the phrase keys
``.phrase{n}.k`` (B,H,S_n,n·Dh) and phrase values ``.phrase{n}.v`` (B,H,S_n,Dh) seen so far. New tokens
complete new windows with the tail; nothing is recomputed over the prefix. The prefix length is
``tail length + S_N``. Named like standard key/value caches, the phrase caches take part in beam search's
deferred reordering (:func:`~nmtflow.nn.attention.defer_cache_reorder`): a new beam order is applied when the
next step extends them, in the same copy; the small tails are reordered at once. Cross-attention caches
the phrase keys/values of the encoder output once under ``.static_phrase_k{n}``/``.static_phrase_v{n}``
(beam search reorders those only when sentences are pruned).

**Weights for analysis** (``ctx.need_weights``): one tensor (B,H,T,ΣS_n), the softmax over the concatenation
in ``ngrams`` order — ``[:S_1]`` token-to-token, the rest token-to-phrase. :func:`phrase_counts` gives the
split sizes from the key length, :func:`split_phrasal_weights` splits it per n.

Initialisation (the paper is silent): every d×d block is Xavier-uniform with gain 1/√2 like the standard
projections, the value kernels scaled by 1/√n so that V_n starts with the variance of a single value.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from nmtflow.config import ConfigError
from nmtflow.nn.attention import (ROWS, AttentionConfig, AttentionContext, MultiHeadAttention, extend_cache,
                                   merge_heads, split_heads)
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


# ---- windows over a sequence axis ----------------------------------------------------------------------
def phrase_counts(ngrams: list[int], length: int) -> list[int]:
    """Number of n-grams S_n = max(length − n + 1, 0) of a key sequence, per n."""
    return [max(length - n + 1, 0) for n in ngrams]


def split_phrasal_weights(weights: Tensor, ngrams: list[int], key_length: int) -> dict[int, Tensor]:
    """(…, ΣS_n) weights of a phrasal module → {n: (…, S_n)}; ``[1]`` for standard attention weights."""
    return dict(zip(ngrams, weights.split(phrase_counts(ngrams, key_length), dim=-1)))


def windows(x: Tensor, dim: int, n: int) -> Tensor:
    """Width-n windows (stride 1) along ``dim`` as a view: size S → S − n + 1 (0 if S < n), window last."""
    if x.size(dim) < n:
        return x.narrow(dim, 0, 0).unsqueeze(-1).expand(*x.shape[:dim], 0, *x.shape[dim + 1:], n)
    return x.unfold(dim, n, 1)


def phrase_keys(k: Tensor, n: int) -> Tensor:
    """K' (B,H,S,Dh) → phrase keys (B,H,S_n,n·Dh): row j is [K'[j]; …; K'[j+n−1]]."""
    b, h, _, dh = k.shape
    w = windows(k, 2, n).transpose(-1, -2)  # (B,H,S_n,n,Dh)
    return w.reshape(b, h, w.size(2), n * dh)


def phrase_values(p: Tensor) -> Tensor:
    """Per-offset value projections (B,H,S,n,Dh), p[s, t] = W_{v,n}[t] V[s] → V_n (B,H,S_n,Dh)."""
    n = p.size(3)
    w = windows(p, 2, n)  # (B,H,S_n,n_t,Dh,n_w): window position n_w, kernel row n_t
    return w.diagonal(dim1=3, dim2=5).sum(-1)  # Σ_t p[j+t, t]


def phrase_padding(key_padding_mask: Tensor, n: int) -> Tensor:
    """(B,S) True = pad → (B,S_n) True = the phrase contains a padding position."""
    return windows(key_padding_mask, 1, n).any(-1)


@register_attention("phrasal", PhrasalOptions)
class PhrasalAttention(MultiHeadAttention):
    """Attention over tokens and n-gram phrases of the keys in one softmax (module docstring; SPEC §3)."""

    options: PhrasalOptions

    def __init__(self, d_model: int, heads: int, *, dropout: float = 0.0, self_attention: bool = True,
                 name: str = "attn", options: AttentionConfig | None = None) -> None:
        options = options if isinstance(options, PhrasalOptions) else PhrasalOptions()
        super().__init__(d_model, heads, dropout=dropout, self_attention=self_attention, name=name, options=options)
        self.ngrams = list(options.ngrams)
        self.offsets = [sum(self.ngrams[:i]) for i in range(len(self.ngrams))]  # of n's kernel rows in Σn
        total = sum(self.ngrams)
        self.q_proj = nn.Linear(d_model, total * d_model, bias=False)  # all W_{q,n}
        self.v_proj = nn.Linear(d_model, total * d_model, bias=False)  # all W_{v,n}[t]
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

    # ---- projections ----------------------------------------------------------------------------------
    def project_queries(self, query: Tensor) -> list[Tensor]:
        """query (B,T,D) → per n: Q_n / √(Dh·n) (B,H,T,n·Dh), kernel row t at [t·Dh:(t+1)·Dh]."""
        b, t, _ = query.shape
        parts = self.q_proj(query).split([n * self.d_model for n in self.ngrams], dim=-1)
        return [p.view(b, t, self.heads, n * self.head_dim).transpose(1, 2) / math.sqrt(self.head_dim * n)
                for n, p in zip(self.ngrams, parts)]

    def project_kv(self, source: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        """source (B,S,D) → K' (B,H,S,Dh) and per-offset value projections (B,H,S,Σn,Dh)."""
        b, s, _ = source.shape
        v = self.v_proj(source).view(b, s, sum(self.ngrams), self.heads, self.head_dim)
        return split_heads(self.k_proj(source), self.heads), v.permute(0, 3, 1, 2, 4)

    def phrases(self, k: Tensor, v: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """K' (B,H,S,Dh), value projections (B,H,S,Σn,Dh) → per n: phrase keys and values V_n."""
        keys = [phrase_keys(k, n) for n in self.ngrams]
        values = [phrase_values(v[:, :, :, o:o + n]) for n, o in zip(self.ngrams, self.offsets)]
        return keys, values

    # ---- the interface --------------------------------------------------------------------------------
    def forward(self, query: Tensor, source: Tensor, *, key_padding_mask: Tensor | None = None,
                causal: bool = False, state: dict[str, Tensor] | None = None,
                ctx: AttentionContext | None = None) -> tuple[Tensor, Tensor | None]:
        """query (B,T,D), source (B,S,D) → (B,T,D) and, with ``ctx.need_weights``, weights (B,H,T,ΣS_n)."""
        ctx = ctx or AttentionContext()
        queries = self.project_queries(query)
        keys, values, length = self._phrase_kv(source, state, ctx)
        if key_padding_mask is not None and key_padding_mask.size(1) != length:
            raise ValueError(f"{self.name}: key_padding_mask covers {key_padding_mask.size(1)} keys, not {length}")
        visible = self.visibility(length, query.size(1), key_padding_mask, causal, query.device)
        out, weights = self.attend_phrases(queries, keys, values, visible, ctx)
        return self.out_proj(merge_heads(out)), weights

    def visibility(self, length: int, t: int, key_padding_mask: Tensor | None, causal: bool,
                   device: torch.device) -> Tensor | None:
        """True = may attend, (B|1, 1, T|1, ΣS_n); queries sit at absolute positions length − T … length − 1."""
        if key_padding_mask is None and not causal:
            return None
        masks = []
        for n, s_n in zip(self.ngrams, phrase_counts(self.ngrams, length)):
            m = torch.ones(1, 1, 1, s_n, dtype=torch.bool, device=device)
            if key_padding_mask is not None:
                m = ~phrase_padding(key_padding_mask, n)[:, None, None, :]  # (B,1,1,S_n)
            if causal:
                last = torch.arange(s_n, device=device) + n - 1  # last token of phrase j
                position = torch.arange(t, device=device) + length - t  # absolute query positions
                m = m & (last[None, :] <= position[:, None])  # (…,T,S_n)
            masks.append(m)
        shape = torch.broadcast_shapes(*(m.shape[:-1] for m in masks))
        return torch.cat([m.expand(*shape, m.size(-1)) for m in masks], dim=-1)

    def attend_phrases(self, queries: list[Tensor], keys: list[Tensor], values: list[Tensor],
                       visible: Tensor | None, ctx: AttentionContext) -> tuple[Tensor, Tensor | None]:
        """One softmax over [A_1; …; A_N] (SPEC §3), then C = P [V_1; …; V_N] → (B,H,T,Dh), weights."""
        scores = torch.cat([q @ k.transpose(-1, -2) for q, k in zip(queries, keys)], dim=-1)  # (B,H,T,ΣS_n)
        if visible is not None:
            dead = ~visible.any(-1, keepdim=True)  # queries that see no token or phrase at all
            scores = scores.masked_fill(~visible, float("-inf")).masked_fill(dead, 0.0)
        weights = scores.softmax(-1)
        if visible is not None:
            weights = weights.masked_fill(dead, 0.0)
        p = self.dropout if self.training else 0.0
        out = F.dropout(weights, p, self.training) @ torch.cat(values, dim=2)  # (B,H,T,Dh)
        return out, (weights if ctx.need_weights else None)

    # ---- keys and values, with or without a cache --------------------------------------------------------
    def _phrase_kv(self, source: Tensor, state: dict[str, Tensor] | None,
                   ctx: AttentionContext) -> tuple[list[Tensor], list[Tensor], int]:
        """Phrase keys/values per n over the whole key sequence, and its length S."""
        if state is None:
            return (*self.phrases(*self.project_kv(source, ctx)), source.size(1))
        if not self.self_attention:
            first = f"{self.name}.static_phrase_k{self.ngrams[0]}"
            if first not in state:
                keys, values = self.phrases(*self.project_kv(source, ctx))
                for n, k, v in zip(self.ngrams, keys, values):
                    state[f"{self.name}.static_phrase_k{n}"], state[f"{self.name}.static_phrase_v{n}"] = k, v
            return ([state[f"{self.name}.static_phrase_k{n}"] for n in self.ngrams],
                    [state[f"{self.name}.static_phrase_v{n}"] for n in self.ngrams], source.size(1))
        return self._extend_cache(source, state, ctx)

    def _extend_cache(self, source: Tensor, state: dict[str, Tensor],
                      ctx: AttentionContext) -> tuple[list[Tensor], list[Tensor], int]:
        """Self-attention step: the new positions complete new windows with the cached tail."""
        name, t, keep = self.name, source.size(1), max(self.ngrams) - 1
        k, v = self.project_kv(source, ctx)  # (B,H,T,Dh), (B,H,T,Σn,Dh)
        cached = f"{name}.tail_k" in state
        if cached:
            previous = state[f"{name}.tail_k"].size(2) + state[f"{name}.phrase{max(self.ngrams)}.k"].size(2)
            k = torch.cat([state[f"{name}.tail_k"], k], dim=2)  # (B,H,tail+T,Dh)
            v = torch.cat([state[f"{name}.tail_v"], v], dim=2)
        else:
            previous = 0
        tail = k.size(2) - t  # cached positions in front of the new ones
        new_keys, new_values = [], []
        for n, o in zip(self.ngrams, self.offsets):
            start = max(tail - (n - 1), 0)  # windows of k[start:] are exactly those ending at a new position
            new_keys.append(phrase_keys(k[:, :, start:], n))
            new_values.append(phrase_values(v[:, :, start:, o:o + n]))
        keys, values = [], []
        for n, nk, nv in zip(self.ngrams, new_keys, new_values):
            cache = f"{name}.phrase{n}"
            if cached:  # in the beam order left pending by beam search, if any: gathered and extended in one copy
                rows = state.pop(cache + ROWS, None)
                nk = extend_cache(state[cache + ".k"], nk, rows)
                nv = extend_cache(state[cache + ".v"], nv, rows)
            state[cache + ".k"], state[cache + ".v"] = nk, nv
            keys.append(nk)
            values.append(nv)
        start = max(k.size(2) - keep, 0)
        state[f"{name}.tail_k"], state[f"{name}.tail_v"] = k[:, :, start:], v[:, :, start:]
        return keys, values, previous + t
