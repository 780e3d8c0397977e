"""`nmtflow export --to ctranslate2`: tiny Transformers trained on the fixtures (pre- and post-norm, tied and untied,
joint and separate vocabularies) translate alike in nmtflow and CTranslate2; other architectures are refused."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from nmtflow.checkpoint import load_checkpoint, save_atomic
from nmtflow.cli import main
from nmtflow.config import DecodeConfig, load_config
from nmtflow.data.batching import collate
from nmtflow.decode.export import export_ctranslate2, unsupported
from nmtflow.decode.search import sequence_logprobs
from nmtflow.decode.translate import Translator
from nmtflow.registry import MODELS

from tests.conftest import tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
try:
    import ctranslate2  # noqa: F401

    HAVE_CT2 = True
except ImportError:
    HAVE_CT2 = False
needs_ct2 = pytest.mark.skipif(not HAVE_CT2, reason="ctranslate2 is not importable (pip install -e '.[export]')")
SENTENCES = 40
MAX_LEN = 30  # nmtflow max_len_a=0, max_len_b=30 ≡ CTranslate2 max_decoding_length=30 (see _compare)
VARIANTS = {  # name → (joint vocabulary, model fields)
    "joint-prenorm-tied": (True, {"pre_norm": True, "tie_embeddings": True}),
    "separate-postnorm-untied": (False, {"pre_norm": False, "tie_embeddings": False}),
    "separate-prenorm-tied-gelu": (False, {"pre_norm": True, "tie_embeddings": True, "activation": "gelu"}),
}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, Path]:
    """The fixtures' 200 en–de pairs prepared with a joint and with separate SentencePiece models."""
    from nmtflow.data.prepare import prepare

    root = tmp_path_factory.mktemp("export-data")
    raw = {"train": str(FIXTURES / "tiny"), "valid": str(FIXTURES / "tiny")}
    dirs = {True: root / "joint", False: root / "separate"}
    for joint, out in dirs.items():
        prepare(raw, ["en", "de"], out, vocab_size=150, joint=joint, progress=False, byte_fallback=False)
    return dirs


@pytest.fixture(scope="module")
def checkpoints(prepared: dict[bool, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny Transformer per variant, trained for 30 updates on the fixtures."""
    from nmtflow.train.trainer import Trainer

    root = tmp_path_factory.mktemp("export-models")
    found = {}
    for name, (joint, fields) in VARIANTS.items():
        cfg = tiny_config(prepared[joint], root / name, max_updates=30, validate_every=0, save_every=0,
                          valid_bleu=False, threads=1)
        cfg.data.src_lang, cfg.data.tgt_lang = "en", "de"
        cfg.model.max_positions = 64
        for key, value in fields.items():
            setattr(cfg.model, key, value)
        Trainer(cfg).train()
        found[name] = root / name / "checkpoint_last.pt"
    return found


def _compare(translator: Translator, out: Path, beam: int) -> tuple[list[list[int]], list[list[int]], list]:
    """nmtflow's and CTranslate2's outputs (target ids) for the first SENTENCES fixture sentences, with the same
    search: beam ``beam`` (1: greedy), no length penalty (GNMT's and CTranslate2's differ but for α = 0), at most
    MAX_LEN tokens (a final EOS is not counted by nmtflow and not returned by CTranslate2)."""
    import ctranslate2

    lines = (FIXTURES / "tiny.en").read_text(encoding="utf-8").splitlines()[:SENTENCES]
    translator.decode = DecodeConfig(beam_size=beam, len_penalty=0.0, max_len_a=0.0, max_len_b=MAX_LEN)
    ids = translator.encode_source(lines)
    ours = [h[0].tokens for h in translator.translate_ids(ids)]
    src_pieces = [[translator.src_tokenizer.piece(i) for i in s] for s in ids]
    ct2 = ctranslate2.Translator(str(out), device="cpu", intra_threads=1)
    options = json.loads((out / "nmtflow.json").read_text(encoding="utf-8"))["translate_batch"]
    assert options == {"suppress_sequences": [["<s>"], ["<pad>"]], "min_decoding_length": 0}  # (CTranslate2's
    # default minimum 1 forbids an empty output)
    results = ct2.translate_batch(src_pieces, beam_size=beam, length_penalty=0.0, max_decoding_length=MAX_LEN,
                                  **options)
    tgt_ids = {translator.tgt_tokenizer.piece(i): i for i in range(translator.tgt_tokenizer.vocab_size)}
    theirs = [[tgt_ids[p] for p in r.hypotheses[0]] for r in results]
    return ours, theirs, ids


def _logprobs(translator: Translator, src: list[int], tgt: list[int]) -> tuple[float, float]:
    """nmtflow's log P(tgt | src) with the final EOS and without it."""
    b = collate([src], [tgt])
    with torch.no_grad():
        lprobs = torch.log_softmax(translator.model(b.src, b.tgt_in).float(), -1)
    tokens = lprobs.gather(-1, b.tgt_out[..., None])[0, :, 0]
    return float(tokens.sum()), float(tokens[:-1].sum())


@needs_ct2
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_ctranslate2_translates_as_nmtflow(variant: str, checkpoints: dict[str, Path], tmp_path: Path) -> None:
    import ctranslate2

    out = export_ctranslate2(checkpoints[variant], tmp_path / "ct2")
    joint = VARIANTS[variant][0]
    assert (out / "shared_vocabulary.json").is_file() == joint
    assert (out / "source_vocabulary.json").is_file() == (not joint)
    translator = Translator.from_checkpoint(checkpoints[variant])
    assert (out / "source.spm").read_bytes() == translator.src_tokenizer.model_proto
    assert (out / "target.spm").read_bytes() == translator.tgt_tokenizer.model_proto

    # the same model: per-token log-probabilities of the references (teacher forcing), EOS included
    lines = (FIXTURES / "tiny.en").read_text(encoding="utf-8").splitlines()[:8]
    refs = (FIXTURES / "tiny.de").read_text(encoding="utf-8").splitlines()[:8]
    src = [translator.src_tokenizer.encode(s) for s in lines]
    tgt = [translator.tgt_tokenizer.encode(t) for t in refs]
    scored = ctranslate2.Translator(str(out), device="cpu", intra_threads=1).score_batch(
        [[translator.src_tokenizer.piece(i) for i in s] for s in src],
        [[translator.tgt_tokenizer.piece(i) for i in t] for t in tgt])
    b = collate(src, tgt)
    with torch.no_grad():
        lprobs = torch.log_softmax(translator.model(b.src, b.tgt_in).float(), -1)
    ours = lprobs.gather(-1, b.tgt_out[..., None])[..., 0]
    for row, result in enumerate(scored):
        assert len(result.log_probs) == len(tgt[row]) + 1
        torch.testing.assert_close(torch.tensor(result.log_probs), ours[row, :len(tgt[row]) + 1],
                                   atol=2e-4, rtol=1e-4)

    # greedy: identical token sequences
    ours_greedy, theirs_greedy, _ = _compare(translator, out, beam=1)
    assert ours_greedy == theirs_greedy

    # beam 4: both searches rank finished hypotheses by log P (α = 0) and keep the best, so outputs are identical,
    # with two exceptions. (1) At the length limit nmtflow ends every live hypothesis with a forced EOS and ranks
    # them with its log-probability, while CTranslate2 returns them cut, ranked without it: the two may pick
    # different MAX_LEN-token outputs, each the best by its own ranking. (2) Near-ties (within ~1e-4 nats:
    # float32 sums in different orders; nmtflow stops a sentence once 4 hypotheses have ended, CTranslate2 once
    # its best candidate ends, which picks the same best but for such ties).
    ours_beam, theirs_beam, ids = _compare(translator, out, beam=4)
    differ = [n for n, (a, c) in enumerate(zip(ours_beam, theirs_beam)) if a != c]
    at_limit = [n for n in differ if len(ours_beam[n]) == len(theirs_beam[n]) == MAX_LEN]
    # (1) depends on how many outputs reach the limit (most, for a model this little trained): each is checked
    # below; near-ties (2) must stay rare
    assert len(differ) - len(at_limit) <= SENTENCES // 4, f"{len(differ)} of {SENTENCES} beam outputs differ"
    for n in differ:
        (ours_eos, ours_cut), (theirs_eos, theirs_cut) = (_logprobs(translator, ids[n], seq)
                                                          for seq in (ours_beam[n], theirs_beam[n]))
        if n in at_limit:  # (1)
            assert ours_eos >= theirs_eos - 1e-3 and theirs_cut >= ours_cut - 1e-3
        else:  # (2)
            assert abs(ours_eos - theirs_eos) < 1e-3, (n, ours_beam[n], theirs_beam[n])


@needs_ct2
def test_int8_export_and_cli(checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import ctranslate2

    ckpt = checkpoints["joint-prenorm-tied"]
    code = main(["export", str(ckpt), "--to", "ctranslate2", "-o", str(tmp_path / "f32")])
    assert code == 0 and "ctranslate2.Translator" in capsys.readouterr().out
    assert main(["export", str(ckpt), "--to", "ctranslate2", "-o", str(tmp_path / "i8"), "--quantization",
                 "int8"]) == 0
    assert (tmp_path / "i8" / "model.bin").stat().st_size < (tmp_path / "f32" / "model.bin").stat().st_size / 2
    info = json.loads((tmp_path / "i8" / "nmtflow.json").read_text())
    assert (info["quantization"], info["src_lang"], info["tgt_lang"]) == ("int8", "en", "de")
    result = ctranslate2.Translator(str(tmp_path / "i8"), device="cpu").translate_batch([["▁The", "</s>"]],
                                                                                       max_decoding_length=5)
    assert len(result[0].hypotheses[0]) <= 5

    # an existing directory needs --force
    assert main(["export", str(ckpt), "--to", "ctranslate2", "-o", str(tmp_path / "f32")]) == 2
    assert "already exists; add --force" in capsys.readouterr().err
    assert main(["export", str(ckpt), "--to", "ctranslate2", "-o", str(tmp_path / "f32"), "--force"]) == 0


@needs_ct2
def test_a_model_that_ranks_bos_first_translates_alike_with_the_recorded_options(checkpoints: dict[str, Path],
                                                                                   tmp_path: Path) -> None:
    """nmtflow's search never emits BOS or PAD; CTranslate2 does where the model ranks them first (an undertrained
    one can) unless given nmtflow.json's translate_batch options."""
    import ctranslate2

    from nmtflow.data.vocab import BOS, PAD

    ckpt = load_checkpoint(checkpoints["separate-postnorm-untied"])
    model = ckpt["model"]  # post-norm, untied: the last layer norm's output feeds the output rows alone
    model["decoder.layers.1.ffn_res.norm.bias"][0] += 20.0  # every decoder state gets a large component 0 ...
    for special, scale in ((BOS, 5.0), (PAD, 4.9)):  # ... which BOS's and PAD's rows score: ranked first
        model["decoder.output_weight"][special] = 0.0
        model["decoder.output_weight"][special, 0] = scale
    path = tmp_path / "bos-first.pt"
    save_atomic(ckpt, path)
    out = export_ctranslate2(path, tmp_path / "ct2")
    translator = Translator.from_checkpoint(path)
    ours, theirs, ids = _compare(translator, out, beam=1)
    assert ours == theirs
    src_pieces = [[translator.src_tokenizer.piece(i) for i in s] for s in ids]
    plain = ctranslate2.Translator(str(out), device="cpu", intra_threads=1).translate_batch(
        src_pieces, beam_size=1, max_decoding_length=MAX_LEN, min_decoding_length=0)
    assert all(r.hypotheses[0] and set(r.hypotheses[0]) <= {"<s>"} for r in plain)  # without them: BOS only
    assert all(ours)  # nmtflow: other tokens


def test_force_replaces_only_an_earlier_export(checkpoints: dict[str, Path], tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """--force deleted a run directory holding the checkpoint, and ``-o .`` emptied the working directory."""
    run = tmp_path / "run"
    run.mkdir()
    ckpt = run / "checkpoint_last.pt"
    ckpt.write_bytes(checkpoints["joint-prenorm-tied"].read_bytes())
    (run / "notes.txt").write_text("mine\n", encoding="utf-8")
    before = sorted(p.name for p in run.iterdir())
    for target, message in ((run, f"-o {run}: holds the checkpoint {ckpt}; --force would delete it"),
                            (tmp_path, f"-o {tmp_path}: holds the checkpoint {ckpt}")):
        assert main(["export", str(ckpt), "--to", "ctranslate2", "-o", str(target), "--force"]) == 2
        assert message in capsys.readouterr().err
    monkeypatch.chdir(run)
    assert main(["export", "checkpoint_last.pt", "--to", "ctranslate2", "-o", ".", "--force"]) == 2
    assert "-o .: holds the checkpoint checkpoint_last.pt" in capsys.readouterr().err
    other = tmp_path / "other"
    (other / "inside").mkdir(parents=True)
    (other / "data.txt").write_text("keep\n", encoding="utf-8")
    monkeypatch.chdir(other / "inside")
    for target, message in ((other / "inside", "is the working directory or one above it"),
                            (other, "is the working directory or one above it")):
        assert main(["export", str(ckpt), "--to", "ctranslate2", "-o", str(target), "--force"]) == 2
        assert message in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    assert main(["export", str(ckpt), "--to", "ctranslate2", "-o", str(other), "--force"]) == 2
    assert f"-o {other}: not an earlier export (it has no nmtflow.json)" in capsys.readouterr().err
    assert sorted(p.name for p in run.iterdir()) == before and (other / "data.txt").is_file()
    # an earlier export is replaced, from anywhere, with -o naming it relatively too
    assert main(["export", str(ckpt), "--to", "ctranslate2", "-o", "deploy"]) == 0
    assert main(["export", str(ckpt), "--to", "ctranslate2", "-o", "deploy", "--force"]) == 0
    assert (tmp_path / "deploy" / "model.bin").is_file() and not list(tmp_path.glob(".deploy.new-*"))


def test_cli_errors(checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str],
                    monkeypatch: pytest.MonkeyPatch) -> None:
    ckpt = str(checkpoints["joint-prenorm-tied"])
    assert main(["export", ckpt, "--to", "onnx", "-o", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "nmtflow export: error: --to onnx: unknown export target; expected one of: ctranslate2"
    assert main(["export", ckpt, "--to", "ctranslate2", "-o", str(tmp_path / "x"), "--quantization", "int3"]) == 2
    assert "--quantization int3: expected one of float32, int8" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "ctranslate2", None)  # as if not installed: importing it fails
    assert main(["export", ckpt, "--to", "ctranslate2", "-o", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "ctranslate2 package, which is not installed" in err
    assert "pip install 'ctranslate2>=4.4'" in err and "pip install -e '.[export]'" in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("model, expected", [
    ({"name": "transformer", "encoder_self_attention": {"type": "shortcut"}},
     "shortcuts (Emelin et al. 2019) (model.encoder_self_attention.type: shortcut)"),
    ({"name": "transformer", "cross_attention": {"type": "phrasal"}},
     "phrasal attention (model.cross_attention.type: phrasal)"),
    ({"name": "convs2s"}, "ConvS2S"),
    ({"name": "densenmt"}, "DenseNMT"),
    ({"name": "rnn"}, "an RNN"),
    ({"name": "bridge"}, "the attention bridge"),
])
def test_unsupported_architectures(model: dict, expected: str) -> None:
    reason = unsupported(load_config(data={"model": model}).model)
    assert reason is not None and expected in reason
    assert unsupported(load_config(data={"model": {"name": "transformer", "pre_norm": False}}).model) is None


def test_every_other_registered_model_is_refused() -> None:
    for name in MODELS.names():
        if name != "transformer":
            assert unsupported(MODELS.get(name).config_cls()) is not None, name


def test_refusal_on_the_command_line(checkpoints: dict[str, Path], tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint whose Transformer has lexical shortcuts: one line naming the file and why, nothing written."""
    ckpt = load_checkpoint(checkpoints["joint-prenorm-tied"])
    ckpt["config"]["model"]["decoder_self_attention"] = {"type": "shortcut"}
    path = tmp_path / "shortcuts.pt"
    save_atomic(ckpt, path)
    assert main(["export", str(path), "--to", "ctranslate2", "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"nmtflow export: error: {path}: cannot export to CTranslate2: a Transformer with shortcuts")
    assert "CTranslate2 has standard multi-head attention only" in err
    assert not (tmp_path / "out").exists()
