"""Experiment files for ``nmtflow compare``: typed dataclasses, loaded as strictly as model configs.

An experiment names one dataset, the runs to compare, one budget that every run gets, seeds, checkpoint
averaging, decode settings and test sets::

    name: lexical-shortcuts
    data: {path: data/multi30k, langs: [en, de], directions: [en-de], vocab_size: 8000,
           splits: {train: train, valid: val}}
    overrides: [model.encoder_layers=3, model.decoder_layers=3]   # applied to every run first
    runs:
      - {name: baseline, config: transformer-small}                # a preset name from configs/ ...
      - {name: shortcuts, config: ../configs/shortcuts-small.yaml} # ... or a file relative to this one
    budget: {updates: 4000}                                        # and/or epochs, minutes
    seeds: [1, 2, 3]
    ensemble: true                                                 # also decode each run's seeds as one model
    bootstrap_samples: 1000                                        # paired bootstrap vs the first run (0: off)
    bleu_tokenize: 13a                                             # sacreBLEU's BLEU tokenizer (zh, char, ...)
    average_last: 5
    decode: {beam_size: 5}
    test_sets: [valid]

Unknown keys are errors that name the file and the key; ``base: other.yaml`` inherits as in model configs.
"""
from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nmtflow.config import (BLEU_TOKENIZER, PRESETS_DIR, ConfigError, DecodeConfig, apply_overrides,
                            check_bleu_tokenizer, coerce, name_origin, parse_override, read_yaml)

# keys the experiment sets for every run (the budget must be equal; seeds and data are the experiment's)
RESERVED_KEYS = ("train.max_updates", "train.max_epochs", "train.max_minutes", "train.seed", "train.save_dir",
                 "data.path", "data.src_lang", "data.tgt_lang", "data.train_split", "data.valid_split")
DEVICE = re.compile(r"auto|cpu|cuda(:[0-9]+)?|mps")  # as train.device


def parse_direction(text: str, where: str) -> tuple[str, str]:
    """``en-de`` (or ``en>de`` for codes containing '-') → ("en", "de")."""
    parts = text.split(">") if ">" in text else text.split("-")
    if len(parts) != 2 or not all(p.strip() for p in parts):
        raise ConfigError(f"{where}: direction {text!r}: expected SRC-TGT, e.g. en-de")
    return parts[0].strip(), parts[1].strip()


@dataclass
class SyntheticData:
    """The built-in corpus (``nmtflow.data.synthetic.generate_corpus``) as the data source."""

    n_train: int = 20000
    n_valid: int = 500
    n_test: int = 500
    langs: list[str] = field(default_factory=list)  # default: data.langs
    seed: int = 1234


@dataclass
class ExperimentData:
    """The dataset: raw ``PREFIX.LANG`` files (prepared once, cached), a prepared directory, or synthetic."""

    path: str = ""  # raw directory or one written by `nmtflow prepare`; relative to the current directory
    synthetic: SyntheticData | None = None  # instead of path: generate the built-in corpus
    langs: list[str] = field(default_factory=list)  # default: the languages of directions
    directions: list[str] = field(default_factory=lambda: ["en-de"])  # first: the direction of bilingual runs
    zero_shot: list[str] = field(default_factory=list)  # multilingual runs: held out of training, still tested
    splits: dict[str, str] = field(default_factory=lambda: {"train": "train", "valid": "valid", "test": "test"})
    vocab_size: int = 8000
    joint: bool = True
    lang_tags: bool = False  # reserve <2xx> tags (language-label models)
    byte_fallback: bool = True  # unseen characters as byte pieces, not <unk> (nmtflow prepare --no-byte-fallback)
    max_len: int = 250  # cleaning of the training split
    max_ratio: float = 3.0

    def validate(self, where: str) -> None:
        if not self.directions:
            raise ConfigError(f"{where}.directions: name at least one direction, e.g. [en-de]")
        pairs = [parse_direction(d, f"{where}.directions") for d in self.directions]
        pairs += [parse_direction(d, f"{where}.zero_shot") for d in self.zero_shot]
        if not self.langs:
            self.langs = list(dict.fromkeys(lang for pair in pairs for lang in pair))
        for lang in {lang for pair in pairs for lang in pair}:
            if lang not in self.langs:
                raise ConfigError(f"{where}.langs: {lang!r} is used by a direction but not listed")
        for name in ("train", "valid"):
            if name not in self.splits:
                raise ConfigError(f"{where}.splits: needs a {name!r} split (name: file prefix)")
        if self.synthetic is not None and self.path:
            raise ConfigError(f"{where}: give either path or synthetic, not both")
        if self.vocab_size <= 4:  # <pad>, <unk>, <s>, </s>; the text's least is SentencePiece's to say
            raise ConfigError(f"{where}.vocab_size: must be > 4 (the special pieces and at least one more), got "
                              f"{self.vocab_size}")
        if self.max_len < 1:
            raise ConfigError(f"{where}.max_len: must be >= 1 (tokens of a training sentence), got {self.max_len}")
        if not self.max_ratio >= 1:  # NaN too
            raise ConfigError(f"{where}.max_ratio: must be >= 1 (longer side / shorter side), got {self.max_ratio}")
        if self.synthetic is not None:
            for split in ("train", "valid", "test"):
                least, n = int(split == "train"), getattr(self.synthetic, f"n_{split}")
                if n < least:
                    raise ConfigError(f"{where}.synthetic.n_{split}: the number of {split} sentences must be "
                                      f">= {least}, got {n}")


@dataclass
class RunSpec:
    """One system of the comparison: a model config (file or preset name) plus ``KEY=VALUE`` overrides."""

    name: str = ""
    config: str = ""
    overrides: list[str] = field(default_factory=list)
    group: str = ""  # runs of one group can be run and reported together: --only GROUP
    # the run's own directions (default: the experiment's data.directions). A bilingual model is trained once per
    # direction (OUT/runs/NAME/DIRECTION/seed-S); a multilingual one is trained on all of them at once
    directions: list[str] = field(default_factory=list)
    zero_shot: list[str] = field(default_factory=list)  # multilingual runs with their own directions: held out
    per_direction: bool = False  # a multilingual model type trained once per direction (e.g. a bilingual bridge)

    def validate(self, where: str) -> None:
        if not self.name or any(c.isspace() or c in "/\\" for c in self.name) or self.name.startswith("."):
            raise ConfigError(f"{where}.name: {self.name!r} is not a usable run name (no spaces or slashes)")
        if not self.config:
            raise ConfigError(f"{where}.config: missing (a config file or a preset name from configs/)")
        check_overrides(self.overrides, f"{where}.overrides")
        if self.group and any(c.isspace() or c == "," for c in self.group):
            raise ConfigError(f"{where}.group: {self.group!r} is not a usable group name (no spaces or commas)")
        for key in ("directions", "zero_shot"):
            values = getattr(self, key)
            for text in values:
                parse_direction(text, f"{where}.{key}")
            dup = next((d for d in values if values.count(d) > 1), None)
            if dup:
                raise ConfigError(f"{where}.{key}: {dup!r} is listed twice")
        if self.per_direction and (self.zero_shot or not self.directions):
            raise ConfigError(f"{where}.per_direction: needs the run's own directions and no zero_shot (each model "
                              "translates only the direction it is trained on)")
        if self.zero_shot and not self.directions:
            raise ConfigError(f"{where}.zero_shot: needs the run's own directions (zero-shot directions of the whole "
                              "experiment are data.zero_shot)")
        both = next((d for d in self.zero_shot if d in self.directions), None)
        if both:
            raise ConfigError(f"{where}: {both} is in both directions (trained) and zero_shot (held out)")


@dataclass
class Budget:
    """The training budget every run gets; training stops at whichever limit is reached first."""

    updates: int | None = None
    epochs: int | None = None
    minutes: float | None = None

    def validate(self, where: str) -> None:
        if self.updates is None and self.epochs is None and self.minutes is None:
            raise ConfigError(f"{where}: set updates, epochs or minutes (the equal budget of every run)")
        for name in ("updates", "epochs", "minutes"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ConfigError(f"{where}.{name}: must be > 0 (or null), got {value}")

    def describe(self) -> str:
        parts = ([f"{self.updates} updates"] if self.updates is not None else []) + \
                ([f"{self.epochs} epochs"] if self.epochs is not None else []) + \
                ([f"{self.minutes:g} minutes"] if self.minutes is not None else [])
        return " or ".join(parts) + " per run" + (" (whichever comes first)" if len(parts) > 1 else "")


@dataclass
class DecodeSettings:
    """Test-set decoding; unset fields keep each run's own ``decode`` section."""

    checkpoint: str | None = None  # best | last | averaged (default: averaged with average_last, else best)
    beam_size: int | None = None
    len_penalty: float | None = None
    max_len_a: float | None = None
    max_len_b: int | None = None
    min_len: int | None = None  # no output ends before this many tokens
    greedy: bool | None = None
    max_tokens: int | None = None  # source tokens per decoding batch
    max_sentences: int | None = None  # decode only the first N sentences of each test set

    def validate(self, where: str) -> None:
        for name in ("beam_size", "max_tokens", "max_sentences"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{where}.{name}: must be >= 1 (or null), got {value}")
        given = {k: v for k, v in self.search_overrides().items() if k in ("len_penalty", "max_len_a", "max_len_b",
                                                                            "min_len")}
        for name, problem in DecodeConfig(**given).search_problems():  # the checks of every run's decode section
            raise ConfigError(f"{where}.{name}: {problem} (or null: each run's own)")

    def search_overrides(self) -> dict[str, Any]:
        keys = ("beam_size", "len_penalty", "max_len_a", "max_len_b", "min_len", "greedy", "max_tokens")
        return {k: getattr(self, k) for k in keys if getattr(self, k) is not None}


@dataclass
class ExperimentConfig:
    """A whole comparison (see the module docstring)."""

    name: str = ""
    description: str = ""
    data: ExperimentData = field(default_factory=ExperimentData)
    overrides: list[str] = field(default_factory=list)  # every run, before its own overrides
    runs: list[RunSpec] = field(default_factory=list)
    budget: Budget = field(default_factory=Budget)
    seeds: list[int] = field(default_factory=lambda: [1])
    average_last: int | None = None  # average the last N periodic checkpoints of each run
    decode: DecodeSettings = field(default_factory=DecodeSettings)
    test_sets: list[str] = field(default_factory=lambda: ["test"])  # split names (keys of data.splits)
    ensemble: bool = False  # also decode each run's seeds as one ensemble (needs two or more seeds)
    bootstrap_samples: int = 1000  # paired bootstrap resampling of each run's BLEU against the first run (0: none)
    bleu_tokenize: str = BLEU_TOKENIZER  # sacreBLEU's BLEU tokenizer for test BLEU and its significance (zh, ja-mecab, ...)
    device: str = "auto"
    threads: int | None = None  # torch CPU threads of each run (training and decoding)
    isolate: bool = True  # train and decode each run in its own process
    parallel: int = 1  # runs trained at once, each in its own process (e.g. several small models on one GPU)
    devices: list[str] = field(default_factory=list)  # parallel runs take these in turn (e.g. [cuda:0, cuda:1])
    # published figures shown beside ours: {run name: {direction: score}}, and what they are (metric, test set)
    paper: dict[str, dict[str, float]] = field(default_factory=dict)
    paper_note: str = ""
    file: str = field(default="", init=False)  # where it was read from (set by load_experiment)

    def validate(self, where: str) -> None:
        if not self.runs:
            raise ConfigError(f"{where}: runs: list at least one run")
        names = [r.name for r in self.runs]
        dup = next((n for n in names if names.count(n) > 1), None)
        if dup:
            raise ConfigError(f"{where}: runs: the name {dup!r} is used twice")
        if not self.seeds or len(set(self.seeds)) != len(self.seeds):
            raise ConfigError(f"{where}: seeds: give one or more distinct seeds, e.g. [1, 2, 3]")
        bad_seed = next((seed for seed in self.seeds if not 0 <= seed < 2**32), None)
        if bad_seed is not None:  # each is a run's train.seed
            raise ConfigError(f"{where}: seeds: {bad_seed} is not a training seed: each must be in [0, 2**32)")
        check_overrides(self.overrides, f"{where}: overrides")
        if self.ensemble and len(self.seeds) < 2:
            raise ConfigError(f"{where}: ensemble: an ensemble of each run's seeds needs two or more seeds, e.g. "
                              "seeds: [1, 2, 3]")
        if self.bootstrap_samples < 0:
            raise ConfigError(f"{where}: bootstrap_samples: must be >= 0 (0: no significance test), got "
                              f"{self.bootstrap_samples}")
        check_bleu_tokenizer(self.bleu_tokenize, f"{where}: bleu_tokenize")
        if self.average_last is not None and self.average_last < 1:
            raise ConfigError(f"{where}: average_last: must be >= 1 (or null for no averaging)")
        choice = self.decode.checkpoint
        if choice not in (None, "best", "last", "averaged"):
            raise ConfigError(f"{where}: decode.checkpoint: {choice!r} (known: best, last, averaged)")
        if choice == "averaged" and self.average_last is None:
            raise ConfigError(f"{where}: decode.checkpoint: 'averaged' needs average_last")
        if not self.test_sets:
            raise ConfigError(f"{where}: test_sets: name at least one split of data.splits")
        dup = next((t for t in self.test_sets if self.test_sets.count(t) > 1), None)
        if dup:
            raise ConfigError(f"{where}: test_sets: {dup!r} is listed twice")
        for key, device in [("device", self.device)] + [(f"devices[{i}]", d) for i, d in enumerate(self.devices)]:
            if not DEVICE.fullmatch(device):
                raise ConfigError(f"{where}: {key}: expected auto, cpu, cuda, cuda:N or mps, got {device!r}")
        if self.threads is not None and self.threads < 1:
            raise ConfigError(f"{where}: threads: must be >= 1 (or null: torch's default), got {self.threads}")
        if self.parallel < 1:
            raise ConfigError(f"{where}: parallel: must be >= 1")
        if self.parallel > 1 and not self.isolate:
            raise ConfigError(f"{where}: parallel: {self.parallel} runs at once need isolate: true")
        for name in self.test_sets:
            if name not in self.data.splits:
                raise ConfigError(f"{where}: test_sets: {name!r} is not a split of data.splits "
                                  f"({', '.join(self.data.splits)})")
        for i, run in enumerate(self.runs):
            for text in [*run.directions, *run.zero_shot]:
                missing = [lang for lang in parse_direction(text, where) if lang not in self.data.langs]
                if missing:
                    raise ConfigError(f"{where}: runs[{i}] ({run.name}): direction {text}: language {missing[0]!r} is "
                                      f"not in data.langs ({', '.join(self.data.langs)}), so it is not prepared")
        groups = {r.group for r in self.runs if r.group}
        clash = next((g for g in groups if g in names), None)
        if clash:
            raise ConfigError(f"{where}: {clash!r} names both a run and a group (--only could not tell them apart)")
        unknown = next((n for n in self.paper if n not in names), None)
        if unknown:
            raise ConfigError(f"{where}: paper: {unknown!r} is not a run of the experiment")

    def run_directions(self, run: RunSpec) -> list[str]:
        """The directions ``run`` trains on (its own, else the experiment's)."""
        return list(run.directions) or list(self.data.directions)

    def select(self, only: list[str]) -> None:
        """Keep only the runs named in ``only`` or belonging to a group named there (``--only``)."""
        groups = {r.group for r in self.runs if r.group}
        unknown = [n for n in only if n not in {r.name for r in self.runs} and n not in groups]
        if unknown:
            raise ConfigError(f"{self.file}: --only: no run or group named {', '.join(map(repr, unknown))} "
                              f"(runs: {', '.join(r.name for r in self.runs)}"
                              + (f"; groups: {', '.join(sorted(groups))}" if groups else "") + ")")
        self.runs = [r for r in self.runs if r.name in only or (r.group and r.group in only)]

    @property
    def checkpoint(self) -> str:
        """The checkpoint decoded: ``best``, ``last`` or ``averaged``."""
        return self.decode.checkpoint or ("averaged" if self.average_last else "best")


def check_overrides(overrides: list[str], where: str) -> None:
    """``KEY=VALUE`` syntax, and none of the keys the experiment sets for every run."""
    for text in overrides:
        try:
            keys, _ = parse_override(text)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        if ".".join(keys) in RESERVED_KEYS:
            raise ConfigError(f"{where}: {text!r}: {'.'.join(keys)} is set by the experiment for every run "
                              "(budget, seeds, data), not per run")


def _default_mapping(raw: dict[str, Any], keys: list[str], cls: type | None = None) -> None:
    """An override into a mapping that the file leaves at its default (``data.splits.test2=...`` where the file
    names no splits) adds to the default mapping instead of replacing it: the default is written into ``raw``."""
    cls = cls or ExperimentConfig
    if not (dataclasses.is_dataclass(cls) and len(keys) > 1):
        return
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if keys[0] not in fields or not isinstance(raw.get(keys[0], {}), dict):
        return
    hint = typing.get_type_hints(cls)[keys[0]]
    f = fields[keys[0]]
    if typing.get_origin(hint) is dict and keys[0] not in raw and f.default_factory is not dataclasses.MISSING:
        raw[keys[0]] = dict(f.default_factory())
        return
    inner = next((a for a in (typing.get_args(hint) or (hint,)) if dataclasses.is_dataclass(a)), None)
    if inner is not None:
        if raw.get(keys[0]) is None:  # as apply_overrides does for a section on the override's path
            raw[keys[0]] = {}
        _default_mapping(raw[keys[0]], keys[1:], inner)


def load_experiment(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read, override (``a.b=c``) and type-check an experiment file; errors name the file and key."""
    path = Path(path)
    origins: dict[tuple[str, ...], str] = {}  # key path → the file or override that set it, for errors
    raw = read_yaml(path, origins=origins, empty_hint="an experiment lists its runs (runs: [{name: ..., config: ...}])")
    for text in overrides or []:
        _default_mapping(raw, parse_override(text)[0])
    raw = apply_overrides(raw, list(overrides or []), origins)
    hints = typing.get_type_hints(ExperimentConfig)
    known = [f.name for f in dataclasses.fields(ExperimentConfig) if f.init]
    unknown = [k for k in raw if k not in known]
    if unknown:
        source = origins.get((str(unknown[0]),), str(path))
        raise ConfigError(f"{source}: unknown key {unknown[0]!r} (known: base, {', '.join(known)})")
    try:
        exp = ExperimentConfig(**{k: coerce(hints[k], v, f"{path}: {k}") for k, v in raw.items()})
        exp.validate(str(path))
    except ConfigError as exc:
        raise ConfigError(name_origin(str(exc), str(path), origins)) from None
    exp.name = exp.name or path.stem
    exp.file = str(path)
    return exp


def resolve_config_path(spec: str, experiment_file: str | Path) -> Path:
    """A run's ``config``: a file relative to the experiment file, or a preset name from configs/."""
    here = Path(experiment_file).parent
    if spec.endswith((".yaml", ".yml")) or "/" in spec:
        path = Path(spec)
        candidates = [path if path.is_absolute() else here / path]
    else:
        candidates = list(dict.fromkeys([here / f"{spec}.yaml", Path("configs") / f"{spec}.yaml",
                                         PRESETS_DIR / f"{spec}.yaml"]))
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ConfigError(f"{experiment_file}: config {spec!r} not found (tried {', '.join(map(str, candidates))})")
