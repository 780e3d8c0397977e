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
