"""The benchmark scripts record what they ran on: every JSON they write names the machine (CPU model and flags)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))
WRITES_JSON = re.compile(r"write_json\(|write_text\(json\.dumps\(")


@pytest.mark.parametrize("script", [s for s in SCRIPTS if WRITES_JSON.search(s.read_text(encoding="utf-8"))],
                         ids=lambda s: s.name)
def test_every_benchmark_writing_json_records_the_machine(script: Path) -> None:
    source = script.read_text(encoding="utf-8")
    assert "machine_info(" in source and re.search(r'"machine": machine', source), \
        f"{script.name}: its JSON has no \"machine\" entry from nmtflow.runtime.machine_info"


def test_a_benchmark_json_names_the_cpu_model_and_its_flags(tmp_path: Path) -> None:
    out = tmp_path / "gate.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gate.py"), "--tokens", "64", "--d-model", "16",
                    "--repeats", "2", "--threads", "1", "--out", str(out)], check=True, cwd=tmp_path,
                   capture_output=True)
    machine = json.loads(out.read_text(encoding="utf-8"))["machine"]
    assert machine["cpu_model"] and isinstance(machine["cpu_flags"], list) and isinstance(machine["native_bf16"], bool)
    assert machine["threads"] == 1 and machine["torch"].startswith("2.13")
    if Path("/proc/cpuinfo").is_file() and "cpu family" in Path("/proc/cpuinfo").read_text(encoding="utf-8"):
        assert machine["cpu_family"] and machine["cpu_model_number"]  # x86 Linux: the generation, not the name alone


def test_decode_attention_times_each_path_and_checks_the_single_query_one(tmp_path: Path) -> None:
    out = tmp_path / "decode-attention.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "decode_attention.py"), "--threads", "1", "--calls", "2",
                    "--rounds", "1", "--out", str(out)], check=True, cwd=tmp_path, capture_output=True)
    result = json.loads(out.read_text(encoding="utf-8"))
    assert isinstance(result["single_query_by_default"], bool) and len(result["runs"]) == 5
    for run in result["runs"]:
        assert set(run["microseconds"]) == {"fused_fp32", "fused_bf16", "single_query_bf16"}
        assert all(t > 0 for t in run["microseconds"].values())
        assert 0 < run["max_abs_error_vs_fp32_of_bf16_inputs"]["single_query_bf16"] < 0.05
