"""Decoding and scoring at their edges: all-padding sources, n-best lists and impossible search settings, models
with NaN scores, `evaluate` and `score` on empty, mismatched or contradictory inputs, a diverged model's perplexity."""
from __future__ import annotations

import io
import math
import sys
from pathlib import Path

import pytest
import torch

from nmtflow.cli import main
from nmtflow.config import DecodeConfig, load_config
from nmtflow.data.vocab import PAD
from nmtflow.decode.search import beam_search, greedy_search
from nmtflow.decode.translate import Translator
from nmtflow.models.base import Vocabularies, build_model

from tests.conftest import padded_batch
from tests.decode.test_cli_decoding import ckpt, run  # noqa: F401 (a fixture)

V = 24
TINY_CONV = {"embed_dim": 16, "hidden": 16, "growth": 8, "encoder_layers": 2, "decoder_layers": 2}


def make(model: dict, vocab: int = V) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(load_config(data={"model": model}).model, Vocabularies(vocab, vocab)).eval()


@pytest.mark.parametrize("model", [
    {"name": "convs2s", **TINY_CONV},
    {"name": "densenmt", **TINY_CONV, "attention": "dense1"},
    {"name": "densenmt", **TINY_CONV, "attention": "dense2"},
    {"name": "rnn", "hidden_dim": 16},
    {"name": "rnn", "hidden_dim": 16, "input_feeding": False},
], ids=["convs2s", "densenmt-1", "densenmt-2", "rnn", "rnn-no-feeding"])
def test_an_all_padding_source_row_gives_finite_scores(model: dict) -> None:
    """Before: the masked softmax over a source row of nothing but padding (-inf everywhere) gave NaN."""
    net = make(model)
    src, tgt = padded_batch(V)
    src[0] = PAD
    with torch.no_grad():
        out = net(src, tgt)
        alone = net(src[1:], tgt[1:])
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[1:], alone, rtol=0, atol=1e-6)  # the other rows: as without the empty one
    assert all(h[0].logprob > float("-inf") for h in beam_search(net, src, beam_size=2, max_len_b=3))
    assert all(h.logprob > float("-inf") for h in greedy_search(net, src, max_len_b=3))


def translator(decode: DecodeConfig, vocab: int = V) -> Translator:
    model = make({"name": "transformer", "d_model": 16, "ffn_dim": 32, "heads": 2, "encoder_layers": 1,
                  "decoder_layers": 1}, vocab)
    return Translator(model, None, None, decode)  # type: ignore[arg-type] (ids in and out: no tokenizers)


@pytest.mark.parametrize("decode, option", [
    (DecodeConfig(greedy=True, nbest=3), "--greedy"),
    (DecodeConfig(beam_size=2, nbest=3), "--beam 2"),
    (DecodeConfig(beam_size=0), "--beam 0"),
    (DecodeConfig(nbest=0), "--nbest 0"),
    (DecodeConfig(max_tokens=0), "--batch-tokens 0"),
], ids=["greedy", "nbest-above-beam", "beam-0", "nbest-0", "batch-tokens-0"])
def test_search_settings_that_cannot_give_the_nbest_list_are_errors(decode: DecodeConfig, option: str) -> None:
    """Before: greedy search with nbest 3 silently gave one hypothesis per input, batches of 0 tokens were taken
    as batches of one sentence; the others failed in beam_search with the setting's field name only."""
    with pytest.raises(ValueError, match=option):
        translator(decode).translate_ids([[5, 6, 7]])


def test_nbest_lists_hold_nbest_hypotheses_wherever_that_many_exist() -> None:
    """The documented contract of --nbest: exactly NBEST distinct hypotheses, fewer only where fewer outputs fit the
    length limit; an empty input gets one, the empty output."""
    vocab = 6  # PAD, UNK, BOS, EOS, 4, 5: outputs of up to L pieces from {UNK, 4, 5}: 1 + 3 + … + 3^L of them
    for limit, nbest in [(1, 6), (2, 6), (1, 3)]:
        t = translator(DecodeConfig(beam_size=6, nbest=nbest, max_len_a=0.0, max_len_b=limit), vocab)
        exist = sum(3 ** n for n in range(limit + 1))
        for hyps in t.translate_ids([[4, 5, 4], [5]]):
            assert len({tuple(h.tokens) for h in hyps}) == len(hyps) == min(nbest, exist)
        assert [len(h) for h in t.translate_ids([[], [4]])][0] == 1


def test_translate_checks_its_search_settings_before_reading_stdin(ckpt: str, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Before: --nbest above --beam failed only once a line had been read (an interactive session after the first
    sentence typed), and not at all on an empty input."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    code, out, err = run(["translate", ckpt, "--nbest", "3"], capsys)  # the checkpoint's beam: 2
    assert code == 2 and out == "" and "--nbest 3" in err and "--beam 2" in err


def test_evaluate_empty_files_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: an IndexError traceback from sacreBLEU."""
    (tmp_path / "hyp").write_text("")
    (tmp_path / "ref").write_text("")
    code, _, err = run(["evaluate", "--hyp", str(tmp_path / "hyp"), "--ref", str(tmp_path / "ref")], capsys)
    assert code == 2 and f"{tmp_path / 'ref'} is empty" in err


def test_evaluate_checks_line_counts_before_translating(ckpt: str, tmp_path: Path,  # noqa: F811
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """Before: every source was translated, and only then the line counts compared."""
    def no_translation(*args: object, **kwargs: object) -> None:
        raise AssertionError("translated before the line counts were checked")

    monkeypatch.setattr(Translator, "translate", no_translation)
    (tmp_path / "src").write_text("alpha bravo\ncharlie\n")
    (tmp_path / "ref").write_text("alpha bravo\n")
    code, _, err = run(["evaluate", ckpt, "--src", str(tmp_path / "src"), "--ref", str(tmp_path / "ref")], capsys)
    assert code == 2 and "has 2 lines but" in err


def test_evaluate_hyp_with_a_checkpoint_is_an_error(ckpt: str, tmp_path: Path,  # noqa: F811
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Before: CHECKPOINT and --src (or -o) were silently ignored beside --hyp, scoring an old file."""
    for name in ("src", "hyp", "ref"):
        (tmp_path / name).write_text("alpha bravo\n")
    files = ["--hyp", str(tmp_path / "hyp"), "--ref", str(tmp_path / "ref")]
    for extra in ([ckpt, "--src", str(tmp_path / "src")], ["-o", str(tmp_path / "out")]):
        code, out, err = run(["evaluate", *extra, *files], capsys)
        assert code == 2 and out == "" and "--hyp" in err


def test_perplexity_batch_tokens_zero_is_an_error(ckpt: str, copy_data: Path,  # noqa: F811
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Before: --batch-tokens 0 silently fell back to the config's batch size (and a negative one failed without
    naming the option)."""
    for tokens in ("0", "-3"):
        code, out, err = run(["evaluate", "--perplexity", ckpt, "--data", str(copy_data), "--batch-tokens", tokens],
                             capsys)
        assert code == 2 and out == "" and f"--batch-tokens {tokens}" in err


def test_score_candidates_with_src_and_tgt_is_an_error(ckpt: str, tmp_path: Path,  # noqa: F811
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Before: --src/--tgt beside --candidates were silently ignored."""
    (tmp_path / "cand.tsv").write_text("alpha bravo\talpha bravo\tbravo alpha\n")
    (tmp_path / "src").write_text("alpha\n")
    code, out, err = run(["score", ckpt, "--candidates", str(tmp_path / "cand.tsv"), "--src", str(tmp_path / "src"),
                          "--tgt", str(tmp_path / "src")], capsys)
    assert code == 2 and out == "" and "--candidates" in err
    assert run(["score", ckpt, "--candidates", str(tmp_path / "cand.tsv"), "--json"], capsys)[0] == 0


def test_the_perplexity_of_a_diverged_model_is_inf() -> None:
    """Before: OverflowError (a traceback from `evaluate --perplexity`) once the mean NLL passed ~709 nats."""
    from nmtflow.evaluate.metrics import perplexity

    assert perplexity(1e6, 10) == float("inf") and perplexity(0.0, 0) == 1.0


def test_json_outputs_are_strict_json() -> None:
    """Before: `evaluate --perplexity --json` of a diverged model printed Infinity, `score --json` NaN."""
    import json

    from nmtflow.evaluate.metrics import json_safe

    def no_constants(name: str) -> None:
        raise ValueError(f"{name} is not JSON")

    text = json.dumps(json_safe({"ppl": float("inf"), "scores": [float("nan"), -1.5], "n": (1, 2)}))
    assert json.loads(text, parse_constant=no_constants) == {"ppl": None, "scores": [None, -1.5], "n": [1, 2]}


class WordIds:
    """A stand-in tokenizer: each word is id 5, ids decode to their numbers."""

    def encode_batch(self, lines: list[str]) -> list[list[int]]:
        return [[5] * len(line.split()) for line in lines]

    def decode(self, ids: list[int]) -> str:
        return " ".join(map(str, ids))


@pytest.mark.parametrize("decode", [DecodeConfig(beam_size=3), DecodeConfig(greedy=True)], ids=["beam", "greedy"])
def test_a_model_with_nan_scores_is_an_error_naming_the_line(decode: DecodeConfig) -> None:
    """Before: beam search returned no hypothesis (`translate` died on an IndexError), greedy search a NaN score."""
    t = translator(decode)
    t.src_tokenizer = t.tgt_tokenizer = WordIds()  # type: ignore[assignment]
    with torch.no_grad():
        for p in t.model.parameters():
            p.fill_(float("nan"))
    hyps = t.translate_ids([[], [5, 6]])  # at least one hypothesis per input, whatever the model
    assert [len(h) for h in hyps] == [1, 1] and hyps[0][0].score == 0.0 and math.isnan(hyps[1][0].score)
    with pytest.raises(ValueError, match=r"^in.txt:8: input line 8: the model's scores are NaN"):
        t.translate(["", "alpha bravo"], first_line=7, name="in.txt")


def test_a_dash_is_stdin_and_stdout(ckpt: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Before: `-i -` was a missing file named '-', and `-o -` silently wrote a file named '-'."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"alpha\n\nbravo\n")))
    code, out, _ = run(["translate", ckpt, "-i", "-", "-o", "-", "--max-len-b", "1"], capsys)
    assert code == 0 and len(out.splitlines()) == 3 and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command, message", [
    (["score", "CKPT", "--src", "SRC", "--tgt", "REF", "--beam", "3"], "--beam: score computes log P"),
    (["score", "CKPT", "--src", "SRC", "--tgt", "REF", "--greedy"], "--greedy: score computes log P"),
    (["evaluate", "--perplexity", "CKPT", "--data", "DATA", "--ref", "REF"], "--ref: does not apply to --perplexity"),
    (["evaluate", "--perplexity", "CKPT", "--data", "DATA", "--lenpen", "1"], "--lenpen: does not apply to"),
    (["evaluate", "--hyp", "REF", "--ref", "REF", "--beam", "3"], "--beam: --hyp scores a file of translations"),
    (["evaluate", "--hyp", "REF", "--ref", "REF", "--data", "DATA"], "--data: is for --perplexity"),
    (["evaluate", "CKPT", "--src", "SRC", "--ref", "REF", "--nbest", "3", "--beam", "3"],
     "--nbest 3: evaluate scores one translation per sentence"),
])
def test_options_a_command_would_ignore_are_errors(command: list[str], message: str, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Before: each ran with exit 0 and the option silently ignored (checked before any model is loaded)."""
    (tmp_path / "src").write_text("a b\n")
    (tmp_path / "ref").write_text("c d\n")
    paths = {"CKPT": str(tmp_path / "missing.pt"), "SRC": str(tmp_path / "src"), "REF": str(tmp_path / "ref"),
             "DATA": str(tmp_path)}
    assert main([paths.get(a, a) for a in command]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
