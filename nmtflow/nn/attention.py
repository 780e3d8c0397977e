"""The attention interface and standard multi-head attention (Vaswani et al. 2017, Eq. 1-2).

Every attention variant (lexical-shortcut gating, phrasal n-gram attention, the bridge's inner attention)
is a sibling of :class:`MultiHeadAttention` registered by name. A variant overrides one seam:

* :meth:`MultiHeadAttention.project_kv` — how keys/values are computed from the source (and ``ctx``);
* :meth:`MultiHeadAttention.attend` — how queries, keys and values are combined.

Shapes: ``B`` batch, ``T`` query length, ``S`` key length, ``H`` heads, ``Dh`` head size, ``D = H·Dh``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from nmtflow.config import ConfigError
from nmtflow.nn.dropout import dropout
from nmtflow.nn.layers import masked_softmax
from nmtflow.registry import ATTENTIONS, register_attention
from nmtflow.runtime import cpu_info


@dataclass
class AttentionConfig:
    """``{type: NAME, ...options}``; ``type`` selects the registered variant and its options class."""

    type: str = "standard"

    @classmethod
    def resolve(cls, data: dict[str, Any], where: str) -> tuple[type, dict[str, Any]]:
        name = data.get("type", "standard")
        try:
            return ATTENTIONS.get(name).config_cls, data
        except KeyError as exc:
            raise ConfigError(f"{where}.type: {exc.args[0]}") from None

    def check_slot(self, where: str, self_attention: bool) -> None:
        """A ConfigError if these options cannot serve a self-attention (``self_attention``) or a
        decoder-to-encoder slot; called by the model's config, so that ``load_config`` refuses them."""


@dataclass
class AttentionContext:
    """What an attention variant may need beyond its query and key/value source.

    ``embeddings``: the input of layer 1 of the stack that owns the keys (E in Emelin et al. 2019);
    ``layer_inputs``: the inputs H_0 … H_{l-1} of the layers below (for non-lexical shortcuts);
    ``layer``: 0-based index of the current layer; ``need_weights``: return attention weights;
    ``shared``: work the layers of one stack share within one forward pass (see :meth:`~MultiHeadAttention.link`).
    """

    embeddings: Tensor | None = None
    layer_inputs: list[Tensor] = field(default_factory=list)
    layer: int = 0
    need_weights: bool = False
    shared: dict[str, Any] = field(default_factory=dict)


def split_heads(x: Tensor, heads: int) -> Tensor:
    """(B,S,D) → (B,H,S,Dh)."""
    b, s, d = x.shape
    return x.view(b, s, heads, d // heads).transpose(1, 2)


def merge_heads(x: Tensor) -> Tensor:
    """(B,H,T,Dh) → (B,T,D)."""
    b, h, t, dh = x.shape
    return x.transpose(1, 2).reshape(b, t, h * dh)


def causal_mask(mask: Tensor | None, t: int, s: int, device: torch.device) -> Tensor | None:
    """``mask`` (True = may attend) and causality for T queries that are the last T of S positions: query i
    (position S − T + i) sees keys 0 … S − T + i (after a cached prefix too). None when nothing is hidden
    (one query, no mask); (T,S) or ``mask`` broadcast with it otherwise."""
    if t == 1:
        return mask
    allowed = torch.ones(t, s, dtype=torch.bool, device=device).tril(s - t)
    return allowed if mask is None else mask & allowed


ROWS = ".rows"  # state entry: the row order a self-attention cache is still to be read in


EFFICIENT_CAUSAL_MAX_LEN = 128
"""On a GPU, causal self-attention in training over at most this many positions runs on SDPA's memory-efficient
kernel, not flash (0: PyTorch's own choice). At sentence lengths flash's forward + backward is the slower: 0.57 against
0.29 ms at 32 positions, 0.35 / 0.27 at 64, 0.26 / 0.23 at 128 and 0.27 / 0.39 at 256 (16k-token bf16 batches, 8
heads of 64, one H200, ``benchmarks/sdpa_backends.py``). In a Transformer-base step on Multi30k (bf16, ~16k target
tokens) the attention kernels took 5.7 ms instead of 9.0 (``benchmarks/gpu_base.py``)."""


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float, causal: bool) -> Tensor:
    """``F.scaled_dot_product_attention`` (mask True = may attend), except on a CPU in two cases. In bf16 while
    gradients are recorded, PyTorch's CPU kernel runs its backward many times slower than in fp32
    (``benchmarks/bf16_cpu.py``), so the attention itself is computed in fp32 with autocast off, and the result cast
    back; the projections around it stay in bf16. Without gradients, one bf16 query per row (a bf16 decoding step)
    goes to :func:`single_query_attention` where :func:`single_query_products` says so. On a GPU, short causal
    self-attention in training runs on the memory-efficient kernel (:data:`EFFICIENT_CAUSAL_MAX_LEN`)."""
    if (causal and q.is_cuda and k.size(2) <= EFFICIENT_CAUSAL_MAX_LEN and torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and torch.backends.cuda.mem_efficient_sdp_enabled()):
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
    if q.device.type == "cpu" and torch.is_grad_enabled() and (q.dtype == torch.bfloat16
                                                               or torch.is_autocast_enabled("cpu")):
        with torch.autocast("cpu", enabled=False):
            out = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, dropout_p=dropout_p,
                                                 is_causal=causal)
        return out.to(q.dtype)
    if (q.device.type == "cpu" and q.size(-2) == 1 and q.dtype == torch.bfloat16 and not causal and dropout_p == 0.0
            and not torch.is_grad_enabled() and (mask is None or mask.dtype == torch.bool) and single_query_products()):
        return single_query_attention(q, k, v, mask)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=causal)


SINGLE_QUERY_PRODUCTS: bool | None = None  # None: x86 with AVX-512 BF16 and no AMX; True / False: always / never


def single_query_products() -> bool:
    """Whether a bf16 decoding step's attention on the CPU takes :func:`single_query_attention`
    (:data:`SINGLE_QUERY_PRODUCTS`; by default where it was measured to pay, on x86 CPUs with AVX-512 BF16 but no
    AMX, where PyTorch's fused bf16 kernel has no tiles to run on; AMX CPUs, whose bf16 decoding was measured with
    the fused kernel, and CPUs where bf16 is not native or not measured keep it)."""
    if SINGLE_QUERY_PRODUCTS is not None:
        return SINGLE_QUERY_PRODUCTS
    flags = cpu_info()["cpu_flags"]
    return "avx512_bf16" in flags and "amx_bf16" not in flags


def single_query_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """softmax(q Kᵀ / √Dh) V for one bf16 query per row, q (B,H,1,Dh), k/v (B,H,S,Dh), mask broadcastable to
    (B,H,1,S) with True = may attend (a row that may attend to nothing gets zero context, as in SDPA): the scores
    and their softmax in float32 (a bf16 product would round the scores to 8 bits: fewer outputs identical to
    fp32 decoding's), the weights times V as a bf16 product. On a 2-core CPU with AVX-512 BF16 and no AMX,
    PyTorch's fused bf16 kernel took ×2.5–4.4 this function's time for a decoding step (and no less at two threads
    than at one): bf16 beam search ran ×1.08 faster at one thread and ×1.3 at two (``benchmarks/README.md``,
    ``benchmarks/decode_attention.py``)."""
    with torch.autocast("cpu", enabled=False):  # under bf16 autocast the float32 products would be cast down
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * (q.size(-1) ** -0.5)  # (B,H,1,S)
        weights = scores.softmax(-1) if mask is None else masked_softmax(scores, ~mask)
        return torch.matmul(weights.to(v.dtype), v)


def extend_cache(cache: Tensor, new: Tensor, rows: Tensor | None = None, dim: int = 2) -> Tensor:
    """``cat([cache[rows], new], dim)`` for caches (B,H,S,Dh) (positions along ``dim``; phrasal attention keeps
    its keys (B,H,Dh,S), ``dim`` 3), copying the cache once (not gather + cat).

    The single copy (``index_select`` into a slice of the output) is taken on the CPU, where this is
    measured; other devices gather and concatenate.
    """
    if cache.device.type != "cpu":
        return torch.cat([cache if rows is None else cache.index_select(0, rows), new], dim=dim)
    s = cache.size(dim)
    shape = list(new.shape)
    shape[dim] += s
    out = new.new_empty(shape)
    if rows is None:
        out.narrow(dim, 0, s).copy_(cache)
    else:
        torch.index_select(cache, 0, rows, out=out.narrow(dim, 0, s))
    out.narrow(dim, s, new.size(dim)).copy_(new)
    return out


def append_to_cache(state: dict[str, Tensor], name: str, k: Tensor, v: Tensor,
                    key_dim: int = 2) -> tuple[Tensor, Tensor]:
    """Append new keys/values (B,H,T,·) to the self-attention cache ``name.k``/``name.v`` in ``state`` (in the beam
    order left pending by :func:`defer_cache_reorder`, if any: :func:`extend_cache`); returns the whole cache.
    ``key_dim``: the dim of the keys' positions (3 for keys kept transposed, (B,H,Dh,T))."""
    if name + ".k" in state:
        rows = state.pop(name + ROWS, None)
        k = extend_cache(state[name + ".k"], k, rows, key_dim)
        v = extend_cache(state[name + ".v"], v, rows)
    state[name + ".k"], state[name + ".v"] = k, v
    return k, v


def defer_cache_reorder(state: dict[str, Tensor], rows: Tensor) -> set[str]:
    """Record the beam order ``rows`` for every self-attention cache in ``state`` instead of gathering it now.

    Writes ``name + ".rows"`` (composed with an order already pending: ``pending[rows]``) and returns the cache
    keys left as they are; every other entry is for the caller to reorder.
    """
    deferred: set[str] = set()
    for key in [k for k in state if k.endswith(".k") and k[:-2] + ".v" in state]:
        name = key[:-2]
        pending = state.get(name + ROWS)
        state[name + ROWS] = rows if pending is None else pending.index_select(0, rows)
        deferred.update((key, name + ".v", name + ROWS))
    return deferred


@register_attention("standard", AttentionConfig)
class MultiHeadAttention(nn.Module):
    """softmax(Q Kᵀ / √Dh) V over H heads, through ``scaled_dot_product_attention``.

    Projections have no bias (tensor2tensor convention, SPEC §1). ``self_attention`` layers cache their
    keys/values per decoding step in ``state[name + ".k"/".v"]`` (B,H,S,Dh); cross-attention caches the
    projected encoder keys/values once (``.static_k/.static_v``). A beam search may leave the cache in its
    old row order and put the new order in ``state[name + ".rows"]`` (:func:`defer_cache_reorder`): the next
    step then gathers and extends the cache in one copy (:func:`extend_cache`).
    """

    def __init__(self, d_model: int, heads: int, *, dropout: float = 0.0, self_attention: bool = True,
                 name: str = "attn", options: AttentionConfig | None = None) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model={d_model} is not divisible by heads={heads}")
        self.d_model, self.heads, self.head_dim = d_model, heads, d_model // heads
        self.dropout = dropout
        self.self_attention = self_attention
        self.name = name
        self.options = options or AttentionConfig()
        self.q_proj = nn.Linear(d_model, d_model, bias=False)
        self.k_proj = nn.Linear(d_model, d_model, bias=False)
        self.v_proj = nn.Linear(d_model, d_model, bias=False)
        self.out_proj = nn.Linear(d_model, d_model, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            nn.init.xavier_uniform_(proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.out_proj.weight)

    def link(self, stack: list[MultiHeadAttention]) -> None:
        """Called by a layer stack with the modules of this slot in every layer (this one included), bottom to
        top, so that a variant may compute work common to all layers once per forward pass (``ctx.shared``).
        """

    # ---- seams -------------------------------------------------------------------------------------
    def project_kv(self, source: Tensor, ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        """source (B,S,D) → keys, values (B,H,S,Dh).

        Cached decoder self-attention calls it on the new positions only (with their ``ctx.embeddings``) and
        appends the result to the prefix's cached keys/values: an override must compute each position's key and
        value from that position alone (as every built-in variant does), or override ``forward``'s caching too.
        """
        return split_heads(self.k_proj(source), self.heads), split_heads(self.v_proj(source), self.heads)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool,
               ctx: AttentionContext) -> tuple[Tensor, Tensor | None]:
        """q (B,H,T,Dh), k/v (B,H,S,Dh), mask broadcastable to (B,H,T,S) with True = may attend; ``causal``:
        query i sees keys up to S − T + i (:func:`causal_mask`; ``forward`` folds it into ``mask`` unless T = S and
        there is no mask)."""
        p = self.dropout if self.training else 0.0
        if not ctx.need_weights:
            if causal and (mask is not None or q.size(2) != k.size(2)):  # SDPA's is_causal: no mask, T = S only
                mask, causal = causal_mask(mask, q.size(2), k.size(2), q.device), False
            return sdpa(q, k, v, mask, p, causal), None
        scores = q @ k.transpose(-1, -2) / math.sqrt(self.head_dim)  # (B,H,T,S)
        mask = causal_mask(mask, q.size(2), k.size(2), q.device) if causal else mask
        # a query that may attend to nothing (an all-padding source) gets zero weights and context, as in SDPA
        weights = scores.softmax(-1) if mask is None else masked_softmax(scores, ~mask)
        return dropout(weights, p) @ v, weights

    # ---- the interface -----------------------------------------------------------------------------
    def forward(self, query: Tensor, source: Tensor, *, key_padding_mask: Tensor | None = None,
                causal: bool = False, state: dict[str, Tensor] | None = None,
                ctx: AttentionContext | None = None) -> tuple[Tensor, Tensor | None]:
        """query (B,T,D), source (B,S,D), key_padding_mask (B,S) True = pad → (B,T,D), weights (B,H,T,S)."""
        ctx = ctx or AttentionContext()
        q = split_heads(self.q_proj(query), self.heads)
        k, v = self._keys_values(source, state, ctx)
        mask = None
        if key_padding_mask is not None:
            mask = ~key_padding_mask[:, None, None, :]  # (B,1,1,S) True = attend
        if causal and (mask is not None or k.size(2) != q.size(2)):
            # into the mask, so that every ``attend`` sees one convention: ``causal`` only with no mask and T = S
            mask, causal = causal_mask(mask, q.size(2), k.size(2), q.device), False
        out, weights = self.attend(q, k, v, mask, causal, ctx)
        return self.out_proj(merge_heads(out)), weights

    def _keys_values(self, source: Tensor, state: dict[str, Tensor] | None,
                     ctx: AttentionContext) -> tuple[Tensor, Tensor]:
        if state is None:
            return self.project_kv(source, ctx)
        if not self.self_attention:
            key = self.name + ".static_k"
            if key not in state:
                state[key], state[self.name + ".static_v"] = self.project_kv(source, ctx)
            return state[key], state[self.name + ".static_v"]
        return append_to_cache(state, self.name, *self.project_kv(source, ctx))


def link_stack(stack: list[MultiHeadAttention]) -> None:
    """Introduce the modules of one attention slot across a stack's layers to each other (:meth:`link`)."""
    for module in stack:
        module.link(stack)


def build_attention(options: AttentionConfig, d_model: int, heads: int, *, dropout: float,
                    self_attention: bool, name: str) -> MultiHeadAttention:
    """Instantiate the registered attention variant named by ``options.type``."""
    cls = ATTENTIONS.get(options.type).cls
    return cls(d_model, heads, dropout=dropout, self_attention=self_attention, name=name, options=options)
