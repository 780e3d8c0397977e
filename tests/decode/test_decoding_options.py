"""Sampling, target prefixes and min_len through the config (`decode:`), the `Translator` API and `nmtflow
translate`: validation that names the key or the option, reproducible seeds, prefix files."""
from __future__ import annotations

import io
from pathlib import Path

import pytest

from nmtflow.config import ConfigError, DecodeConfig, load_config
from nmtflow.decode.translate import Translator

from tests.decode.test_cli_decoding import ckpt, run  # noqa: F401 (a fixture)
from tests.decode.test_decode_review import translator

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("decode, message", [
    ({"min_len": -1}, "decode.min_len: must be >= 0, got -1"),
    ({"sampling": True, "temperature": 0.0}, r"decode.temperature: must be a number > 0, got 0.0"),
    ({"sampling": True, "temperature": float("inf")}, r"decode.temperature: must be a number > 0, got inf"),
    ({"sampling": True, "top_k": -2}, r"decode.top_k: must be >= 0 \(0: no top-k filtering\), got -2"),
    ({"sampling": True, "top_p": 1.5}, r"decode.top_p: must be between 0 and 1 \(1.0: no nucleus filtering\)"),
    ({"sampling": True, "top_p": float("nan")}, r"decode.top_p: must be between 0 and 1"),
    ({"sampling": True, "seed": -1}, r"decode.seed: must be >= 0"),
    ({"sampling": True, "greedy": True}, r"decode.sampling: draws tokens at random, greedy search takes"),
    ({"top_k": 10}, r"decode.top_k: 10 applies to sampling only \(set sampling: true, or leave top_k at 0\)"),
    ({"temperature": 0.7}, r"decode.temperature: 0.7 applies to sampling only"),
    ({"seed": 3}, r"decode.seed: 3 applies to sampling only"),
    ({"greedy": True, "nbest": 2}, r"decode.nbest: 2 with greedy: true"),
    ({"nbest": 6}, r"decode.nbest: 6 is more than beam_size 5"),
])
def test_decode_settings_are_checked_at_load(decode: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(data={"model": {"name": "transformer"}, "decode": decode})


def test_sampling_settings_load_and_nbest_counts_samples() -> None:
    """nbest above beam_size is a beam-search rule only: with sampling it is the number of samples."""
    d = load_config(data={"model": {"name": "transformer"}, "decode": {
        "sampling": True, "nbest": 8, "beam_size": 2, "temperature": 0.8, "top_k": 20, "top_p": 0.9, "seed": 7,
        "min_len": 3}}).decode
    assert (d.sampling, d.nbest, d.temperature, d.top_k, d.top_p, d.seed, d.min_len) == (True, 8, 0.8, 20, 0.9, 7, 3)


def test_translator_samples_reproducibly_and_honours_min_len() -> None:
    t = translator(DecodeConfig(sampling=True, nbest=3, beam_size=1, seed=11, min_len=4, max_len_a=0.0,
                                max_len_b=9))
    sources = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    first = [[h.tokens for h in hyps] for hyps in t.translate_ids(sources)]
    assert [len(s) for s in first] == [3, 3, 3] and all(4 <= len(o) <= 9 for s in first for o in s)
    assert [[h.tokens for h in hyps] for hyps in t.translate_ids(sources)] == first
    t.decode.seed = 12
    assert [[h.tokens for h in hyps] for hyps in t.translate_ids(sources)] != first
    t.decode.seed = 11  # another chunk of the same input (translate_stream) draws from another stream
    assert [[h.tokens for h in hyps] for hyps in t.translate_ids(sources, first_line=1001)] != first


@pytest.mark.parametrize("search", [{"beam_size": 3}, {"greedy": True}, {"sampling": True, "seed": 1}])
def test_translator_min_len_and_prefixes(search: dict) -> None:
    t = translator(DecodeConfig(min_len=5, max_len_a=0.0, max_len_b=7, **search))
    sources = [[5, 6, 7], [8, 9], [], [10, 11, 12, 13]]
    prefixes = [[20, 21], [], [22], [23, 23, 23, 23, 23, 23, 23, 23, 23]]
    hyps = t.translate_ids(sources, prefixes=prefixes)
    for nbest, prefix, source in zip(hyps, prefixes, sources):
        assert nbest[0].tokens[:len(prefix)] == prefix
        if source:
            assert len(nbest[0].tokens) >= 5
    assert hyps[2][0].tokens == [22]  # an empty input: nothing translated, the prefix alone
    with pytest.raises(ValueError, match="2 prefixes for 4 inputs"):
        t.translate_ids(sources, prefixes=prefixes[:2])


def test_translate_api_prefixes(ckpt: str) -> None:  # noqa: F811
    t = Translator.from_checkpoint(ckpt)
    t.decode.max_len_a, t.decode.max_len_b = 0.0, 4
    lines = ["alpha bravo charlie", "delta echo", "golf"]
    plain = t.translate(lines)
    forced = t.translate(lines, prefixes=["kilo lima", "", "mike"])
    assert forced[0][0][0].startswith("kilo lima") and forced[2][0][0].startswith("mike")
    assert forced[1] == plain[1]
    with pytest.raises(ValueError, match=r"^p\.txt: 1 prefixes for 3 input lines of in\.txt"):
        t.translate(lines, name="in.txt", prefixes=["kilo"], prefix_name="p.txt")
    with pytest.raises(ValueError, match=r"^p\.txt:2: prefix line 2 has \d+ tokens; the model writes at most 63"):
        t.translate(lines, prefixes=["", "alpha " * 70, ""], prefix_name="p.txt")


def test_translate_cli_sampling_prefix_and_min_len(ckpt: str, tmp_path: Path,  # noqa: F811
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    src, prefix = tmp_path / "in.txt", tmp_path / "prefix.txt"
    src.write_text("alpha bravo charlie\ndelta echo\n", encoding="utf-8")
    prefix.write_text("kilo lima\n\n", encoding="utf-8")
    sample = ["translate", ckpt, "-i", str(src), "--sampling", "--nbest", "4", "--max-len-b", "6"]
    code, first, _ = run([*sample, "--seed", "5"], capsys)
    assert code == 0 and [line.split("\t")[0] for line in first.splitlines()] == ["0"] * 4 + ["1"] * 4
    assert run([*sample, "--seed", "5"], capsys)[1] == first
    assert run([*sample, "--seed", "6"], capsys)[1] != first
    code, out, _ = run([*sample, "--seed", "5", "--prefix", str(prefix)], capsys)
    assert code == 0 and all(line.split("\t")[2].startswith("kilo lima") for line in out.splitlines()[:4])
    code, out, _ = run(["translate", ckpt, "-i", str(src), "--prefix", str(prefix), "--max-len-b", "6"], capsys)
    assert code == 0 and out.splitlines()[0].startswith("kilo lima")

    t = Translator.from_checkpoint(ckpt)  # --min-len reaches the search: the API with decode.min_len agrees
    t.decode.greedy, t.decode.min_len, t.decode.max_len_b = True, 5, 6
    ids = t.translate_ids(t.encode_source(["alpha bravo charlie", "delta echo"]))
    assert all(len(nbest[0].tokens) >= 5 for nbest in ids)
    code, out, _ = run(["translate", ckpt, "-i", str(src), "--greedy", "--min-len", "5", "--max-len-b", "6"], capsys)
    assert code == 0 and out.splitlines() == [t.tgt_tokenizer.decode(nbest[0].tokens) for nbest in ids]


@pytest.mark.parametrize("args, message", [
    (["--top-k", "5"], "--top-k: applies to sampling only: add --sampling"),
    (["--seed", "3"], "--seed: applies to sampling only: add --sampling"),
    (["--sampling", "--greedy"], "--sampling (decode.sampling): draws tokens at random, greedy search takes"),
    (["--sampling", "--temperature", "0"], "--temperature (decode.temperature): must be a number > 0, got 0.0"),
    (["--sampling", "--top-p", "2"], "--top-p (decode.top_p): must be between 0 and 1"),
    (["--min-len", "-1"], "--min-len (decode.min_len): must be >= 0, got -1"),
    (["--prefix", "PREFIX1"], "PREFIX1 has 1 lines but IN has 2 (--prefix: one prefix per input line"),
    (["--prefix", "MISSING"], "MISSING: file not found"),
])
def test_translate_cli_errors(ckpt: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],  # noqa: F811
                              args: list[str], message: str) -> None:
    (tmp_path / "IN").write_text("alpha\nbravo\n", encoding="utf-8")
    (tmp_path / "PREFIX1").write_text("kilo\n", encoding="utf-8")
    args = [str(tmp_path / a) if a in ("PREFIX1", "MISSING") else a for a in args]
    code, out, err = run(["translate", ckpt, "-i", str(tmp_path / "IN"), *args], capsys)
    assert code == 2 and out == "" and message.replace("PREFIX1", str(tmp_path / "PREFIX1")).replace(
        "MISSING", str(tmp_path / "MISSING")).replace("IN has", f"{tmp_path / 'IN'} has") in err


def test_score_refuses_the_sampling_options(ckpt: str, tmp_path: Path,  # noqa: F811
                                            capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "a").write_text("alpha\n", encoding="utf-8")
    code, _, err = run(["score", ckpt, "--src", str(tmp_path / "a"), "--tgt", str(tmp_path / "a"), "--sampling"],
                       capsys)
    assert code == 2 and "--sampling: score computes log P(translation | source)" in err


def test_streamed_prefixes_must_match_the_lines(ckpt: str, tmp_path: Path,  # noqa: F811
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    t = Translator.from_checkpoint(ckpt)
    t.decode.max_len_b = 3
    lines = ["alpha\n", "bravo\n", "charlie\n"]
    out = list(t.translate_stream(iter(lines), chunk=2, prefixes=iter(["kilo", "", "mike"])))
    assert out[0][0][0].startswith("kilo") and out[2][0][0].startswith("mike") and len(out) == 3
    with pytest.raises(ValueError, match=r"^p\.txt: 2 prefixes for more than 2 input lines of in\.txt"):
        list(t.translate_stream(iter(lines), chunk=1, prefixes=iter(["kilo", ""]), name="in.txt",
                                prefix_name="p.txt"))
    with pytest.raises(ValueError, match=r"^p\.txt: more than 1 prefixes for 1 input lines of the input"):
        list(t.translate_stream(iter(lines[:1]), prefixes=iter(["kilo", ""]), prefix_name="p.txt"))
    prefix = tmp_path / "prefix.txt"
    prefix.write_text("kilo\n", encoding="utf-8")
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"alpha\nbravo\n")))
    code, _, err = run(["translate", ckpt, "--prefix", str(prefix)], capsys)
    assert code == 2 and f"{prefix}: 1 prefixes for more than 1 input lines" in err
