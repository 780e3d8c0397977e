"""Bad inputs give a one-line ``nmtflow CMD: error: ...`` naming the file and exit status 2."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nmtflow.cli import main
from nmtflow.train.checkpoint import FORMAT, save_atomic


def one_line_error(args: list[str], name: str, capsys: pytest.CaptureFixture[str]) -> str:
    code = main(args)
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith(f"nmtflow {args[0]}: error: ") and name in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    return err


@pytest.mark.parametrize("content", ["truncated", "empty", "garbage", "not_nmtflow"])
def test_translate_rejects_bad_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str) -> None:
    path = tmp_path / f"{content}.pt"
    if content == "truncated":
        save_atomic({"format": FORMAT, "model": {"w": torch.randn(1000)}}, path)
        path.write_bytes(path.read_bytes()[:700])
    elif content == "empty":
        path.write_bytes(b"")
    elif content == "garbage":
        path.write_bytes(bytes(range(256)) * 40)
    else:
        torch.save({"weights": torch.zeros(2)}, path)
    one_line_error(["translate", str(path), "--device", "cpu"], path.name, capsys)


@pytest.mark.parametrize("content", [b"\x00\xff\xfe binary \x80 garbage", b"model: [unclosed\n",
                                     b"model: {name: no-such-model}\n", b"- a list\n- not a mapping\n"])
def test_bad_config_files(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes) -> None:
    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    one_line_error(["info", str(path)], "bad.yaml", capsys)
    one_line_error(["train", str(path)], "bad.yaml", capsys)
