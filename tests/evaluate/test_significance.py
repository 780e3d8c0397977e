"""Paired bootstrap resampling of BLEU differences (nmtflow.evaluate.significance) and its table in compare."""
from __future__ import annotations

import json
import random

import pytest
from sacrebleu.metrics import BLEU

from nmtflow.evaluate.significance import paired_bootstrap

WORDS = "the a cat dog sat ran on under mat log big small".split()


def corpus(n: int = 300, seed: int = 0) -> tuple[list[str], list[str], list[str], list[str]]:
    """References, a baseline with 30% of the words replaced, a system with 10%, and one as noisy as the baseline."""
    rng = random.Random(seed)
    refs = [" ".join(rng.choices(WORDS, k=10)) for _ in range(n)]

    def noisy(p: float) -> list[str]:
        return [" ".join(w if rng.random() > p else rng.choice(WORDS) for w in r.split()) for r in refs]

    return refs, noisy(0.3), noisy(0.1), noisy(0.3)


def test_a_clearly_better_system_is_significant_and_a_like_one_is_not() -> None:
    refs, baseline, better, like = corpus()
    tested = paired_bootstrap(baseline, {"better": better, "like": like}, refs, samples=500)
    for name, hyps in (("better", better), ("like", like)):
        assert tested[name]["bleu"] == pytest.approx(BLEU().corpus_score(hyps, [refs]).score)
        assert tested[name]["baseline_bleu"] == pytest.approx(BLEU().corpus_score(baseline, [refs]).score)
        assert tested[name]["delta"] == pytest.approx(tested[name]["bleu"] - tested[name]["baseline_bleu"])
    assert tested["better"]["delta"] > 10 and tested["better"]["p_value"] == pytest.approx(1 / 501)
    assert abs(tested["like"]["delta"]) < 3 and tested["like"]["p_value"] > 0.05
    assert paired_bootstrap(baseline, {"same": baseline}, refs, samples=100)["same"] == {
        "bleu": tested["like"]["baseline_bleu"], "baseline_bleu": tested["like"]["baseline_bleu"], "delta": 0.0,
        "p_value": 1.0}
    assert paired_bootstrap(baseline, {"like": like}, refs, samples=500) == {"like": tested["like"]}  # fixed seed


def test_hypotheses_and_references_must_align() -> None:
    refs, baseline, better, _ = corpus(20)
    with pytest.raises(ValueError, match="better: 19 hypotheses for 20 references"):
        paired_bootstrap(baseline, {"better": better[:19]}, refs, samples=10)


def test_the_comparison_reports_each_run_against_the_first(tmp_path) -> None:
    from tests.evaluate.test_compare import TINY

    from nmtflow.evaluate.compare import run_comparison

    (tmp_path / "tiny.yaml").write_text(TINY.replace("budget: {updates: 10}", "budget: {updates: 4}"),
                                        encoding="utf-8")
    out = tmp_path / "out"
    result = run_comparison(tmp_path / "tiny.yaml", out=out, overrides=["isolate=false", "bootstrap_samples=200"])
    assert "significance" not in result.runs[0]
    tested = result.runs[1]["significance"]["test en-de"][1]
    hyps = {r["name"]: (out / "runs" / r["name"] / "seed-1" / "hyp.test.en-de.txt").read_text().splitlines()
            for r in result.runs}
    refs = (out / "corpus" / "test.de").read_text(encoding="utf-8").splitlines()
    assert tested == paired_bootstrap(hyps["baseline"], {"shortcuts": hyps["shortcuts"]}, refs, 200)["shortcuts"]
    md = (out / "results.md").read_text(encoding="utf-8")
    assert "Significance against baseline: paired bootstrap resampling" in md and "200 resamples" in md
    row = next(line for line in md.splitlines() if line.startswith("| shortcuts | test en-de | 1 |"))
    assert f"| {tested['delta']:+.2f} |" in row
    saved = json.loads((out / "results.json").read_text(encoding="utf-8"))
    assert saved["runs"]["shortcuts"]["significance"]["test en-de"]["1"] == tested
    again = run_comparison(tmp_path / "tiny.yaml", out=out, overrides=["isolate=false", "bootstrap_samples=0"])
    assert "significance" not in again.runs[1]
    assert "Significance against" not in (out / "results.md").read_text(encoding="utf-8")
