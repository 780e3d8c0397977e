"""``decode.workers``: CPU decoding in worker processes gives what one process gives, batch for batch; the pool is
started once and stopped by ``close``; sampling, the validation inside training and bad values are handled."""
from __future__ import annotations

import dataclasses
import logging
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from torch.nn.utils import parametrize

from nmtflow.cli import main
from nmtflow.config import ConfigError, DecodeConfig, load_config
from nmtflow.decode import workers
from nmtflow.decode.search import Hypothesis
from nmtflow.decode.translate import Translator, check_search

from tests.decode.test_cli_decoding import ckpt, run  # noqa: F401 (a fixture)
from tests.decode.test_decode_review import translator
from tests.decode.test_ensemble import member

pytestmark = pytest.mark.usefixtures("one_thread")  # one thread here, so each worker has one too: the same sums


def sources(n: int, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 24, (int(torch.randint(1, 12, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_workers_find_what_one_process_finds(precision: str) -> None:
    """Many batches (24 sources, at most 12 tokens per batch), an empty input, forced prefixes and 2-best lists: the
    same hypotheses and scores from two workers as from this process, in input order."""
    one = translator(DecodeConfig(beam_size=3, nbest=2, max_tokens=12, max_len_b=5, precision=precision))
    two = Translator(one.model, None, None, dataclasses.replace(one.decode, workers=2))  # type: ignore[arg-type]
    src = sources(24)
    src[5] = []
    prefixes = [[7] if i % 3 == 0 else [] for i in range(len(src))]
    done: list[int] = []
    two.progress = done.append
    try:
        for forced in (None, prefixes):
            expected, got = one.translate_ids(src, prefixes=forced), two.translate_ids(src, prefixes=forced)
            assert [[h.tokens for h in n] for n in got] == [[h.tokens for h in n] for n in expected]
            assert [[h.score for h in n] for n in got] == [[h.score for h in n] for n in expected]
        assert sum(done) == 2 * len(src)  # progress counts every input, the empty one too
        pool = two.decode_pool()
        assert pool.threads == 1 and pool.workers == 2
        two.translate_ids(src[:10])
        assert two.decode_pool() is pool  # started once, kept between calls
        copy = dataclasses.replace(two, decode=dataclasses.replace(two.decode, beam_size=2))
        copy.translate_ids(src)
        assert copy.decode_pool() is pool  # and shared by every translator of the model (the API's per-call copies)
        processes = list(pool._executor._processes.values())
        assert len(processes) == 2 and all(p.is_alive() for p in processes)
    finally:
        two.close()
    assert one.model not in workers._POOLS and not any(p.is_alive() for p in processes)


def test_the_workers_follow_changed_weights_and_replace_a_dead_worker() -> None:
    """In bf16 too: after an in-place change of the weights (a fine-tuning step, ``load_state_dict``) the workers
    decode the new ones; a worker killed while idle is replaced at the next call; Ctrl-C goes to the parent alone."""
    one = translator(DecodeConfig(beam_size=2, max_tokens=12, max_len_b=4, precision="bf16"))
    two = Translator(one.model, None, None, dataclasses.replace(one.decode, workers=2))  # type: ignore[arg-type]
    src = sources(16, seed=5)
    try:
        two.translate_ids(src)
        first = two.decode_pool()
        with torch.no_grad():
            for p in one.model.parameters():
                p.add_(torch.randn_like(p) * 0.5)
        expected = [[h.tokens for h in n] for n in one.translate_ids(src)]
        assert [[h.tokens for h in n] for n in two.translate_ids(src)] == expected
        second = two.decode_pool()
        assert second is not first and first.broken is False
        processes = list(second._executor._processes.values())
        for process in processes:
            os.kill(process.pid, signal.SIGINT)  # a terminal's Ctrl-C: ignored by the workers
        time.sleep(1)
        assert all(p.is_alive() for p in processes) and not second.broken
        assert [[h.tokens for h in n] for n in two.translate_ids(src)] == expected
        os.kill(processes[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not second.broken and time.monotonic() < deadline:
            time.sleep(0.05)
        assert second.broken
        assert [[h.tokens for h in n] for n in two.translate_ids(src)] == expected
        assert two.decode_pool() is not second
    finally:
        two.close()


def test_one_batch_stays_in_this_process() -> None:
    t = translator(DecodeConfig(beam_size=2, max_len_b=4, workers=2))
    assert len(t.translate_ids(sources(1) + [[]])) == 2 and t.model not in workers._POOLS  # nothing to share out


def test_sampling_with_workers_and_bad_counts_are_errors() -> None:
    with pytest.raises(ValueError, match=r"--workers \(decode.workers\): 2 worker processes do not sample"):
        check_search(DecodeConfig(sampling=True, workers=2))
    with pytest.raises(ValueError, match=r"--workers 0 \(decode.workers\): must be >= 1"):
        check_search(DecodeConfig(workers=0))
    with pytest.raises(ConfigError, match=r"decode.workers: must be >= 1, got 0"):
        load_config(data={"decode": {"workers": 0}})
    with pytest.raises(ConfigError, match=r"decode.workers: 3 worker processes do not sample"):
        load_config(data={"decode": {"sampling": True, "workers": 3}})


def test_a_model_off_the_cpu_decodes_in_its_process_with_a_warning(monkeypatch: pytest.MonkeyPatch,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint whose config says ``decode.workers: 2``, opened on a GPU: one process, one warning."""
    t = translator(DecodeConfig(beam_size=2, max_tokens=10, workers=2))
    monkeypatch.setattr(Translator, "device", property(lambda self: torch.device("meta")))
    with pytest.raises(ValueError, match=r"decode.workers: 2 worker processes decode on the CPU; this model is on "
                                         r"meta"):
        t.decode_pool()
    searched = []
    monkeypatch.setattr(Translator, "search", lambda self, src, **kw: searched.append(len(src)) or
                        [[Hypothesis([5], -1.0, -1.0)] for _ in range(len(src))])
    with caplog.at_level(logging.WARNING, logger="nmtflow.decode.translate"):
        for _ in range(2):
            assert len(t.translate_ids(sources(12))) == 12
    assert sum(searched) == 24 and t.model not in workers._POOLS
    assert [r.getMessage() for r in caplog.records].count(
        "decode.workers: 2 worker processes decode on the CPU; this model is on meta, which decodes in this "
        "process") == 1


def test_validation_during_training_decodes_in_its_own_process(copy_data: Path, tmp_path: Path) -> None:
    """``decode.workers`` is for translating a finished model: the trainer's BLEU validation keeps one process."""
    from tests.conftest import tiny_config
    from nmtflow.train.trainer import Trainer

    config = tiny_config(copy_data, tmp_path, max_updates=2, validate_every=2, save_every=0,
                         valid_bleu_max_sentences=8)
    config.decode.workers = 2
    started = []
    monkey = pytest.MonkeyPatch()
    monkey.setattr(Translator, "decode_pool", lambda self: started.append(self) or pytest.fail("pool started"))
    try:
        Trainer(config).train()
    finally:
        monkey.undo()
    assert not started


def test_translate_with_workers_writes_what_one_process_writes(ckpt: str, tmp_path: Path,  # noqa: F811
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "in.txt"
    src.write_text("".join(f"alpha bravo {w} charlie\n" for w in ("delta", "echo", "golf", "hotel") * 6),
                   encoding="utf-8")
    outputs = []
    for extra in ([], ["--workers", "2"]):
        out = tmp_path / f"out{len(extra)}.txt"
        code, _, _ = run(["translate", ckpt, "-i", str(src), "-o", str(out),
                          "--batch-tokens", "16", "--threads", "1", *extra], capsys)
        assert code == 0
        outputs.append(out.read_text(encoding="utf-8"))
    assert outputs[1] == outputs[0] and outputs[0].count("\n") == 24
    assert main(["translate", ckpt, "-i", str(src), "--sampling", "--workers", "2",
                 "--device", "cpu"]) != 0
    assert "--workers (decode.workers): 2 worker processes do not sample" in capsys.readouterr().err
    assert main(["score", ckpt, "--src", str(src), "--tgt", str(src), "--workers", "2", "--device", "cpu"]) != 0
    assert "--workers: score computes log P(translation | source)" in capsys.readouterr().err


def test_a_weight_normalised_model_decodes_in_workers() -> None:
    """ConvS2S's weight-normalised layers (parametrized weights, which PyTorch does not pickle) reach the workers
    with their weights computed: the same hypotheses and scores as in this process."""
    model = member("convs2s", 3)
    assert any(parametrize.is_parametrized(m) for m in model.modules())
    one = Translator(model, None, None, DecodeConfig(beam_size=2, max_tokens=12, max_len_b=4))  # type: ignore[arg-type]
    two = Translator(model, None, None, dataclasses.replace(one.decode, workers=2))  # type: ignore[arg-type]
    src = sources(8)
    try:
        expected, got = one.translate_ids(src), two.translate_ids(src)
    finally:
        two.close()
    assert [[h.tokens for h in n] for n in got] == [[h.tokens for h in n] for n in expected]
    assert [h.score for n in got for h in n] == pytest.approx([h.score for n in expected for h in n], rel=1e-6)
    assert any(parametrize.is_parametrized(m) for m in model.modules())  # the model itself is left as it was
