"""Writing analysis results: JSON files, their plots, and plain-text tables of per-layer values."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

from nmtflow.checkpoint import write_failure
from nmtflow.evaluate.metrics import json_safe


def write_json(result: dict[str, Any], path: str | Path) -> None:
    """``result`` as indented JSON (NaN written as null), creating the folder."""
    path = Path(path)
    text = json.dumps(json_safe(result), indent=2) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    except OSError as exc:  # a full disk: the file named (a failed write's error names none)
        raise write_failure(path, "the results", exc) from None


def write_report(result: dict[str, Any], out_dir: str | Path, stem: str,
                 plot: Callable[[dict[str, Any], Path], None]) -> dict[str, Any]:
    """``OUT/STEM.json`` and the plot ``OUT/STEM.png`` of ``result``; their paths go into ``result["files"]``."""
    files = [Path(out_dir) / f"{stem}.json", Path(out_dir) / f"{stem}.png"]
    write_json(result, files[0])
    plot(result, files[1])
    result["files"] = [str(f) for f in files]
    return result


def layer_table(models: dict[str, dict[str, list[float]]], sides: tuple[str, ...] = ("encoder", "decoder")) -> str:
    """Rows ``SIDE LAYER`` (0 = E), one column per model: the per-layer values side by side."""
    labels = list(models)
    width = max([12, *(len(label) + 2 for label in labels)])
    lines = [f"{'':<14}" + "".join(f"{label:>{width}}" for label in labels)]
    for side in sides:
        depth = max(len(v.get(side, [])) for v in models.values())
        for layer in range(depth):
            cells = [models[label].get(side, []) for label in labels]
            values = "".join(f"{c[layer]:>{width}.4f}" if layer < len(c) and c[layer] is not None
                             else f"{'-':>{width}}" for c in cells)
            lines.append(f"{side + ' ' + ('E' if layer == 0 else str(layer)):<14}" + values)
    return "\n".join(lines)
