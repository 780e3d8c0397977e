"""The process-wide malloc setting: applied once on Linux, skipped when the user opts out."""
from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from nmtflow import runtime


def run(code: str, **env: str) -> str:
    import os

    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_applied_once_on_linux_and_opt_out() -> None:
    code = "from nmtflow.runtime import keep_freed_memory as k; print(k(), k())"
    assert run(code, NMTFLOW_SYSTEM_MALLOC="0") == "True True"
    assert run(code, NMTFLOW_SYSTEM_MALLOC="1") == "False False"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_held_heap_grows_without_page_faults() -> None:
    def faults(setup: str, **env: str) -> tuple[str, int]:
        code = ("import resource, torch; from nmtflow import runtime as r; "
                f"ok = {setup}; n = resource.getrusage(resource.RUSAGE_SELF).ru_minflt; "
                "kept = [torch.ones(64 << 20, dtype=torch.uint8) for _ in range(3)]; "  # 192 MB of new heap
                "print(ok, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - n)")
        ok, count = run(code, **env).split()
        return ok, int(count)

    ok, held = faults("r.hold_heap(256 << 20)", NMTFLOW_SYSTEM_MALLOC="0")  # 256 MB touched once, then freed
    assert ok == "True"
    ok, grown = faults("r.keep_freed_memory()", NMTFLOW_SYSTEM_MALLOC="0")  # the same growth onto fresh pages
    assert ok == "True" and grown > 0 and held * 10 <= grown, (held, grown)
    assert faults("r.hold_heap(0)", NMTFLOW_SYSTEM_MALLOC="1")[0] == "False"  # opted out: malloc left alone


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc_trim is Linux-only")
def test_freed_memory_is_returned_on_release() -> None:
    code = ("from nmtflow import runtime as r; import torch; "
            "rss = lambda: int(open('/proc/self/statm').read().split()[1]) * 4096 >> 20; "
            "ok = r.keep_freed_memory(); big = torch.ones(256 << 20, dtype=torch.uint8); "
            "small = torch.ones(1 << 20, dtype=torch.uint8); del big; "  # the freed block below a live one
            "kept = rss(); released = r.release_freed_memory(); print(ok, released, kept, rss())")
    ok, released, kept, after = run(code, NMTFLOW_SYSTEM_MALLOC="0").split()
    assert ok == released == "True" and int(kept) - int(after) >= 200, (kept, after)
    off = run(code, NMTFLOW_SYSTEM_MALLOC="1").split()
    assert off[:2] == ["False", "False"]  # malloc left alone: nothing kept, nothing to release


def test_training_releases_freed_memory_after_each_validation(copy_data, tmp_path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from nmtflow.train import trainer as trainer_module
    from tests.conftest import tiny_config

    calls: list[int] = []
    config = tiny_config(copy_data, tmp_path / "run", max_updates=6, validate_every=2, save_every=0,
                         valid_bleu=False)
    t = trainer_module.Trainer(config)
    monkeypatch.setattr(trainer_module, "release_freed_memory", lambda: calls.append(t.progress.update) or True)
    t.train()
    assert calls == [2, 4, 6]


def test_result_is_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "_applied", None)
    monkeypatch.setenv(runtime.OPT_OUT, "1")
    assert runtime.keep_freed_memory() is False
    monkeypatch.delenv(runtime.OPT_OUT)
    assert runtime.keep_freed_memory() is False  # decided once per process


def test_tf32_is_a_process_setting_and_autocast_follows_the_precision() -> None:
    code = ("import torch; from nmtflow.runtime import use_precision as u; m = torch.backends.cuda.matmul; "
            "u('tf32'); a = m.fp32_precision; u('bf16'); b = m.fp32_precision; u('fp32'); print(a, b, m.fp32_precision)")
    # a subprocess, since the setting is process-wide: bf16 leaves it, fp32 after tf32 is IEEE float32 again
    assert run(code) == "tf32 tf32 ieee"
    cpu = torch.device("cpu")
    for precision in ("fp32", "tf32"):
        with runtime.autocast(precision, cpu):
            assert not torch.is_autocast_enabled("cpu")
    with runtime.autocast("bf16", cpu):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_machine_info_names_the_cpu_and_its_speed_flags(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    info = runtime.machine_info("cpu", threads=3)
    assert info["device"] == "cpu" and info["threads"] == 3 and info["cpus"] >= 1 and info["cpu_model"]
    assert set(info["cpu_flags"]) <= set(runtime.SPEED_FLAGS)
    assert info["native_bf16"] == any(f in info["cpu_flags"] for f in runtime.NATIVE_BF16_FLAGS)
    # read from /proc/cpuinfo: the first processor's model name and flags
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n"
                    "model name\t: Test CPU 9000\nstepping\t: 1\nflags\t\t: fpu avx2 fma amx_bf16 amx_tile\n\n"
                    "processor\t: 1\nvendor_id\t: other\ncpu family\t: 6\nmodel\t\t: 9\nmodel name\t: other\n"
                    "flags\t\t: fpu\n", encoding="utf-8")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(fake if path == "/proc/cpuinfo" else path,
                                                                        *a, **k))
    runtime.cpu_info.cache_clear()
    try:
        assert runtime.cpu_info() == {"cpu_model": "Test CPU 9000", "cpu_vendor": "AuthenticAMD", "cpu_family": "26",
                                      "cpu_model_number": "2", "cpu_stepping": "1",
                                      "cpu_flags": ["avx2", "fma", "amx_tile", "amx_bf16"], "native_bf16": True}
    finally:
        runtime.cpu_info.cache_clear()


def test_bf16_on_a_cpu_without_native_bf16_is_a_warning(copy_data, tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from nmtflow.train import trainer as trainer_module
    from tests.conftest import tiny_config

    def trainer(native: bool, name: str) -> None:
        monkeypatch.setattr(runtime, "cpu_info", lambda: {"cpu_model": "Old CPU", "cpu_flags": ["avx2"],
                                                                  "native_bf16": native})
        config = tiny_config(copy_data, tmp_path / name, max_updates=1, precision="bf16", device="cpu")
        with caplog.at_level(logging.WARNING, logger="nmtflow"):
            trainer_module.Trainer(config)

    trainer(False, "emulated")
    assert "bf16 on a CPU without native bf16 (Old CPU has neither AMX nor AVX-512 BF16)" in caplog.text
    caplog.clear()
    trainer(True, "native")
    assert "without native bf16" not in caplog.text


@pytest.mark.skipif(not runtime.cpu_info()["native_bf16"], reason="bf16 products go to oneDNN's AMX/AVX-512 kernels")
def test_onednns_kernel_cache_holds_more_shapes_than_its_default() -> None:
    """Importing nmtflow sizes oneDNN's kernel cache for an epoch's batch shapes (``nmtflow/__init__.py``): a second
    pass over 1,298 shapes compiles nothing, where at oneDNN's own 1,024 (a value the user set is kept) it compiles
    every one again."""
    import os

    code = ("import nmtflow, torch\n"
            "w, x = torch.randn(64, 64, dtype=torch.bfloat16), torch.randn(1300, 64, dtype=torch.bfloat16)\n"
            "for _ in range(2):\n"
            "    for n in range(2, 1300):\n"
            "        x[:n] @ w\n")
    env = {k: v for k, v in os.environ.items() if k != "ONEDNN_PRIMITIVE_CACHE_CAPACITY"}

    def compiled(**extra: str) -> int:
        out = subprocess.run([sys.executable, "-c", code], env={**env, "ONEDNN_VERBOSE": "profile_create", **extra},
                             check=True, capture_output=True, text=True).stdout
        return out.count("create:cache_miss")

    assert compiled() == 1298
    assert compiled(ONEDNN_PRIMITIVE_CACHE_CAPACITY="1024") == 2 * 1298


STOPPED_CHILD = """
import time
from nmtflow.runtime import RunningClock
clock = RunningClock(tick=0.05, gap=0.5)
wall, running = time.perf_counter(), clock()
print("ready", flush=True)
time.sleep(3.0)  # the parent stops this process for 2 s of these 3
print(time.perf_counter() - wall, clock() - running, clock.stopped_seconds, flush=True)
"""


@pytest.mark.skipif(not hasattr(signal, "SIGSTOP"), reason="needs POSIX job-control signals")
@pytest.mark.parametrize("stop", [True, False])
def test_running_clock_leaves_out_the_time_its_process_stood_stopped(stop: bool) -> None:
    """Training time (train.max_minutes, tokens/s) must not count a ``kill -STOP`` / Ctrl-Z pause."""
    child = subprocess.Popen([sys.executable, "-c", STOPPED_CHILD], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    if stop:
        time.sleep(0.3)
        os.kill(child.pid, signal.SIGSTOP)
        time.sleep(2.0)
        os.kill(child.pid, signal.SIGCONT)
    wall, running, stopped = map(float, child.stdout.readline().split())
    assert child.wait(timeout=30) == 0
    assert wall >= 2.9
    if stop:
        assert 1.5 < wall - running < 2.5 and stopped == pytest.approx(wall - running, abs=0.01)
    else:
        assert wall - running < 0.01 and stopped == 0.0


def test_running_clock_thread_ends_with_close_or_with_the_clock() -> None:
    closed, dropped = runtime.RunningClock(tick=0.01), runtime.RunningClock(tick=0.01)
    threads = closed._thread, dropped._thread
    closed.close()
    del dropped
    gc.collect()
    for thread in threads:
        thread.join(timeout=2)
        assert not thread.is_alive()
