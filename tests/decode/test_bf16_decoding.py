"""``decode.precision: bf16``: a bf16 copy of the weights with the output layer in float32, for every kind of decoder
state and an ensemble; the copy's cache; the setting through the config, ``nmtflow translate`` and ``nmtflow.load``."""
from __future__ import annotations

import copy
import logging
import pickle
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import nmtflow
from nmtflow import runtime
from nmtflow.nn import attention
from nmtflow.config import ConfigError, DecodeConfig, load_config
from nmtflow.data.vocab import BOS, EOS
from nmtflow.decode.ensemble import Ensemble
from nmtflow.decode.precision import cast_copy, model_in_precision
from nmtflow.decode.search import beam_search, sequence_logprobs

from tests.conftest import padded_batch
from tests.decode.test_cli_decoding import ckpt, run  # noqa: F401 (a fixture)
from tests.decode.test_decode_review import translator
from tests.decode.test_ensemble import MEMBERS, V, member
from nmtflow.models.base import Vocabularies, build_model
from tests.models.test_multilingual import MODELS as MULTILINGUAL, MODEL_IDS as MULTILINGUAL_IDS, batch, make

pytestmark = pytest.mark.usefixtures("one_thread")

# architectures that use a matrix module's weight directly (lexical shortcuts' stacked projection, DenseNMT's
# per-layer keys), beside the ensemble members
MORE = {"shortcuts": {"name": "transformer", "d_model": 32, "ffn_dim": 64, "heads": 4, "encoder_layers": 2,
                      "decoder_layers": 2, "encoder_self_attention": {"type": "shortcut"},
                      "decoder_self_attention": {"type": "shortcut"}, "cross_attention": {"type": "shortcut"}},
        "densenmt": {"name": "densenmt", "embed_dim": 16, "hidden": 16, "layer_groups": [[2, 16, 3]]}}


def tiny(name: str, seed: int) -> torch.nn.Module:
    if name in MEMBERS:
        return member(name, seed)
    torch.manual_seed(seed)
    return build_model(load_config(data={"model": MORE[name]}).model, Vocabularies(V, V)).eval()


@pytest.mark.parametrize("name", ["transformer", "feature-fusion", "phrasal", "convs2s", "rnn", "ensemble",
                                  "shortcuts", "densenmt"])
def test_bf16_search_finds_what_fp32_scores_as_well(name: str) -> None:
    """The bf16 copy's beam search runs for every architecture; each of its outputs scores, under the fp32 model,
    what the copy says (within bf16's rounding) and as well as fp32's own best (within 2%)."""
    model = Ensemble([member("transformer", 1), member("rnn", 2)]).eval() if name == "ensemble" else tiny(name, 3)
    src, _ = padded_batch(V)
    fp32 = beam_search(model, src, beam_size=3, max_len_b=6)
    bf16 = beam_search(model_in_precision(model, "bf16"), src, beam_size=3, max_len_b=6)
    for i, (mine, reference) in enumerate(zip(bf16, fp32)):
        tokens = mine[0].tokens
        rescored = float(sequence_logprobs(model, src[i:i + 1], torch.tensor([[BOS] + tokens]),
                                           torch.tensor([tokens + [EOS]])))
        assert mine[0].logprob == pytest.approx(rescored, rel=0.02, abs=0.05)
        assert mine[0].score >= reference[0].score * 1.02 - 0.05  # scores are negative


PRODUCTS = {"mm", "bmm", "addmm", "baddbmm", "matmul", "linear", "convolution", "conv1d"}


class FloatProducts(TorchDispatchMode):
    """Records the matrix products (and attention kernels) that read a float32 tensor, but the output layer's
    (a (V, d) or (d, V) operand)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        name = func.overloadpacket.__name__
        if name in PRODUCTS or "scaled_dot_product" in name:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if any(t.dtype == torch.float32 for t in tensors) and not any(V in t.shape for t in tensors):
                self.seen.append(f"{name}{[tuple(t.shape) for t in tensors]}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("single_query", [False, True], ids=["fused-attention", "single-query-attention"])
@pytest.mark.parametrize("name", ["transformer", "feature-fusion", "phrasal", "convs2s", "rnn", "shortcuts", "densenmt"])
def test_every_product_of_the_copy_but_the_output_layer_is_bf16(name: str, single_query: bool,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """No attention or projection of the copy falls back to float32 (e.g. a bf16 matrix output multiplied with the
    float32 stream cast up, not down); with single-query attention (:func:`nmtflow.nn.attention.sdpa` on CPUs
    without AMX) only its scores, one query (B,H,1,Dh) times the keys, are float32 products, as intended."""
    monkeypatch.setattr(attention, "SINGLE_QUERY_PRODUCTS", single_query)
    calls: list[int] = []
    single = attention.single_query_attention
    monkeypatch.setattr(attention, "single_query_attention", lambda *a: calls.append(1) or single(*a))
    model = tiny(name, 3)
    src, _ = padded_batch(V)
    cast = model_in_precision(model, "bf16")
    with FloatProducts() as products:
        beam_search(cast, src, beam_size=2, max_len_b=3)
    scores = re.compile(r"^(matmul|bmm)\[\((\d+, )+1, \d+\), ")  # the first operand one query per row
    assert all(scores.match(p) for p in products.seen)
    assert len(products.seen) == len(calls)  # one float32 product per call: its scores, not its weights times V
    assert bool(calls) == (single_query and name not in ("convs2s", "densenmt", "rnn"))  # no SDPA there


@pytest.mark.parametrize("model", MULTILINGUAL, ids=MULTILINGUAL_IDS)
def test_bf16_copy_of_every_multilingual_variant(model: dict) -> None:
    """The bridge over a Transformer encoder (its attention meets a float32 LayerNorm output), the language-label
    model, every stack: the copy's logits are float32 and within bf16's rounding of fp32's, and it searches."""
    net = make(model).pair("de", "de")
    src, tgt = batch()
    cast = model_in_precision(net, "bf16")
    with torch.no_grad():
        logits, reference = cast(src, tgt), net(src, tgt)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.log_softmax(-1), reference.log_softmax(-1), atol=0.1, rtol=0.05)
    assert len(beam_search(cast, src, beam_size=2, max_len_b=3)) == src.size(0)


def test_the_copy_pickles_and_deep_copies_as_itself() -> None:
    """The copy's hooks and its ``encode`` travel with it: a pickled or deep-copied copy computes what it does, and
    a deep copy's own weights are the ones it uses."""
    model = member("transformer", 3)
    src, tgt = padded_batch(V)
    cast = model_in_precision(model, "bf16")
    with torch.no_grad():
        expected = cast(src, tgt)
        for other in (pickle.loads(pickle.dumps(cast)), copy.deepcopy(cast)):
            torch.testing.assert_close(other(src, tgt), expected, atol=0, rtol=0)
            assert other.encode(src)["out"].dtype == torch.bfloat16
        twin = copy.deepcopy(cast)
        for p in twin.encoder.parameters():
            if p.dtype == torch.bfloat16:
                p.zero_()
        assert not torch.equal(twin(src, tgt), expected)


def test_the_copy_multiplies_in_bf16_and_keeps_the_rest_and_the_model_float32() -> None:
    model = member("transformer", 3)
    tied = model.decoder.output_weight is model.decoder.embedder.embedding.weight
    cast = cast_copy(model, torch.bfloat16)
    assert cast.encoder.layers[0].ffn.fc1.weight.dtype == torch.bfloat16
    assert cast.decoder.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    norm, reference_norm = cast.encoder.layers[0].attn_res.norm, model.encoder.layers[0].attn_res.norm
    for mine, theirs in [(cast.decoder.output_weight, model.decoder.output_weight), (norm.weight, reference_norm.weight),
                         (cast.decoder.embedder.embedding.weight, model.decoder.embedder.embedding.weight)]:
        assert mine.dtype == torch.float32 and mine.data_ptr() == theirs.data_ptr()  # shared, not copied
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert tied == (model.decoder.output_weight is model.decoder.embedder.embedding.weight)
    seen: dict[str, torch.dtype] = {}  # what the layers pass on: a float32 residual stream, bf16 sub-layer outputs
    cast.encoder.layers[0].register_forward_hook(lambda m, args, out: seen.update(layer=out[0].dtype))
    cast.encoder.layers[0].ffn.register_forward_hook(lambda m, args, out: seen.update(ffn=out.dtype))
    src, tgt = padded_batch(V)
    with torch.no_grad():
        logits, reference = cast(src, tgt), model(src, tgt)
    assert seen == {"layer": torch.float32, "ffn": torch.bfloat16}
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.log_softmax(-1), reference.log_softmax(-1), atol=0.1, rtol=0.05)


def test_the_copy_is_made_once_and_again_after_the_weights_change() -> None:
    model = member("transformer", 3)
    first = model_in_precision(model, "bf16")
    assert model_in_precision(model, "bf16") is first and model_in_precision(model, "fp32") is model
    with torch.no_grad():
        model.encoder.layers[0].ffn.fc1.weight.add_(1.0)
    second = model_in_precision(model, "bf16")
    assert second is not first
    torch.testing.assert_close(second.encoder.layers[0].ffn.fc1.weight.float(),
                               model.encoder.layers[0].ffn.fc1.weight, atol=0.05, rtol=0.01)


def test_bf16_on_a_cpu_without_native_bf16_warns(monkeypatch: pytest.MonkeyPatch,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    for native in (False, True):
        monkeypatch.setattr(runtime, "cpu_info", lambda: {"cpu_model": "Old CPU", "cpu_flags": [],
                                                          "native_bf16": native})
        with caplog.at_level(logging.WARNING, logger="nmtflow"):
            model_in_precision(member("transformer", 3), "bf16")
        assert ("decode.precision: bf16 on a CPU without native bf16 (Old CPU has neither AMX nor AVX-512 BF16)"
                in caplog.text) == (not native)
        caplog.clear()


def test_the_translator_searches_and_scores_in_its_precision() -> None:
    fp32, bf16 = translator(DecodeConfig(beam_size=3)), translator(DecodeConfig(beam_size=3, precision="bf16"))
    bf16.model = fp32.model
    sources = [[5, 6, 7, 8], [9, 10]]
    assert len(bf16.translate_ids(sources)) == 2
    assert model_in_precision(fp32.model, "bf16") is not fp32.model  # made by the search above, kept
    assert all(p.dtype == torch.float32 for p in fp32.model.parameters())


def test_precision_is_checked_at_load() -> None:
    with pytest.raises(ConfigError, match=r"decode.precision: unknown precision 'fp16' \(known: fp32, bf16\)"):
        load_config(data={"model": {"name": "transformer"}, "decode": {"precision": "fp16"}})


def test_translate_and_load_take_the_precision(ckpt: str, capsys: pytest.CaptureFixture[str],  # noqa: F811
                                               tmp_path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("a b c\nd e\n", encoding="utf-8")
    code, out, _ = run(["translate", ckpt, "-i", str(source), "--precision", "bf16"], capsys)
    assert code == 0 and len(out.splitlines()) == 2
    with pytest.raises(SystemExit):
        run(["translate", ckpt, "-i", str(source), "--precision", "fp16"], capsys)
    assert "invalid choice: 'fp16'" in capsys.readouterr().err
    model = nmtflow.load(ckpt, device="cpu", precision="bf16")
    assert model.decode.precision == "bf16"
    assert model.translate(["a b c", "d e"]) == out.splitlines()
    assert model.translate("a b c", precision="fp32") == nmtflow.load(ckpt, device="cpu").translate("a b c")
