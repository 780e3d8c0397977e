"""The process-wide malloc setting: applied once on Linux, skipped when the user opts out."""
from __future__ import annotations

import subprocess
import sys

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


def test_result_is_cached(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runtime, "_applied", None)
    monkeypatch.setenv(runtime.OPT_OUT, "1")
    assert runtime.keep_freed_memory() is False
    monkeypatch.delenv(runtime.OPT_OUT)
    assert runtime.keep_freed_memory() is False  # decided once per process


def test_tf32_is_a_process_setting_and_autocast_follows_the_precision() -> None:
    code = ("import torch; from nmtflow.runtime import use_precision as u; m = torch.backends.cuda.matmul; "
            "a = m.fp32_precision; u('fp32'); b = m.fp32_precision; u('tf32'); print(a == b, m.fp32_precision)")
    assert run(code) == "True tf32"  # fp32 leaves the default; a subprocess, since the setting is process-wide
    cpu = torch.device("cpu")
    for precision in ("fp32", "tf32"):
        with runtime.autocast(precision, cpu):
            assert not torch.is_autocast_enabled("cpu")
    with runtime.autocast("bf16", cpu):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
