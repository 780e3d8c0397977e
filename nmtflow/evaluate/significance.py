"""Paired significance of BLEU differences between the runs of a comparison (Koehn 2004).

Each run is tested against the first run of the experiment (its baseline), test set by test set and seed by
seed (seed S of a run against seed S of the baseline: the same data order and initialisation seed), with
sacreBLEU's paired bootstrap resampling (its implementation of Moses'
``bootstrap-hypothesis-difference-significance.pl``): ``n`` resamples of the test sentences, the same for both
systems; the p-value is two-sided, (c + 1) / (n + 1) where c counts the resamples whose absolute BLEU
difference, centred on its mean over the resamples, exceeds the observed absolute difference. Equal BLEU
(no difference to explain) gets p = 1 here; sacreBLEU would give 1 / (n + 1).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from nmtflow.config import BLEU_TOKENIZER
from nmtflow.data.corpus import read_lines


def paired_bootstrap(baseline: list[str], systems: dict[str, list[str]], refs: list[str],
                     samples: int, tokenize: str = BLEU_TOKENIZER) -> dict[str, dict[str, float]]:
    """{system: {"bleu", "baseline_bleu", "delta", "p_value"}} of each system against ``baseline`` (sacreBLEU
    ``PairedTest``, bootstrap, ``samples`` resamples, its fixed resampling seed; BLEU with ``tokenize``)."""
    from sacrebleu.metrics import BLEU
    from sacrebleu.significance import PairedTest

    for name, hyps in [("baseline", baseline), *systems.items()]:
        if len(hyps) != len(refs):
            raise ValueError(f"{name}: {len(hyps)} hypotheses for {len(refs)} references")
    named = [("baseline", baseline), *systems.items()]
    _, results = PairedTest(named, {"BLEU": BLEU(tokenize=tokenize)}, [refs], test_type="bs", n_samples=samples)()
    base, *rest = results["BLEU"]
    return {name: {"bleu": float(r.score), "baseline_bleu": float(base.score),
                   "delta": float(r.score - base.score),
                   "p_value": float(r.p_value) if r.score != base.score else 1.0}
            for name, r in zip(systems, rest)}


def compare_to_baseline(outcomes: list[dict[str, Any]], run_names: list[str], samples: int,
                        references: Callable[[dict[str, Any]], list[str]]
                        ) -> dict[str, dict[str, dict[int, dict[str, float]]]]:
    """{run: {test item: {seed: result}}}: :func:`paired_bootstrap` of every run after the first in
    ``run_names`` against the first, per test item and per seed that both finished. ``outcomes`` are the
    comparison's jobs with their ``result``; ``references(item)`` gives a test item's reference sentences."""
    # (run, seed, test item) → the finished job that decoded it (a bilingual run trains one job per direction)
    done = {(o["run"], o["seed"], key): o for o in outcomes if o["status"] == "done" and o["result"]
            for key in o["result"]["scores"]}
    if len(run_names) < 2 or samples < 1:
        return {}
    out: dict[str, dict[str, dict[int, dict[str, float]]]] = {}
    for (name, seed, key), base in done.items():
        if name != run_names[0]:
            continue
        item = next((i for i in base["eval"]["items"] if i["key"] == key), None)
        systems = {other: _hypotheses(done[other, seed, key], key) for other in run_names[1:]
                   if (other, seed, key) in done}
        if item is not None and systems:
            tested = paired_bootstrap(_hypotheses(base, key), systems, references(item), samples,
                                      base["eval"].get("bleu_tokenize", BLEU_TOKENIZER))
            for other, result in tested.items():
                out.setdefault(other, {}).setdefault(key, {})[seed] = result
    return out


def _hypotheses(outcome: dict[str, Any], key: str) -> list[str]:
    return read_lines(Path(outcome["dir"]) / outcome["result"]["scores"][key]["hypotheses"])
