"""Writing analysis results: JSON files, their plots, and plain-text tables of per-layer values."""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable


def write_json(result: dict[str, Any], path: str | Path) -> None:
    """``result`` as indented JSON (NaN written as null), creating the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_finite(result), indent=2) + "\n", encoding="utf-8")


def write_report(result: dict[str, Any], out_dir: str | Path, stem: str,
                 plot: Callable[[dict[str, Any], Path], None]) -> dict[str, Any]:
    """``OUT/STEM.json`` and the plot ``OUT/STEM.png`` of ``result``; their paths go into ``result["files"]``."""
    files = [Path(out_dir) / f"{stem}.json", Path(out_dir) / f"{stem}.png"]
    write_json(result, files[0])
    plot(result, files[1])
    result["files"] = [str(f) for f in files]
    return result


def _finite(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj


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
