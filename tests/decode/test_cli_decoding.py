"""`translate`, `score` and `evaluate` on the command line: closed pipes, kept outputs, inputs longer than the
model, warnings and errors that name the true file and line, JSON scores, multilingual perplexity."""
from __future__ import annotations

import io
import json
import math
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nmtflow.cli import main
from nmtflow.config import DecodeConfig, load_config
from nmtflow.data.prepare import load_meta
from nmtflow.data.tokenizer import Tokenizer
from nmtflow.decode.search import beam_search, greedy_search, length_penalty
from nmtflow.decode.translate import Translator
from nmtflow.models.base import Vocabularies, build_model

from tests.conftest import WORDS, tiny_config
from tests.models.test_transformer import batch, make

LONG = "alpha bravo " * 40  # 80 words: more pieces than a max_positions=64 model reads


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main([*args, "--device", "cpu"])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def ckpt(copy_data: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 1-update tiny Transformer (``src`` → ``tgt``) with ``max_positions=64``."""
    from nmtflow.train.trainer import Trainer

    save = tmp_path_factory.mktemp("maxpos64")
    config = tiny_config(copy_data, save, max_updates=1, valid_bleu=False, validate_every=0, save_every=0, threads=1)
    config.model.d_model, config.model.ffn_dim, config.model.max_positions = 32, 64, 64
    config.decode.beam_size = 2
    threads = torch.get_num_threads()
    try:
        Trainer(config).train()
    finally:
        torch.set_num_threads(threads)
    return str(save / "checkpoint_last.pt")


class ClosedPipe:
    """A stdout whose reader has gone away (``nmtflow translate ... | head -1``)."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


# ---- bug 1: a closed stdout ------------------------------------------------------------------------------------
def test_a_closed_stdout_is_a_quiet_success(ckpt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "in.txt"
    src.write_text("alpha bravo\ncharlie\n", encoding="utf-8")
    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["translate", ckpt, "-i", str(src), "--device", "cpu", "--max-len-b", "2"]) == 0
    assert main(["score", ckpt, "--src", str(src), "--tgt", str(src), "--device", "cpu"]) == 0
    assert capsys.readouterr().err == ""


def test_a_pipe_closed_before_the_output_is_flushed(ckpt: str, tmp_path: Path) -> None:
    """A real pipe, its reader gone before the (block-buffered) output is written: exit 0, nothing on stderr."""
    src = tmp_path / "in.txt"
    src.write_text("alpha bravo\ncharlie\n", encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    proc = subprocess.Popen([sys.executable, "-m", "nmtflow", "translate", ckpt, "-i", str(src), "--device", "cpu",
                             "--max-len-b", "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Broken pipe" not in err and "Exception ignored" not in err


# ---- bug 2: a failed run keeps the output file ----------------------------------------------------------------
def test_a_failed_translate_keeps_the_existing_output(ckpt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    keep = tmp_path / "keep.hyp"
    keep.write_text("yesterday's output\n", encoding="utf-8")
    keep.chmod(0o640)
    code, _, err = run(["translate", ckpt, "-i", str(tmp_path / "missing.txt"), "-o", str(keep)], capsys)
    assert code == 2 and "missing.txt: file not found" in err
    assert keep.read_text(encoding="utf-8") == "yesterday's output\n"
    # stdin: the error comes after the first lines were translated and written (to the temporary file)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"alpha\nbravo\n" * 600 + b"ok\n\xff\xfe\n")))
    code, _, err = run(["translate", ckpt, "-o", str(keep), "--max-len-b", "1", "--greedy"], capsys)
    assert code == 2 and "<stdin>:1202" in err
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"alpha\rbravo\r")))  # classic-Mac line ends
    code, _, err = run(["translate", ckpt, "-o", str(keep), "--greedy"], capsys)
    assert code == 2 and "<stdin>: lines ended by CR alone (classic Mac; 2 carriage returns" in err
    assert keep.read_text(encoding="utf-8") == "yesterday's output\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.hyp"]  # no temporary file left behind
    # success replaces the file (its permissions kept), from a file and from stdin
    src = tmp_path / "in.txt"
    src.write_text("alpha\n\nbravo\n", encoding="utf-8")
    assert run(["translate", ckpt, "-i", str(src), "-o", str(keep), "--max-len-b", "1"], capsys)[0] == 0
    assert len(keep.read_text(encoding="utf-8").split("\n")) == 4 and keep.stat().st_mode & 0o777 == 0o640
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"alpha\nbravo\n")))
    assert run(["translate", ckpt, "-o", str(keep), "--max-len-b", "1"], capsys)[0] == 0
    assert len(keep.read_text(encoding="utf-8").split("\n")) == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "keep.hyp"]


class InterruptedStdin:
    """stdin on which the user types ``lines`` and then presses Ctrl-C."""

    def __init__(self, lines: list[bytes]) -> None:
        self.buffer = self._lines(lines)

    @staticmethod
    def _lines(lines: list[bytes]):
        yield from lines
        raise KeyboardInterrupt

    def isatty(self) -> bool:
        return False


def test_ctrl_c_on_stdin_keeps_the_translations_so_far(ckpt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C ends a translation from stdin: -o gets the lines translated before it, the exit code is 130."""
    out = tmp_path / "session.hyp"
    out.write_text("yesterday's output\n", encoding="utf-8")
    monkeypatch.setattr(sys, "stdin", InterruptedStdin([b"alpha\n", b"bravo\n"]))
    code, _, err = run(["translate", ckpt, "-o", str(out), "--unbuffered", "--max-len-b", "1", "--greedy"], capsys)
    assert code == 130 and f"interrupted: 2 translation(s) written to {out}" in err
    assert len(out.read_text(encoding="utf-8").splitlines()) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["session.hyp"]
    # from a file, an interrupted translation leaves the previous -o as it was
    src = tmp_path / "in.txt"
    src.write_text("alpha\nbravo\n", encoding="utf-8")

    def interrupted(*args: object, **kwargs: object):
        yield [("first", 0.0)]
        raise KeyboardInterrupt

    monkeypatch.setattr(Translator, "translate_stream", interrupted)
    before = out.read_text(encoding="utf-8")
    code, _, err = run(["translate", ckpt, "-i", str(src), "-o", str(out)], capsys)
    assert code == 130 and out.read_text(encoding="utf-8") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "session.hyp"]


def test_the_progress_hook_counts_every_sentence(ckpt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Translator.progress hears of each batch (empty lines at once); the CLI's bar shows on a terminal only."""
    translator = Translator.from_checkpoint(ckpt)
    translator.decode.max_tokens, translator.decode.max_len_b = 20, 1
    done: list[int] = []
    translator.progress = done.append
    translator.translate(["alpha bravo", "", "charlie", "alpha " * 5, ""])
    assert sum(done) == 5 and done[0] == 2 and len(done) > 2  # the two empty lines, then batch by batch
    src = tmp_path / "in.txt"
    src.write_text("alpha\nbravo charlie\n", encoding="utf-8")

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    assert main(["translate", ckpt, "-i", str(src), "-o", str(tmp_path / "out.txt"), "--max-len-b", "1",
                 "--device", "cpu"]) == 0
    assert "translate:" in sys.stderr.getvalue() and "/2 [" in sys.stderr.getvalue()  # a bar over the 2 lines
    monkeypatch.setattr(sys, "stdout", Terminal())  # translations to the terminal: no bar between them
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert main(["translate", ckpt, "-i", str(src), "--max-len-b", "1", "--device", "cpu"]) == 0
    assert "translate:" not in sys.stderr.getvalue() and len(sys.stdout.getvalue().splitlines()) == 2


# ---- bug 4: inputs longer than the model's positions ---------------------------------------------------------
def test_translate_truncates_inputs_to_the_model_positions(ckpt: str, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str],
                                                           caplog: pytest.LogCaptureFixture) -> None:
    src = tmp_path / "long.txt"
    src.write_text(f"{LONG}\ncharlie delta\n", encoding="utf-8")
    out = tmp_path / "long.hyp"
    with caplog.at_level(logging.WARNING):
        assert run(["translate", ckpt, "-i", str(src), "-o", str(out), "--max-len-b", "3"], capsys)[0] == 0
    assert len(out.read_text(encoding="utf-8").splitlines()) == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(f"{src}:1: input line 1 has" in w and "truncated to 63" in w and "max_positions=64" in w
               for w in warnings), warnings
    code, out_text, err = run(["evaluate", ckpt, "--src", str(src), "--ref", str(src), "--max-len-b", "3",
                               "--json"], capsys)
    assert code == 0 and "BLEU" in json.loads(out_text), err


def test_score_names_the_line_that_does_not_fit_the_model(ckpt: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    long, short = tmp_path / "long.txt", tmp_path / "short.txt"
    long.write_text(f"alpha\n{LONG}\n", encoding="utf-8")
    short.write_text("alpha\nbravo\n", encoding="utf-8")
    code, _, err = run(["score", ckpt, "--src", str(long), "--tgt", str(short)], capsys)
    assert code == 2 and f"{long}:2: source line 2 has" in err and "max_positions=64" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    code, _, err = run(["score", ckpt, "--src", str(short), "--tgt", str(long)], capsys)
    assert code == 2 and f"{long}:2: target line 2 has" in err and "never truncated" in err


def test_a_source_tag_counts_against_the_positions(copy_data: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A language-label tag before the source takes a position: sources are cut one piece shorter."""
    tok = Tokenizer(copy_data / load_meta(copy_data)["tokenizers"]["src"])
    cfg = load_config(data={"model": {"name": "transformer", "d_model": 32, "ffn_dim": 64, "heads": 4,
                                      "encoder_layers": 1, "decoder_layers": 1, "max_positions": 16}})
    torch.manual_seed(0)
    model = build_model(cfg.model, Vocabularies(tok.vocab_size, tok.vocab_size, joint=True)).eval()
    decode = DecodeConfig(beam_size=2, max_len_b=2)
    for prefix, limit in ((None, 15), (5, 14)):
        translator = Translator(model, tok, tok, decode, src_prefix=prefix)
        assert translator.max_source_tokens == limit
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert len(translator.translate([LONG, "alpha"], first_line=7, name="in.txt")) == 2
        assert [r.getMessage() for r in caplog.records] == [
            f"in.txt:7: input line 7 has {len(tok.encode_batch([LONG])[0])} tokens; truncated to {limit} "
            "(the model's max_positions=16)"]


def test_score_takes_targets_as_long_as_training_does(copy_data: Path) -> None:
    """A target of max_positions − 1 pieces (EOS makes max_positions) is scored; one piece more is refused."""
    tok = Tokenizer(copy_data / load_meta(copy_data)["tokenizers"]["src"])
    cfg = load_config(data={"model": {"name": "transformer", "d_model": 32, "ffn_dim": 64, "heads": 4,
                                      "encoder_layers": 1, "decoder_layers": 1, "max_positions": 16}})
    torch.manual_seed(0)
    model = build_model(cfg.model, Vocabularies(tok.vocab_size, tok.vocab_size, joint=True)).eval()
    translator = Translator(model, tok, tok, DecodeConfig())
    texts = [" ".join([word] * n) for word in WORDS for n in range(1, 20)]  # some word is one piece
    by_length = {len(ids): text for text, ids in zip(texts, tok.encode_batch(texts))}
    assert len(translator.score(["b"], [by_length[15]])) == 1
    with pytest.raises(ValueError, match="target line 1 has 16 tokens; the model scores at most 15"):
        translator.score(["b"], [by_length[16]])
    # an LSTM decoder has no positions to fill: its max_positions bounds nothing, so nothing is refused
    torch.manual_seed(0)
    rnn = load_config(data={"model": {"name": "rnn", "hidden_dim": 16, "encoder_layers": 1,
                                      "decoder_layers": 1, "max_positions": 16}}).model
    lstm = Translator(build_model(rnn, Vocabularies(tok.vocab_size, tok.vocab_size, joint=True)).eval(), tok, tok,
                      DecodeConfig())
    assert all(math.isfinite(lp) for lp in lstm.score(["b", "b"], [by_length[16], by_length[19]]))


# ---- bug 5: warnings name the true line ------------------------------------------------------------------------
def test_truncation_warnings_name_the_line_of_the_whole_input(ckpt: str, tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str],
                                                              caplog: pytest.LogCaptureFixture,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    translator = Translator.from_checkpoint(ckpt)
    translator.decode.max_input_tokens, translator.decode.greedy, translator.decode.max_len_b = 20, True, 1
    for chunk, lines in ((1000, ["a"] * 1001 + [LONG]), (1, ["a", "", LONG])):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            assert len(list(translator.translate_stream(lines, chunk=chunk))) == len(lines)
        assert [r.getMessage().split(" has ")[0] for r in caplog.records] == [f"input line {len(lines)}"]
    caplog.clear()
    src = tmp_path / "warn.txt"
    src.write_text("alpha\n" * 1001 + LONG + "\n", encoding="utf-8")  # the long line is line 1002
    with caplog.at_level(logging.WARNING):
        assert run(["translate", ckpt, "-i", str(src), "-o", str(tmp_path / "warn.out"), "--greedy",
                    "--max-len-b", "1"], capsys)[0] == 0
    assert [r.getMessage().split(" has ")[0] for r in caplog.records if r.levelno == logging.WARNING] == [
        f"{src}:1002: input line 1002"]
    caplog.clear()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(f"alpha\nbravo\n{LONG}\n".encode())))
    with caplog.at_level(logging.WARNING):
        code, out, _ = run(["translate", ckpt, "--unbuffered", "--greedy", "--max-len-b", "1"], capsys)
    assert code == 0 and len(out.splitlines()) == 3
    assert [r.getMessage().split(" has ")[0] for r in caplog.records if r.levelno == logging.WARNING] == [
        "input line 3"]


# ---- bug 6: contrastive candidates name FILE:LINE and the field ------------------------------------------------
def test_contrastive_errors_name_the_file_line_and_field(ckpt: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    cands = tmp_path / "c.tsv"
    cands.write_text(f"alpha\talpha\tbravo\tcharlie\ndelta\tdelta\techo\nalpha\talpha\t{'bravo ' * 100}\n",
                     encoding="utf-8")  # line 3, field 3: too long to score
    code, _, err = run(["score", ckpt, "--candidates", str(cands)], capsys)
    assert code == 2 and f"{cands}:3: field 3 (an incorrect translation) has" in err and "never truncated" in err
    cands.write_text(f"alpha\talpha\tbravo\n{LONG}\talpha\tbravo\n", encoding="utf-8")
    code, _, err = run(["score", ckpt, "--candidates", str(cands)], capsys)
    assert code == 2 and f"{cands}:2: field 1 (the source) has" in err
    for line, field in (("alpha bravo\talpha bravo\t\n", 3), ("alpha\t \tbravo\n", 2), ("\talpha\tbravo\n", 1)):
        cands.write_text("alpha\talpha\tbravo\n" + line, encoding="utf-8")
        code, _, err = run(["score", ckpt, "--candidates", str(cands), "--json"], capsys)
        assert code == 2 and f"{cands}:2: malformed line: field {field}" in err and "empty" in err
    cands.write_text("alpha\talpha\tbravo\tcharlie\ndelta\tdelta\techo\n", encoding="utf-8")
    code, out, _ = run(["score", ckpt, "--candidates", str(cands), "--json"], capsys)
    assert code == 0 and json.loads(out)["total"] == 2


# ---- bug 7: score --json ---------------------------------------------------------------------------------------
def test_score_json_lists_the_log_probabilities(ckpt: str, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    pairs = tmp_path / "pairs.txt"
    pairs.write_text("alpha bravo\n\ncharlie\n", encoding="utf-8")
    code, out, _ = run(["score", ckpt, "--src", str(pairs), "--tgt", str(pairs)], capsys)
    plain = [float(x) for x in out.split()]
    code_json, out_json, _ = run(["score", ckpt, "--src", str(pairs), "--tgt", str(pairs), "--json"], capsys)
    scores = json.loads(out_json)
    assert code == code_json == 0 and isinstance(scores, list) and len(scores) == 3
    assert [round(s, 4) for s in scores] == plain


# ---- greedy n-best scores are length-normalised like beam search's ------------------------------------------
def test_greedy_scores_are_length_normalised_like_beam_scores() -> None:
    model = make(seed=5)
    src, _ = batch()
    greedy = greedy_search(model, src, max_len_a=1.0, max_len_b=5, len_penalty=0.6)
    beam = beam_search(model, src, beam_size=1, max_len_a=1.0, max_len_b=5, len_penalty=0.6)
    for g, b in zip(greedy, beam):
        assert abs(g.score - g.logprob / length_penalty(len(g.tokens) + 1, 0.6)) < 1e-6
        if g.tokens == b[0].tokens:
            assert abs(g.score - b[0].score) < 1e-4


# ---- bug 3: perplexity of a multilingual checkpoint's direction -----------------------------------------------
@pytest.fixture(scope="module")
def multiway(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny en/de/fr corpus (raw and prepared with <2xx> tags), a bridge and a language-label model on it."""
    from nmtflow.data.prepare import prepare
    from nmtflow.data.synthetic import generate_corpus
    from nmtflow.train.multilingual import MultilingualTrainer

    root = tmp_path_factory.mktemp("multiway")
    generate_corpus(root / "raw", langs=("en", "de", "fr"), n_train=200, n_valid=6, n_test=6, seed=1)
    prepare({"train": str(root / "raw" / "train"), "valid": str(root / "raw" / "valid")}, ["en", "de", "fr"],
            root / "data", vocab_size=200, byte_fallback=False, lang_tags=True, progress=False)
    tiny = {"hidden_dim": 32, "encoder_layers": 1, "decoder_layers": 1, "dropout": 0.0}
    models = {"bridge": {"name": "bridge", **tiny, "bridge_heads": 3, "bridge_dim": 16},
              "ll": {"name": "language_label", "backbone": {"name": "rnn", **tiny}}}
    found = {"raw": root / "raw", "data": root / "data"}
    for name, model in models.items():
        cfg = load_config(data={
            "model": model, "data": {"path": str(root / "data"), "max_tokens": 600,
                                     "multilingual": {"langs": ["en", "de", "fr"], "zero_shot": ["de-fr"]}},
            "train": {"save_dir": str(root / name), "lr": 5e-3, "warmup_updates": 2, "max_updates": 2,
                      "validate_every": 0, "save_every": 0, "progress": False, "valid_bleu": False, "threads": 1}})
        threads = torch.get_num_threads()
        try:
            MultilingualTrainer(cfg).train()
        finally:
            torch.set_num_threads(threads)
        found[name] = root / name / "checkpoint_last.pt"
    return found


@pytest.mark.parametrize("model", ["bridge", "ll"])
def test_perplexity_of_a_direction_of_a_multilingual_model(multiway: dict[str, Path], model: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    ckpt, data, raw = str(multiway[model]), str(multiway["data"]), multiway["raw"]
    for src, tgt in (("en", "de"), ("de", "fr")):  # trained, zero-shot
        code, out, err = run(["evaluate", "--perplexity", ckpt, "--data", data, "--src-lang", src,
                              "--tgt-lang", tgt, "--json"], capsys)
        assert code == 0, err
        result = json.loads(out)
        assert result["direction"] == f"{src}-{tgt}" and result["sentences"] == 6
        # the same sentences scored one by one (with the <2TGT> tag for the language-label model)
        code, out, err = run(["score", ckpt, "--src", str(raw / f"valid.{src}"), "--tgt", str(raw / f"valid.{tgt}"),
                              "--src-lang", src, "--tgt-lang", tgt, "--json"], capsys)
        assert code == 0, err
        assert abs(-sum(json.loads(out)) / result["tokens"] - result["nll"]) < 1e-4
    code, _, err = run(["evaluate", "--perplexity", ckpt, "--data", data, "--src-lang", "en"], capsys)
    assert code == 2 and "--tgt-lang" in err
    code, _, err = run(["evaluate", "--perplexity", ckpt, "--data", data], capsys)
    assert code == 2 and "--src-lang" in err and len(err.strip().splitlines()) == 1
