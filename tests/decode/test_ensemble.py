"""Ensembles: the mean of the members' probabilities, decoded incrementally; from the CLI, several checkpoints."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from sentencepiece import sentencepiece_model_pb2

from nmtflow.checkpoint import load_checkpoint, save_atomic
from nmtflow.cli import main
from nmtflow.config import load_config, to_dict
from nmtflow.data.vocab import BOS, EOS, PAD
from nmtflow.decode.ensemble import Ensemble
from nmtflow.decode.search import beam_search, greedy_search, sequence_logprobs
from nmtflow.models.base import Vocabularies, build_model
from nmtflow.train.trainer import Trainer

from tests.conftest import copy_sentences, padded_batch, tiny_config

V = 40
MEMBERS = {
    "transformer": {"name": "transformer", "d_model": 32, "ffn_dim": 64, "heads": 4, "encoder_layers": 2,
                    "decoder_layers": 2},
    "feature-fusion": {"name": "transformer", "d_model": 32, "ffn_dim": 64, "heads": 4, "encoder_layers": 1,
                       "decoder_layers": 2, "encoder_self_attention": {"type": "shortcut", "feature_fusion": True},
                       "decoder_self_attention": {"type": "shortcut", "feature_fusion": True}},
    "phrasal": {"name": "transformer", "d_model": 32, "ffn_dim": 64, "heads": 4, "encoder_layers": 1,
                "decoder_layers": 1, "decoder_self_attention": {"type": "phrasal", "ngrams": [1, 2]}},
    "convs2s": {"name": "convs2s", "embed_dim": 16, "hidden": 16, "layer_groups": [[2, 16, 3]]},
    "rnn": {"name": "rnn", "hidden_dim": 16},
}


def member(name: str, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_model(load_config(data={"model": MEMBERS[name]}).model, Vocabularies(V, V)).eval()


@pytest.fixture(scope="module")
def mixed() -> Ensemble:
    """One ensemble of every kind of decoder state: self-attention caches, shortcut gates, phrasal spans,
    convolution windows and LSTM states."""
    return Ensemble([member(name, seed) for seed, name in enumerate(MEMBERS)]).eval()


@torch.no_grad()
def test_ensemble_probabilities_are_the_mean_of_its_members(mixed: Ensemble) -> None:
    src, tgt = padded_batch(V)
    mean = torch.stack([m(src, tgt).float().softmax(-1) for m in mixed.members]).mean(0)
    torch.testing.assert_close(mixed(src, tgt).exp(), mean, atol=1e-6, rtol=1e-5)


@torch.no_grad()
def test_incremental_decoding_equals_the_full_forward(mixed: Ensemble) -> None:
    src, tgt = padded_batch(V)
    enc, state = mixed.encode(src), {}
    steps = [mixed.decode(tgt[:, t:t + 1], enc, state) for t in range(tgt.size(1))]
    torch.testing.assert_close(torch.cat(steps, 1), mixed(src, tgt), atol=1e-5, rtol=1e-5)
    for i, hyps in enumerate(beam_search(mixed, src, beam_size=3, nbest=3, max_len_b=6)):
        row = src[i:i + 1, :int(src[i].ne(PAD).sum())]
        for h in hyps:  # beam reordering and sentence pruning keep every member's caches aligned
            full = sequence_logprobs(mixed, row, torch.tensor([[BOS, *h.tokens]]), torch.tensor([[*h.tokens, EOS]]))
            assert abs(float(full) - h.logprob) < 1e-4


@torch.no_grad()
def test_a_model_ensembled_with_itself_decodes_as_that_model() -> None:
    model = member("feature-fusion", 0)
    twice = Ensemble([model, model]).eval()
    src, _ = padded_batch(V)
    alone, ensembled = (beam_search(m, src, beam_size=4, nbest=2, max_len_b=6) for m in (model, twice))
    assert [[h.tokens for h in hyps] for hyps in alone] == [[h.tokens for h in hyps] for hyps in ensembled]
    assert [h.tokens for h in greedy_search(model, src)] == [h.tokens for h in greedy_search(twice, src)]


def test_an_ensemble_needs_two_models() -> None:
    with pytest.raises(ValueError, match="at least two models"):
        Ensemble([member("rnn", 0)])


# ---- the CLI ---------------------------------------------------------------------------------------------------
def train(copy_data: Path, save_dir: Path, seed: int, *, schedule: dict[str, object] | None = None,
          **model: object) -> str:
    """A tiny Transformer of 2 updates (``schedule``: other ``train`` settings) with ``model`` settings."""
    raw = to_dict(tiny_config(copy_data, save_dir, valid_bleu=False, validate_every=0, save_every=0, threads=1,
                              seed=seed, **{"max_updates": 2, **(schedule or {})}))
    raw["model"].update(d_model=32, ffn_dim=64, **model)
    threads = torch.get_num_threads()
    try:
        Trainer(load_config(data=raw)).train()
    finally:
        torch.set_num_threads(threads)
    return str(save_dir / "checkpoint_last.pt")


@pytest.fixture(scope="module")
def checkpoints(copy_data: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("ensemble")
    fused = {"type": "shortcut", "feature_fusion": True}
    return (train(copy_data, root / "transformer", 1),
            train(copy_data, root / "fusion", 2, encoder_self_attention=fused, decoder_self_attention=fused))


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main([*args, "--device", "cpu"])
    out, err = capsys.readouterr()
    return code, out, err


def test_translate_score_and_perplexity_of_an_ensemble(checkpoints: tuple[str, str], copy_data: Path,
                                                       tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    a, b = checkpoints
    src = tmp_path / "in.txt"
    lines = copy_sentences(5, 9)
    src.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    outputs = {}
    for models in ([a], [a, a], [a, b]):
        code, out, err = run(["translate", *models, "-i", str(src), "--beam", "3", "--max-len-b", "4"], capsys)
        assert code == 0, err
        outputs[len(models), models[-1]] = out.splitlines()
    assert outputs[1, a] == outputs[2, a] and len(outputs[2, b]) == len(lines)
    code, out, err = run(["score", a, b, "--src", str(src), "--tgt", str(src), "--json"], capsys)
    assert code == 0 and len(json.loads(out)) == len(lines), err
    ppl = {}
    for models in ([a], [a, a], [a, b]):
        code, out, err = run(["evaluate", "--perplexity", *models, "--data", str(copy_data), "--json"], capsys)
        assert code == 0, err
        ppl[len(models), models[-1]] = json.loads(out)["ppl"]
    assert ppl[1, a] == pytest.approx(ppl[2, a], rel=1e-5) and ppl[2, b] != ppl[1, a]


def test_members_must_share_their_vocabularies(checkpoints: tuple[str, str], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    a, b = checkpoints
    ckpt = load_checkpoint(b)
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(ckpt["tokenizers"]["tgt"].numpy().tobytes())
    proto.pieces[10].score += 1.0  # another segmentation: another vocabulary
    ckpt["tokenizers"]["tgt"] = torch.frombuffer(bytearray(proto.SerializeToString()), dtype=torch.uint8).clone()
    other = tmp_path / "other.pt"
    save_atomic(ckpt, other)
    code, _, err = run(["translate", a, str(other), "-i", "/dev/null"], capsys)
    assert code == 2 and f"{other}: its target vocabulary is not that of {a}" in err
    assert len(err.strip().splitlines()) == 1
