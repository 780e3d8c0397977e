"""Lexical shortcuts (SPEC §2): exact parameter deltas, the equations, caching, causality, gates, presets."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from nmtflow.cli import main
from nmtflow.config import Config, ConfigError, load_config
from nmtflow.data.vocab import BOS, EOS, PAD
from nmtflow.decode.search import beam_search, sequence_logprobs
from nmtflow.models.base import Vocabularies, build_model, reorder
from nmtflow.nn.attention import AttentionContext, split_heads
from nmtflow.nn.shortcuts import ShortcutAttention, ShortcutOptions, StackedLinear

from tests.conftest import padded_batch

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
V = 50
SC = {"type": "shortcut"}
FF = {"type": "shortcut", "feature_fusion": True}
NL = {"type": "shortcut", "source": "nonlexical"}
SLOTS = ("encoder_self_attention", "decoder_self_attention", "cross_attention")
VARIANTS: dict[str, dict[str, dict]] = {
    "lexical": {"encoder_self_attention": SC, "decoder_self_attention": SC},
    "fusion": {"encoder_self_attention": FF, "decoder_self_attention": FF},
    "encoder-only": {"encoder_self_attention": SC},
    "decoder-only": {"decoder_self_attention": SC},
    "cross": {"cross_attention": SC},
    "self+cross": {"encoder_self_attention": SC, "decoder_self_attention": SC, "cross_attention": SC},
    "fusion+cross": {"encoder_self_attention": FF, "decoder_self_attention": FF, "cross_attention": FF},
    # three layers, so that layer 3 really takes H_1 rather than E
    "nonlexical": {"encoder_self_attention": NL, "decoder_self_attention": NL, "encoder_layers": 3,
                   "decoder_layers": 3},
}


def make(variant: str, pre_norm: bool = True, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = {"name": "transformer", "d_model": 32, "ffn_dim": 64, "heads": 4, "encoder_layers": 2,
             "decoder_layers": 2, "pre_norm": pre_norm, **VARIANTS[variant]}
    return build_model(load_config(data={"model": model}).model, Vocabularies(V, V)).eval()


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    return padded_batch(V, seed)


def shortcut_modules(model: torch.nn.Module) -> list[ShortcutAttention]:
    return [m for m in model.modules() if isinstance(m, ShortcutAttention)]


def info(capsys: pytest.CaptureFixture[str], config: str, *overrides: str) -> int:
    sets = [a for o in overrides for a in ("--set", o)]
    assert main(["info", str(CONFIGS / config), "--vocab-size", "32000", "--json", *sets]) == 0
    return json.loads(capsys.readouterr().out)["parameters"]


# ---- parameters ------------------------------------------------------------------------------------
@pytest.mark.parametrize("config, baseline, delta", [
    ("shortcuts-base.yaml", "transformer-base.yaml", 6_303_744),
    ("feature-fusion-base.yaml", "transformer-base.yaml", 18_886_656),
    ("feature-fusion-big.yaml", "transformer-big.yaml", 75_522_048),
])
def test_parameter_deltas_are_exact(config: str, baseline: str, delta: int,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert info(capsys, config) - info(capsys, baseline) == delta


TINY = ("model.d_model=32", "model.ffn_dim=64", "model.heads=4")


LEXICAL, FUSION = (lambda d: 2 * d * d + 2 * d), (lambda d: 6 * d * d + 2 * d)
PRESETS = {  # preset name (without size) → (shortcut sub-layers S, parameters per sub-layer)
    "shortcuts": (12, LEXICAL), "feature-fusion": (12, FUSION), "shortcuts-encoder-only": (6, LEXICAL),
    "shortcuts-decoder-only": (6, LEXICAL), "shortcuts-cross-only": (6, LEXICAL),
    "shortcuts-self-and-cross": (18, LEXICAL), "nonlexical-shortcuts": (12, LEXICAL)}
SIZES = ("small", "base", "big")


@pytest.mark.parametrize("variant", PRESETS)
@pytest.mark.parametrize("size", SIZES)
def test_every_preset_adds_s_times_the_per_sublayer_delta(variant: str, size: str,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    # every variant's preset at every size, at d=32 (only the parameter arithmetic is under test; 6+6 layers kept)
    sublayers, per_sublayer = PRESETS[variant]
    delta = info(capsys, f"{variant}-{size}.yaml", *TINY) - info(capsys, f"transformer-{size}.yaml", *TINY)
    assert delta == sublayers * per_sublayer(32)


def test_feature_fusion_replaces_the_standard_key_value_maps() -> None:
    attn = ShortcutAttention(32, 4, options=ShortcutOptions(feature_fusion=True))
    names = {n for n, _ in attn.named_parameters()}
    assert names == {"q_proj.weight", "out_proj.weight", "kv_fusion.weight", "kv_gate_bias"}


@pytest.mark.parametrize("fusion", [False, True])
def test_stacked_maps_are_initialised_block_by_block(fusion: bool) -> None:
    """[W_k ; W_v], [W_ksc ; W_vsc] and fusion's [W_k ; W_v] are stored stacked but drawn like separate maps:
    Xavier-uniform over each square block (bound gain·sqrt(6 / (2·cols))), not over the stacked matrix."""
    torch.manual_seed(0)
    attn = ShortcutAttention(64, 4, options=ShortcutOptions(feature_fusion=fusion))
    names = ["kv_fusion"] if fusion else ["kv_proj", "kv_shortcut"]
    for name in names:
        weight = getattr(attn, name).weight.detach()
        bound = math.sqrt(6 / (2 * weight.size(1))) / math.sqrt(2)
        for block in weight.split(weight.size(1)):
            assert 0.95 * bound < block.abs().max() <= bound, name
    assert not attn.kv_gate_bias.any()


@pytest.mark.parametrize("variant", ["lexical", "fusion+cross"])
def test_checkpoints_with_separate_key_value_maps_still_load(variant: str) -> None:
    """A state dict written when W_k/W_v, W_ksc/W_vsc, the fusion maps and b_k/b_v were separate parameters
    loads (strictly) into the stacked parameters and gives the same outputs."""
    model, fresh = make(variant, seed=0), make(variant, seed=1)
    old = {}
    for key, value in model.state_dict().items():
        module, _, name = key.rpartition(".kv_") if ".kv_" in key else (key, "", "")
        if not name:
            old[key] = value
            continue
        first, second = value.chunk(2)
        param = name.removesuffix(".weight")
        suffix = ".weight" if name.endswith(".weight") else ""
        old[f"{module}.k_{param}{suffix}"], old[f"{module}.v_{param}{suffix}"] = first.squeeze(0), second.squeeze(0)
    assert any(k.endswith("k_gate_bias") for k in old) and not any(".kv_" in k for k in old)
    fresh.load_state_dict(old)
    src, tgt = batch()
    torch.testing.assert_close(fresh(src, tgt), model(src, tgt), rtol=0, atol=0)


# ---- the equations ---------------------------------------------------------------------------------
def _gate(sc: torch.Tensor, h: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    r = torch.sigmoid(sc + h + b)
    return r * sc + (1 - r) * h


@pytest.mark.parametrize("fusion", [False, True])
def test_keys_and_values_follow_the_spec_equations(fusion: bool) -> None:
    torch.manual_seed(0)
    d, heads = 16, 2
    attn = ShortcutAttention(d, heads, options=ShortcutOptions(feature_fusion=fusion))
    with torch.no_grad():
        attn.kv_gate_bias.normal_()
    e, h = torch.randn(2, 5, d), torch.randn(2, 5, d)
    k, v = attn.project_kv(h, AttentionContext(embeddings=e))
    if fusion:  # [X_sc ; X] = W [E ; H], split in halves along features (Eq. 13-14)
        eh = torch.cat([e, h], -1)
        k_sc, k_h, v_sc, v_h = (eh @ attn.kv_fusion.weight.T).split(d, -1)  # W_k, W_v: 2d×2d each
    else:  # Eq. 5-8
        (w_ksc, w_vsc), (w_k, w_v) = attn.kv_shortcut.weight.split(d), attn.kv_proj.weight.split(d)
        k_sc, k_h = e @ w_ksc.T, h @ w_k.T
        v_sc, v_h = e @ w_vsc.T, h @ w_v.T
    b_k, b_v = attn.kv_gate_bias
    torch.testing.assert_close(k, split_heads(_gate(k_sc, k_h, b_k), heads))
    torch.testing.assert_close(v, split_heads(_gate(v_sc, v_h, b_v), heads))


@pytest.mark.parametrize("fusion", [False, True])
def test_fused_gate_gradients_equal_autograd_through_the_equations(fusion: bool) -> None:
    """The hand-written backward of the fused gate: every input and parameter gradient, in float64."""
    torch.manual_seed(0)
    d, heads = 8, 2
    attn = ShortcutAttention(d, heads, options=ShortcutOptions(feature_fusion=fusion)).double()
    with torch.no_grad():
        attn.kv_gate_bias.normal_()
    e, h = (torch.randn(3, 4, d, dtype=torch.float64, requires_grad=True) for _ in range(2))
    up_k, up_v = torch.randn(3, heads, 4, d // heads, dtype=torch.float64), torch.randn(3, heads, 4, d // heads,
                                                                                       dtype=torch.float64)

    def grads(k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
        leaves = [e, h, *attn.parameters()]
        used = [x for x in leaves if x.requires_grad]
        return list(torch.autograd.grad((k * up_k).sum() + (v * up_v).sum(), used, allow_unused=True))

    fused = grads(*attn.project_kv(h, AttentionContext(embeddings=e)))
    if fusion:
        eh = torch.cat([e, h], -1)
        k_sc, k_h, v_sc, v_h = (eh @ attn.kv_fusion.weight.T).split(d, -1)  # W_k, W_v: 2d×2d each
    else:
        (w_ksc, w_vsc), (w_k, w_v) = attn.kv_shortcut.weight.split(d), attn.kv_proj.weight.split(d)
        k_sc, k_h = e @ w_ksc.T, h @ w_k.T
        v_sc, v_h = e @ w_vsc.T, h @ w_v.T
    b_k, b_v = attn.kv_gate_bias
    reference = grads(split_heads(_gate(k_sc, k_h, b_k), heads), split_heads(_gate(v_sc, v_h, b_v), heads))
    names = ["E", "H", *(n for n, _ in attn.named_parameters())]
    for name, got, want in zip(names, fused, reference):
        if want is None:  # q_proj/out_proj: not on the key/value path
            assert got is None, name
        else:
            torch.testing.assert_close(got, want, msg=name)


def _reference_kernels() -> tuple:
    """The CUDA gate kernels' elementwise math in torch (with jiterator's broadcasting), to run their host-side
    code on the CPU."""
    def forward(sc: torch.Tensor, h: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return h + torch.sigmoid(sc + h + b) * (sc - h)

    def terms(gk: torch.Tensor, gv: torch.Tensor, key: torch.Tensor, sc: torch.Tensor, h: torch.Tensor,
              b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r = torch.sigmoid(sc + h + b)
        g = torch.where(key > 0.5, gk, gv)
        return g, r, g * (sc - h) * r * (1 - r)

    def pair_backward(*inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        g, r, q = terms(*inputs)
        return g * r + q, g * (1 - r) + q, q

    def fused_backward(*inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        g, r, q = terms(*inputs[:-1])
        is_shortcut = inputs[-1] > 0.5
        return torch.where(is_shortcut, g * r + q, g * (1 - r) + q), torch.where(is_shortcut, q, 0 * q)

    return forward, pair_backward, fused_backward


@pytest.mark.parametrize("fusion", [False, True])
def test_cuda_gate_path_gives_the_cpu_gradients(fusion: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA gate's host side (one kernel each way, K'/V' as views of one output, dK'/dV' picked by the
    ``key`` flag, fusion's dy assembled by the ``first`` flag, db = Σ p) with the kernels' math in torch: the
    same values and gradients as the CPU path."""
    from nmtflow.nn import shortcuts

    torch.manual_seed(0)
    y = torch.randn(30, 2, 2, 8, dtype=torch.float64)
    bias = torch.randn(2, 8, dtype=torch.float64)
    up = torch.randn(2, 30, 8, dtype=torch.float64)

    def run() -> list[torch.Tensor]:
        yy, b = y.clone().requires_grad_(), bias.clone().requires_grad_()
        k, v = shortcuts.FusedGate.apply(yy, b) if fusion else shortcuts.PairGate.apply(yy[:, :, 0], yy[:, :, 1], b)
        return [k, v, *torch.autograd.grad((k * up[0]).sum() + (v * up[1]).sum(), [yy, b])]

    expected = run()
    monkeypatch.setattr(shortcuts, "_use_cuda_kernels", lambda x: True)
    monkeypatch.setattr(shortcuts, "_cuda_gate_kernels", _reference_kernels)
    for name, got, want in zip(["K'", "V'", "dy", "db"], run(), expected, strict=True):
        torch.testing.assert_close(got, want, msg=name)


@pytest.mark.parametrize("variant", ["lexical", "self+cross"])
def test_stack_wide_shortcut_projection_equals_one_per_layer(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Linked lexical shortcuts project E for all layers of a slot in one GEMM: same outputs, same gradients."""
    model = make(variant).train()
    src, tgt = batch()
    calls = []
    real = StackedLinear.apply
    monkeypatch.setattr(StackedLinear, "apply", lambda *a: calls.append(a[2]) or real(*a))

    def outputs_and_grads() -> list[torch.Tensor]:
        torch.manual_seed(3)  # the same dropout masks
        out = model(src, tgt)
        params = [p for p in model.parameters() if p.requires_grad]
        return [out, *torch.autograd.grad((out * torch.linspace(-1, 1, out.size(-1))).sum(), params)]

    linked = outputs_and_grads()
    slots = 3 if variant == "self+cross" else 2
    assert calls == [2] * slots  # one stacked GEMM per slot, over both layers
    for m in shortcut_modules(model):
        m.stack = ()  # unlinked: one GEMM per layer
    calls.clear()
    for got, want in zip(outputs_and_grads(), linked, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not calls


def test_nonlexical_layer_n_takes_h_n_minus_2_and_layers_1_2_take_e() -> None:
    torch.manual_seed(0)
    attn = ShortcutAttention(16, 2, options=ShortcutOptions(source="nonlexical"))
    e, h1, h2, h3 = (torch.randn(2, 5, 16) for _ in range(4))
    inputs = [e, h1, h2, h3]  # inputs of layers 1..4 (H_0 = E)

    def kv(layer: int, embeddings: torch.Tensor) -> torch.Tensor:
        ctx = AttentionContext(embeddings=embeddings, layer_inputs=inputs[:layer + 1], layer=layer)
        return attn.project_kv(inputs[layer], ctx)[0]

    lexical = ShortcutAttention(16, 2)
    lexical.load_state_dict(attn.state_dict())

    def lex(layer: int, source: torch.Tensor) -> torch.Tensor:
        return lexical.project_kv(inputs[layer], AttentionContext(embeddings=source, layer=layer))[0]

    torch.testing.assert_close(kv(0, e), lex(0, e))  # layer 1: E
    torch.testing.assert_close(kv(1, e), lex(1, e))  # layer 2: H_0 = E
    torch.testing.assert_close(kv(2, e), lex(2, h1))  # layer 3: H_1
    torch.testing.assert_close(kv(3, e), lex(3, h2))  # layer 4: H_2
    assert torch.equal(kv(3, e), kv(3, torch.randn(2, 5, 16)))  # E unused from layer 3 on


# ---- decoding and causality -------------------------------------------------------------------------
@pytest.mark.parametrize("pre_norm", [True, False])
@pytest.mark.parametrize("variant", VARIANTS)
def test_incremental_decoding_equals_full_forward(variant: str, pre_norm: bool) -> None:
    model = make(variant, pre_norm)
    src, tgt = batch()
    with torch.no_grad():
        full = model(src, tgt)
        enc, state = model.encode(src), {}
        steps = [model.decode(tgt[:, t:t + 1], enc, state) for t in range(tgt.size(1))]
        torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
        enc, state = model.encode(src), {}
        chunks = [model.decode(tgt[:, :3], enc, state), model.decode(tgt[:, 3:], enc, state)]
        torch.testing.assert_close(torch.cat(chunks, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["self+cross", "fusion", "nonlexical"])
def test_caches_reorder_like_beam_search(variant: str) -> None:
    model = make(variant)
    src, tgt = batch()
    order = torch.tensor([2, 0, 0, 1])  # beams: rows duplicated and permuted
    with torch.no_grad():
        full = model(src[order], tgt[order])
        enc, state = model.encode(src), {}
        first = model.decode(tgt[:, :3], enc, state)
        enc, state = reorder(enc, order), reorder(state, order)
        rest = model.decode(tgt[order, 3:], enc, state)
    torch.testing.assert_close(torch.cat([first[order], rest], 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["fusion+cross", "nonlexical"])
def test_beam_search_scores_match_forced_decoding(variant: str) -> None:
    model = make(variant)
    src, _ = batch()
    hyps = beam_search(model, src, beam_size=3, len_penalty=0.0, max_len_a=0.0, max_len_b=5)
    for i, best in enumerate(h[0] for h in hyps):
        tokens = torch.tensor([[BOS, *best.tokens, EOS]])
        n = (src[i] != PAD).sum()
        logprob = sequence_logprobs(model, src[i:i + 1, :n], tokens[:, :-1], tokens[:, 1:])
        assert float(logprob) == pytest.approx(best.logprob, abs=1e-4)


@pytest.mark.parametrize("pre_norm", [True, False])
@pytest.mark.parametrize("variant", ["lexical", "fusion", "decoder-only", "self+cross", "nonlexical"])
def test_no_future_leakage_through_decoder_shortcuts(variant: str, pre_norm: bool) -> None:
    model = make(variant, pre_norm)
    src, tgt = batch()
    with torch.no_grad():
        ref = model(src, tgt)
        for t in range(1, tgt.size(1)):
            perturbed = tgt.clone()
            perturbed[:, t:] = torch.randint(4, V, perturbed[:, t:].shape)
            out = model(src, perturbed)
            torch.testing.assert_close(out[:, :t], ref[:, :t], atol=1e-5, rtol=1e-5)
            assert not torch.allclose(out[:, t:], ref[:, t:])


def test_source_padding_stays_invisible_to_cross_shortcuts() -> None:
    model = make("self+cross")
    src, tgt = batch()
    with torch.no_grad():
        torch.testing.assert_close(model(src[2:3, :4], tgt[2:3]), model(src[2:3], tgt[2:3]), atol=1e-5, rtol=1e-5)


# ---- gates ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["lexical", "fusion", "self+cross", "nonlexical"])
def test_every_parameter_and_gate_gets_a_gradient(variant: str) -> None:
    model = make(variant).train()
    src, tgt = batch()
    model(src, tgt).logsumexp(-1).mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []
    gated = [n for n, _ in model.named_parameters() if "gate_bias" in n or "shortcut" in n or "fusion" in n]
    assert gated


@pytest.mark.parametrize("variant", ["lexical", "fusion", "self+cross"])
def test_gates_are_recorded_and_lie_in_the_open_unit_interval(variant: str) -> None:
    model = make(variant)
    src, tgt = batch()
    modules = shortcut_modules(model)
    with torch.no_grad():
        model(src, tgt)
        assert all(m.gates == {} for m in modules)  # nothing recorded unless asked
        for m in modules:
            m.record_gates = True
        model(src, tgt)
    for m in modules:
        keys_len = src.size(1) if "encoder" in m.name or "cross" in m.name else tgt.size(1)
        for kv in ("k", "v"):
            r = m.gates[kv]
            assert r.shape == (src.size(0), keys_len, 32)
            assert r.min() > 0 and r.max() < 1
            torch.testing.assert_close(m.gate_stats[f"{kv}_mean"], r.mean())
            torch.testing.assert_close(m.gate_stats[f"{kv}_std"], r.std())


def test_need_weights_records_gates_too() -> None:
    model = make("encoder-only")
    src, _ = batch()
    with torch.no_grad():
        model.encoder(src, need_weights=True)
    assert all(set(m.gates) == {"k", "v"} for m in shortcut_modules(model))


# ---- configuration ---------------------------------------------------------------------------------------
def test_bad_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="source"):
        load_config(data={"model": {"decoder_self_attention": {"type": "shortcut", "source": "phrasal"}}})
    with pytest.raises(ConfigError, match="unknown key 'fusion'"):
        load_config(data={"model": {"decoder_self_attention": {"type": "shortcut", "fusion": True}}})
    with pytest.raises(ConfigError, match=r"model.cross_attention.source: non-lexical"):  # at load, not at build
        load_config(data={"model": {"d_model": 32, "ffn_dim": 64, "heads": 4, "cross_attention": NL}})


@pytest.mark.parametrize("size, warmups", [("small", (4000, 6000, 8000)), ("base", (4000, 6000, 8000)),
                                           ("big", (4000, 6000, 8000))])
def test_presets_select_the_variant_and_warmup(size: str, warmups: tuple[int, int, int]) -> None:
    base, sc, ff = (load_config(CONFIGS / f"{n}-{size}.yaml") for n in ("transformer", "shortcuts", "feature-fusion"))
    assert (base.train.warmup_updates, sc.train.warmup_updates, ff.train.warmup_updates) == warmups
    for cfg, fusion in ((sc, False), (ff, True)):
        assert cfg.model.d_model == base.model.d_model
        for slot in ("encoder_self_attention", "decoder_self_attention"):
            options = getattr(cfg.model, slot)
            assert isinstance(options, ShortcutOptions) and options.feature_fusion is fusion
        assert cfg.model.cross_attention.type == "standard"


@pytest.mark.parametrize("size", SIZES)
def test_ablation_presets_put_shortcuts_where_they_say(size: str) -> None:
    def load(variant: str) -> Config:
        return load_config(CONFIGS / f"{variant}-{size}.yaml")

    def slots(variant: str) -> tuple[str, ...]:
        return tuple(getattr(load(variant).model, slot).type for slot in SLOTS)

    std, sc = "standard", "shortcut"
    assert slots("shortcuts-encoder-only") == (sc, std, std)
    assert slots("shortcuts-decoder-only") == (std, sc, std)
    assert slots("shortcuts-cross-only") == (std, std, sc)
    assert slots("shortcuts-self-and-cross") == (sc, sc, sc)
    nonlexical = load("nonlexical-shortcuts").model
    assert slots("nonlexical-shortcuts") == (sc, sc, std)
    assert nonlexical.encoder_self_attention.source == nonlexical.decoder_self_attention.source == "nonlexical"
    baseline, shortcuts = load_config(CONFIGS / f"transformer-{size}.yaml"), load("shortcuts")
    for variant in PRESETS:  # each ablation is its size's Transformer, warmed up like its shortcuts preset
        cfg = load(variant)
        assert cfg.model.d_model == baseline.model.d_model and cfg.train.lr == baseline.train.lr
        if variant != "feature-fusion":
            assert cfg.train.warmup_updates == shortcuts.train.warmup_updates
