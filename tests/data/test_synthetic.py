"""The built-in synthetic corpus: determinism, file format, split hygiene, and the linguistic phenomena."""
from __future__ import annotations

import json
import re
import statistics
import time
from pathlib import Path

import pytest

from nmtflow.data import synthetic as syn
from nmtflow.data.synthetic import NP, Clause, Sentence, generate_corpus, generate_sentences, lookup, realise


def n(en: str, **kw: object) -> NP:
    return NP(lookup(en), **kw)  # type: ignore[arg-type]


def say(clause: Clause, **kw: object) -> tuple[str, str, str]:
    s = Sentence(clause, **kw)  # type: ignore[arg-type]
    return realise(s, "en"), realise(s, "de"), realise(s, "fr")


def clause(frame: str, subj: NP, **kw: object) -> Clause:
    return Clause(lookup(frame, "frame"), subj, **kw)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ API and files
def test_deterministic_for_a_seed_and_different_across_seeds() -> None:
    a, b = generate_sentences(200, seed=3), generate_sentences(200, seed=3)
    assert a == b
    assert len(a) == 200 and all(len(t) == 3 for t in a)
    other = generate_sentences(200, seed=4)
    assert sum(x != y for x, y in zip(a, other)) > 150


def test_language_subset_is_the_same_meaning_in_any_order() -> None:
    full = generate_sentences(50, seed=9)
    assert generate_sentences(50, seed=9, langs=("fr", "en")) == [(fr, en) for en, _, fr in full]


def test_unknown_language_raises_value_error_naming_supported(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"supported: en, de, fr"):
        generate_sentences(5, seed=1, langs=("en", "xx"))
    with pytest.raises(ValueError, match="klingon"):
        generate_corpus(tmp_path / "c", langs=("en", "klingon"), n_train=5, n_valid=1, n_test=1)
    assert not (tmp_path / "c").exists()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, int]]:
    out = tmp_path_factory.mktemp("synthetic")
    return out, generate_corpus(out, n_train=1000, n_valid=150, n_test=150, seed=11)


def read_lines(path: Path) -> list[str]:
    raw = path.read_bytes()
    assert b"\r" not in raw and raw.endswith(b"\n")
    return raw.decode("utf-8").split("\n")[:-1]


def test_corpus_files_counts_and_format(corpus: tuple[Path, dict[str, int]]) -> None:
    out, counts = corpus
    assert counts == {"train": 1000, "valid": 150, "test": 150}
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [syn.CORPUS_MARKER, *(f"{split}.{lang}" for split in counts for lang in syn.DEFAULT_LANGS)])
    assert json.loads((out / syn.CORPUS_MARKER).read_text(encoding="utf-8")) == {
        "written_by": "nmtflow corpus", "langs": list(syn.DEFAULT_LANGS), "seed": 11, **counts}
    for split, count in counts.items():
        for lang in syn.DEFAULT_LANGS:
            lines = read_lines(out / f"{split}.{lang}")
            assert len(lines) == count
            assert all(line.strip() and line == line.strip() for line in lines), f"empty/padded line in {split}.{lang}"
            assert all(line[0].isupper() and line[-1] in ".?" for line in lines)


def test_splits_do_not_overlap(corpus: tuple[Path, dict[str, int]]) -> None:
    out, _ = corpus
    for lang in syn.DEFAULT_LANGS:
        sets = {split: set(read_lines(out / f"{split}.{lang}")) for split in ("train", "valid", "test")}
        assert not sets["train"] & sets["valid"]
        assert not sets["train"] & sets["test"]
        assert not sets["valid"] & sets["test"]


def test_corpus_is_reproducible_and_subset_langs(tmp_path: Path, corpus: tuple[Path, dict[str, int]]) -> None:
    out, _ = corpus
    generate_corpus(tmp_path, langs=["de", "en"], n_train=1000, n_valid=150, n_test=150, seed=11)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([syn.CORPUS_MARKER, *(
        f"{s}.{l}" for s in ("train", "valid", "test") for l in ("de", "en"))])
    for name in ("train.en", "test.de"):
        assert (tmp_path / name).read_bytes() == (out / name).read_bytes()


@pytest.fixture(scope="module")
def rows() -> list[tuple[str, ...]]:
    return generate_sentences(2500, seed=5)


def test_lengths_and_vocabulary_in_a_sane_range(rows: list[tuple[str, ...]]) -> None:
    for i, lang in enumerate(syn.DEFAULT_LANGS):
        lengths = [len(r[i].split()) for r in rows]
        assert min(lengths) >= 4 and max(lengths) <= 30
        assert 8 <= statistics.mean(lengths) <= 16
        assert sum(x <= 6 for x in lengths) > 80 and sum(x >= 20 for x in lengths) > 80
        vocab = {w for r in rows for w in re.findall(r"[^\W\d_]+", r[i].lower())}
        assert 350 <= len(vocab) <= 3000, (lang, len(vocab))
    assert len({r[0] for r in rows}) > 0.97 * len(rows)  # hardly any repeats


def test_generation_is_fast() -> None:
    t0 = time.process_time()
    generate_sentences(2100, seed=2)
    assert time.process_time() - t0 < 2.0  # 21k sentences: 10x this, well under 10 s of CPU


def test_lexicon_has_a_few_hundred_content_words() -> None:
    verbs = {f.en.split()[0] for f in syn.FRAMES}
    assert len(syn.NOUNS) >= 120 and len(syn.ADJS) + len(syn.COLOURS) >= 50 and len(verbs) >= 40
    assert {n.de_g for n in syn.NOUNS} == {"m", "f", "n"} and {n.fr_g for n in syn.NOUNS} == {"m", "f"}


# ------------------------------------------------------------------------------------------ phenomena
def test_german_verb_final_in_subordinate_clause() -> None:
    main = clause("sleep", n("man"))
    sub = clause("see {O}", n("dog"), obj=n("ball"))
    en, de, fr = say(main, tail=((lookup("because", "link"), sub),))
    assert en == "The man sleeps because the dog sees the ball."
    assert de == "Der Mann schläft, weil der Hund den Ball sieht."
    assert fr == "L'homme dort parce que le chien voit le ballon."
    en, de, fr = say(clause("say", n("woman"), comp=clause("call {O}", NP(pron=0), obj=n("doctor"))))
    assert de == "Die Frau sagt, dass ich den Arzt anrufe."  # separable verb joins at the end
    assert en == "The woman says that I call the doctor." and fr == "La femme dit que j'appelle le médecin."


def test_german_v2_after_fronted_adverbial_and_subordinate_clause() -> None:
    c = clause("call {O}", n("woman"), obj=n("dog"), adv=lookup("today", "time"), front=True)
    assert say(c) == ("Today, the woman calls the dog.", "Heute ruft die Frau den Hund an.",
                      "Aujourd'hui, la femme appelle le chien.")
    s = Sentence(clause("read {O}", NP(pron=2), obj=n("book", det="indef")),
                 front_sub=(lookup("when", "link"), clause("be hungry", n("cat"))))
    assert realise(s, "de") == "Wenn die Katze Hunger hat, liest er ein Buch."
    assert realise(s, "en") == "When the cat is hungry, he reads a book."
    assert realise(s, "fr") == "Quand le chat a faim, il lit un livre."


def test_french_adjective_position_and_agreement() -> None:
    c = clause("see {O}", n("girl", adj=lookup("big", "adj")),
               obj=n("house", det="indef", plural=True, adj=lookup("old", "adj"), colour=lookup("white", "colour")))
    assert say(c) == ("The big girl sees old white houses.", "Das große Mädchen sieht alte weiße Häuser.",
                      "La grande fille voit de vieilles maisons blanches.")
    c = clause("be ADJ", n("car", plural=True), adj=lookup("expensive", "adj"))
    assert say(c) == ("The cars are expensive.", "Die Autos sind teuer.", "Les voitures sont chères.")
    c = clause("be in a hurry", NP(pron=3))
    assert say(c)[2] == "Elle est pressée."
    assert realise(Sentence(clause("sleep", n("dog", adj=lookup("beautiful", "adj")))), "fr") \
        == "Le beau chien dort."
    assert realise(Sentence(clause("see {O}", NP(pron=0), obj=n("bird", adj=lookup("old", "adj")))), "fr") \
        == "Je vois le vieil oiseau."


def test_german_declension_by_case_gender_number(rows: list[tuple[str, ...]]) -> None:
    big = lookup("big", "adj")
    assert say(clause("see {O}", n("dog", det="indef", adj=big), obj=n("dog", det="indef", adj=big)))[1] \
        == "Ein großer Hund sieht einen großen Hund."
    assert say(clause("help {O}", n("cat", adj=big), obj=n("horse", det="indef", adj=big)))[1] \
        == "Die große Katze hilft einem großen Pferd."
    assert say(clause("follow {O}", n("child", plural=True), obj=n("man", plural=True)))[1] \
        == "Die Kinder folgen den Männern."
    assert say(clause("drink {O}", n("man", det="every"), obj=n("water", det="mass", adj=lookup("cold", "adj"))))[1:] \
        == ("Jeder Mann trinkt kaltes Wasser.", "Chaque homme boit de l'eau froide.")
    # all article forms of the three genders and the dative show up in the corpus
    words = {w for r in rows for w in r[1].split()}
    assert {"der", "den", "dem", "die", "das", "ein", "einen", "einem", "einer", "eine"} <= words


def test_subject_verb_agreement_in_person_and_number() -> None:
    got = [say(clause("be hungry", NP(pron=p))) for p in (0, 1, 2, 4, 5)]
    assert [g[0] for g in got] == ["I am hungry.", "You are hungry.", "He is hungry.", "We are hungry.",
                                   "They are hungry."]
    assert [g[1] for g in got] == ["Ich habe Hunger.", "Du hast Hunger.", "Er hat Hunger.", "Wir haben Hunger.",
                                   "Sie haben Hunger."]
    assert [g[2] for g in got] == ["J'ai faim.", "Tu as faim.", "Il a faim.", "Nous avons faim.", "Ils ont faim."]
    both = NP(lookup("dog"), conj=n("cat"))
    assert say(clause("run", both)) == ("The dog and the cat run.", "Der Hund und die Katze laufen.",
                                        "Le chien et le chat courent.")


def test_non_compositional_phrases_and_idioms() -> None:
    pp = (lookup("in front of", "prep"), n("house"))
    assert say(clause("sleep", n("dog", det="many", plural=True), pp=pp)) == (
        "A lot of dogs sleep in front of the house.", "Viele Hunde schlafen vor dem Haus.",
        "Beaucoup de chiens dorment devant la maison.")
    assert say(clause("kick the bucket", n("king")), question=True) == (
        "Does the king kick the bucket?", "Beißt der König ins Gras?", "Est-ce que le roi casse sa pipe ?")
    assert say(clause("go to {D}", n("teacher", plural=True), obj=n("cinema")))[1:] == (
        "Die Lehrer gehen ins Kino.", "Les professeurs vont au cinéma.")
    assert say(clause("need {O}", NP(pron=4), obj=n("book", plural=True, det="indef")))[1:] == (
        "Wir brauchen Bücher.", "Nous avons besoin de livres.")
    assert say(clause("swim", n("girl"), like=True)) == (
        "The girl likes to swim.", "Das Mädchen schwimmt gern.", "La fille aime nager.")


def test_negation() -> None:
    c = clause("see {O}", n("dog"), obj=n("ball", det="indef"), neg=True)
    assert say(c) == ("The dog does not see a ball.", "Der Hund sieht keinen Ball.",
                      "Le chien ne voit pas de ballon.")
    c = clause("listen to {O}", NP(pron=2), obj=n("teacher"), neg=True)
    assert say(c) == ("He does not listen to the teacher.", "Er hört dem Lehrer nicht zu.",
                      "Il n'écoute pas le professeur.")
    c = clause("make fun of {O}", NP(pron=0), obj=n("king"), neg=True, adv=lookup("today", "time"))
    assert say(c) == ("I do not make fun of the king today.", "Ich mache mich heute nicht über den König lustig.",
                      "Je ne me moque pas du roi aujourd'hui.")


def test_phenomena_occur_in_the_sampled_corpus(rows: list[tuple[str, ...]]) -> None:
    en, de, fr = zip(*rows)
    verbs = set()  # every finite German verb form, with separable prefixes attached
    for f in syn.FRAMES:
        spec, *rest = f.de.split()
        prefix = rest[-1][:-1] if rest and rest[-1].endswith("+") else ""
        verbs |= {prefix + syn._de_conj(spec, p) for p in range(6)}
    final = [m.group(2).split()[-1] for m in (re.search(r", (weil|dass|wenn|während|falls) ([^,.?]*)\.$", s) for s in de)
             if m and " und " not in m.group(2)]
    assert len(final) > 150 and all(w in verbs for w in final), [w for w in final if w not in verbs][:5]
    colours = "|".join(c.fr[0] for c in syn.COLOURS)
    assert sum(bool(re.search(rf"\b(le|la|les|un|une|des) \w+ ({colours})", s)) for s in fr) > 20
    v2 = [s for s in de if re.match(r"(Heute|Jetzt|Manchmal|Leider|Am \w+) (\w+) (der|die|das|ich|du|er|sie|wir)\b", s)]
    assert len(v2) > 20
    assert sum(s.endswith("?") for s in en) > 100 and sum(s.endswith(" ?") for s in fr) > 100
    assert sum(" not " in s for s in en) > 100 and sum(" pas " in s for s in fr) > 100
    assert any("in front of" in e and " vor " in d and "devant" in f for e, d, f in rows)


def test_more_sentences_than_the_generator_has_is_a_clear_error(tmp_path, monkeypatch, capsys) -> None:
    """Before: a RuntimeError traceback (the generator has run dry of new sentences)."""
    import itertools

    from nmtflow.cli import main
    from nmtflow.data import synthetic

    monkeypatch.setattr(synthetic, "_iter_tuples", lambda seed: itertools.repeat(("a", "b", "c")))
    assert main(["corpus", str(tmp_path / "c"), "--train", "5", "--valid", "0", "--test", "0"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "could not draw 5 distinct sentences (found 1 in 1,251 draws)" in err
    assert "ask for fewer with --train/--valid/--test" in err and not (tmp_path / "c").exists()
