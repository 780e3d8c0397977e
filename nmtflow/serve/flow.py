"""The information flow of one sentence as JSON, for ``nmtflow serve``'s explorer (``POST /api/flow``).

Computed by the code of ``nmtflow analyze``, not a copy of it: the attention weights, token labels and phrase
shares of :func:`nmtflow.analysis.attention_maps.sentence_maps` (what the heat maps draw), the shortcut gates it
records as :mod:`nmtflow.analysis.similarity` does, and the attention bridge's A of
:func:`nmtflow.analysis.bridge.sentence_attention`. Weights are ``{n: [head][query][key]}`` over the n-grams of
the keys (standard attention: n = 1 only), so each query's weights sum to 1 over all n (SPEC §3). Floats are
rounded to 4 decimals.
"""
from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from nmtflow.analysis.attention_maps import SLOT_TITLES, head_phrase_share, pair_ids, phrase_labels, sentence_maps
from nmtflow.analysis.bridge import sentence_attention
from nmtflow.analysis.similarity import gate_slot
from nmtflow.decode.ensemble import Ensemble
from nmtflow.decode.translate import Translator
from nmtflow.nn.attention import MultiHeadAttention
from nmtflow.nn.bridge import AttentionBridge
from nmtflow.nn.phrasal import PhrasalAttention
from nmtflow.nn.shortcuts import ShortcutAttention

DECIMALS = 4


def rounded(x: Tensor) -> Any:
    """A tensor as nested lists of floats rounded to :data:`DECIMALS` (a 0-d tensor: one float)."""
    return x.detach().double().cpu().round(decimals=DECIMALS).tolist()


def architecture(model: nn.Module) -> str:
    """The model's name in its config, a Transformer's attention variants (``phrasal``, ``shortcuts``, joined by
    ``+`` when both) instead of ``transformer``; ``ensemble`` for several checkpoints."""
    if isinstance(model, Ensemble):
        return "ensemble"
    name = str(getattr(model.config, "name", type(model).__name__))
    if name != "transformer":
        return name
    variants = [v for v, cls in (("phrasal", PhrasalAttention), ("shortcuts", ShortcutAttention))
                if any(isinstance(mod, cls) for mod in model.modules())]
    return "+".join(variants) or name


def flow_kinds(model: nn.Module) -> list[str]:
    """Which flows :func:`sentence_flow` shows for the model: ``attention``, ``gates``, ``bridge`` (an ensemble:
    none)."""
    if isinstance(model, Ensemble):
        return []
    return [k for k, cls in (("attention", MultiHeadAttention), ("gates", ShortcutAttention),
                             ("bridge", AttentionBridge)) if any(isinstance(mod, cls) for mod in model.modules())]


def sentence_flow(translator: Translator, sentence: str, target: str | None = None) -> dict[str, Any]:
    """The flow JSON of ``sentence`` (see ``docs/guide/serve.md``): for ``target``, or without it for the model's own
    beam translation (as ``nmtflow analyze attention`` draws). ValueErrors name the ``sentence``/``target`` field."""
    model = translator.model.eval()
    src_ids, tgt_ids = pair_ids(translator, sentence, target, src_option="sentence", tgt_option="target")
    kinds = flow_kinds(model)
    s = sentence_maps(model, src_ids, tgt_ids, translator.src_tokenizer, translator.tgt_tokenizer,
                      src_prefix=translator.src_prefix, record=not isinstance(model, Ensemble))
    attention = []
    for m in s.maps:
        keys = s.keys(m)
        parts = m.split()  # {n: (1,H,T,S_n)}
        share = head_phrase_share(m)
        attention.append({
            "slot": m.slot, "title": SLOT_TITLES.get(m.slot, m.slot), "layer": m.layer + 1,
            "heads": m.weights.size(1), "ngrams": list(m.ngrams), "queries": s.rows(m),
            "keys": {str(n): phrase_labels(keys, n) for n in m.ngrams},
            "weights": {str(n): rounded(w[0]) for n, w in parts.items()},
            "phrase_share": rounded(share),
            "layer_phrase_share": rounded(share.mean()),
        })
    gates = []
    shortcuts = {mod.name: mod for mod in model.modules() if isinstance(mod, ShortcutAttention)}
    for name, r in s.gates.items():
        slot, layer = gate_slot(name)
        for kv, values in r.items():  # (S,D) over the key positions
            gates.append({"slot": slot, "layer": layer, "kind": f"r_{kv}", "keys": s.gate_keys(shortcuts[name]),
                          "values": rounded(values.float().mean(-1)), "mean": rounded(values.float().mean())})
    bridge = None
    if "bridge" in kinds:
        tokens, a = sentence_attention(translator, sentence)  # (k, n)
        bridge = {"heads": a.size(0), "keys": tokens, "weights": rounded(a)}
    return {"architecture": architecture(model), "translation": translator.tgt_tokenizer.decode(tgt_ids) if target is None else target,
            "source_tokens": s.src, "target_tokens": s.tgt_out, "target_input_tokens": s.tgt_in,
            "attention": attention, "gates": gates, "bridge": bridge}
