"""Typed configuration: dataclasses loaded from YAML, unknown keys rejected.

A config file has four sections, each a dataclass below::

    base: transformer-small.yaml   # optional: a file this one overrides (path relative to this file)
    model: {name: transformer, preset: small, encoder_layers: 3}
    data: {path: data/multi30k, src_lang: en, tgt_lang: de}
    train: {max_updates: 20000}
    decode: {beam_size: 5}

``model.name`` picks the model from the registry and with it the dataclass that types the rest of the
``model`` section; attention variants inside a model config are typed the same way by ``type``.
"""
from __future__ import annotations

import contextvars
import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Iterator, Union

import yaml

from nmtflow.registry import MODELS

if typing.TYPE_CHECKING:
    import sacrebleu


class _Loader(yaml.SafeLoader):
    """``yaml.SafeLoader`` with YAML 1.2 scalars and no duplicate keys.

    YAML 1.1 (PyYAML's default) reads ``no``/``on``/``yes`` as booleans (``src_lang: no`` would be False, not
    Norwegian) and ``5e-4`` as a string; here only ``true``/``false`` are booleans and ``5e-4`` is a number. A
    key given twice in one mapping is an error naming its line, not a silent "last one wins".
    """


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                              list("tTfF"))
_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"),
                              list("-+0123456789"))


def _construct_mapping(loader: _Loader, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if isinstance(key, typing.Hashable) and key in seen:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def yaml_load(text: str) -> Any:
    """Parse config YAML (see :class:`_Loader`)."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)


class _Dumper(yaml.SafeDumper):
    """``yaml.SafeDumper`` that also quotes the strings :class:`_Loader` reads as numbers (``1e3``): YAML 1.1 and
    1.2 readers both read the dump back as it was (``no`` stays quoted too)."""


_Dumper.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"),
                              list("-+0123456789"))


def yaml_dump(data: Any) -> str:
    """Config YAML that :func:`yaml_load` reads back as ``data`` (a run's ``config.yaml``)."""
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True)


PRECISIONS = ("fp32", "tf32", "bf16", "fp16")  # train.precision
CUDA_ONLY_PRECISIONS = ("tf32", "fp16")
DECODE_PRECISIONS = ("fp32", "bf16")  # decode.precision
EARLY_STOP_METRICS = ("bleu", "loss")  # train.early_stop_metric
OPTIMIZERS = ("adam", "adamw", "nesterov")  # train.optimizer (nmtflow/train/optim.py)
LR_SCHEDULERS = ("inverse_sqrt", "constant", "reduce_on_rise")  # train.lr_scheduler


class ConfigError(ValueError):
    """A configuration problem; the message names the file and the offending key."""


@dataclass
class ModelConfig:
    """Base of all model configs; ``name`` selects the registered model (and its config class)."""

    name: str = "transformer"
    preset: str | None = None

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}

    @classmethod
    def resolve(cls, data: dict[str, Any], where: str) -> tuple[type, dict[str, Any]]:
        """Pick the registered config class by ``name`` and fill in its ``preset`` values."""
        name = data.get("name", "transformer")
        try:
            config_cls = MODELS.get(name).config_cls
        except KeyError as exc:
            raise ConfigError(f"{where}.name: {exc.args[0]}") from None
        preset = data.get("preset")
        if preset is not None:
            if not isinstance(preset, str) or preset not in config_cls.PRESETS:
                raise ConfigError(f"{where}.preset: unknown preset {preset!r} for {name} "
                                  f"(known: {', '.join(config_cls.PRESETS) or 'none'})")
            data = {**config_cls.PRESETS[preset], **data}
        return config_cls, data


@dataclass
class MultilingualConfig:
    """Multilingual training over a multi-way prepared directory (SPEC §5; nmtflow/train/multilingual.py).

    Directions are written ``SRC-TGT`` (or ``SRC>TGT`` when a language code itself contains '-').
    """

    langs: list[str] = field(default_factory=list)  # languages to train; empty: every prepared language
    pairs: list[str] = field(default_factory=list)  # training directions; empty: all ordered pairs of langs
    zero_shot: list[str] = field(default_factory=list)  # left out of training; validated (and translated) zero-shot
    copy_pairs: bool = False  # add the monolingual copy direction A-A of every language
    schedule: str = "round_robin"  # round_robin | uniform | weighted (random, ∝ sentence pairs per direction)
    max_sentences: dict[str, int] = field(default_factory=dict)  # per direction: use only its first N rows
    init_checkpoint: str | None = None  # adding a language: start from this trained multilingual model ...
    new_langs: list[str] = field(default_factory=list)  # ... and train only these languages' encoders/decoders

    def validate(self, where: str) -> None:
        if self.schedule not in ("round_robin", "uniform", "weighted"):
            raise ConfigError(f"{where}.schedule: unknown schedule {self.schedule!r} "
                              "(known: round_robin, uniform, weighted)")
        if self.new_langs and not self.init_checkpoint:
            raise ConfigError(f"{where}.new_langs: needs init_checkpoint (the model the languages are added to)")
        for direction, rows in self.max_sentences.items():
            if rows < 1:
                raise ConfigError(f"{where}.max_sentences.{direction}: must be >= 1, got {rows}")


@dataclass
class DataConfig:
    """Where the prepared (binarized) data lives and how it is batched."""

    path: str = ""  # directory written by `nmtflow prepare`
    src_lang: str = "en"
    tgt_lang: str = "de"
    train_split: str = "train"
    valid_split: str | None = "valid"  # null: no validation (and no checkpoint_best.pt)
    max_tokens: int = 4096  # padded tokens per batch (source or target, whichever is longer)
    max_sentences: int | None = None
    multilingual: MultilingualConfig | None = None  # many directions at once (src_lang/tgt_lang then unused)

    def validate(self, where: str) -> None:
        for name in ("max_tokens", "max_sentences"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{where}.{name}: must be >= 1, got {getattr(self, name)}")


BLEU_TOKENIZER = "13a"  # sacreBLEU's default BLEU tokenizer, used unless a config names another


def bleu_tokenizers() -> tuple[str, ...]:
    """sacreBLEU's BLEU tokenizers: 13a, intl, zh, ja-mecab, char, ... (imports sacreBLEU)."""
    import sacrebleu

    return tuple(sacrebleu.metrics.BLEU.TOKENIZERS)


def bleu_metric(tokenize: str, lowercase: bool = False) -> sacrebleu.metrics.BLEU:
    """sacreBLEU's BLEU, or a one-line error when its tokenizer cannot be set up here (ja-mecab without its
    package, flores200 without the network)."""
    import sacrebleu

    try:
        return sacrebleu.metrics.BLEU(tokenize=tokenize, lowercase=lowercase)
    except Exception as exc:  # noqa: BLE001 - sacreBLEU raises anything from ImportError to HTTP errors
        raise ValueError(f"BLEU tokenizer {tokenize!r}: sacreBLEU cannot set it up here ({type(exc).__name__}: "
                         f"{' '.join(str(exc).split())})") from None


def check_tokenizer(tokenize: str) -> None:
    """A ValueError now, before anything is translated, for a BLEU tokenizer sacreBLEU lacks or cannot set up."""
    tokenizers = bleu_tokenizers()
    if tokenize not in tokenizers:
        raise ValueError(f"unknown BLEU tokenizer {tokenize!r} (sacreBLEU's: {', '.join(tokenizers)})")
    bleu_metric(tokenize)


def check_bleu_tokenizer(name: str, where: str) -> None:
    """A ConfigError at ``where`` for a BLEU tokenizer sacreBLEU lacks or cannot set up here (sacreBLEU is imported
    only for a tokenizer other than the default)."""
    if name != BLEU_TOKENIZER:
        try:
            check_tokenizer(name)
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None


@dataclass
class TrainConfig:
    """Optimisation, validation, checkpointing and logging."""

    save_dir: str = "runs/default"
    seed: int = 1
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int | None = None  # torch intra-op threads on CPU (None: torch's default)
    max_updates: int = 100_000
    max_epochs: int | None = None
    max_minutes: float | None = None  # budget: wall-clock minutes the process ran (stopped spans left out)
    update_freq: int = 1  # gradient accumulation: batches per update
    optimizer: str = "adam"
    lr: float = 7e-4
    adam_betas: tuple[float, float] = (0.9, 0.98)
    adam_eps: float = 1e-9
    fused_optimizer: bool = True  # adam/adamw: PyTorch's fused kernel where every parameter's device has one
    weight_decay: float = 0.0
    lr_scheduler: str = "inverse_sqrt"  # inverse_sqrt | constant | reduce_on_rise (÷10 when valid loss rises)
    warmup_updates: int = 4000
    warmup_init_lr: float = 1e-7
    clip_norm: float = 1.0  # 0 disables clipping
    label_smoothing: float = 0.1
    validate_every: int = 1000  # updates; validation loss (and BLEU if valid_bleu)
    valid_bleu: bool = True
    valid_bleu_max_sentences: int | None = 500
    valid_bleu_tokenize: str = BLEU_TOKENIZER  # sacreBLEU's BLEU tokenizer for validation BLEU (zh, ja-mecab, char, ...)
    valid_beam_size: int = 1
    save_every: int = 1000  # updates; also writes checkpoint_last.pt
    keep_checkpoints: int = 5  # periodic checkpoints kept on disk (checkpoint_last / _best always)
    patience: int | None = None  # early stopping: validations without improvement
    early_stop_metric: str = "bleu"  # bleu | loss
    log_every: int = 50
    progress: bool = True  # tqdm bar
    precision: str = "fp32"  # fp32 | tf32 (fp32, TF32 matmuls, GPU only) | bf16 (autocast) | fp16 (+ GradScaler, GPU only)
    max_bad_updates: int = 5  # stop after this many consecutive updates with a non-finite loss (each skipped)
    init_from: str | None = None  # fine-tuning: a new run starts from this checkpoint's weights (train/finetune.py)
    compile: bool = False  # torch.compile each Transformer layer and the loss for training (nn/compiled.py)

    def validate(self, where: str) -> None:
        if self.precision not in PRECISIONS:
            raise ConfigError(f"{where}.precision: unknown precision {self.precision!r} "
                              f"(known: {', '.join(PRECISIONS)})")
        if self.max_bad_updates < 1:
            raise ConfigError(f"{where}.max_bad_updates: must be >= 1, got {self.max_bad_updates}")
        for name in ("update_freq", "log_every", "keep_checkpoints", "valid_beam_size", "max_updates"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}.{name}: must be >= 1, got {getattr(self, name)}")
        for name in ("validate_every", "save_every", "warmup_updates"):  # 0: never / no warm-up
            if getattr(self, name) < 0:
                raise ConfigError(f"{where}.{name}: must be >= 0 (0 turns it off), got {getattr(self, name)}")
        for name in ("max_epochs", "patience", "threads", "valid_bleu_max_sentences"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"{where}.{name}: must be >= 1 or null, got {getattr(self, name)}")
        if not 0 <= self.seed < 2**32:  # torch and numpy take no negative seeds
            raise ConfigError(f"{where}.seed: must be in [0, 2**32), got {self.seed}")
        check_bleu_tokenizer(self.valid_bleu_tokenize, f"{where}.valid_bleu_tokenize")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ConfigError(f"{where}.max_minutes: must be > 0 or null, got {self.max_minutes}")
        if self.early_stop_metric not in EARLY_STOP_METRICS:
            raise ConfigError(f"{where}.early_stop_metric: expected one of {', '.join(EARLY_STOP_METRICS)}, "
                              f"got {self.early_stop_metric!r}")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ConfigError(f"{where}.label_smoothing: must be in [0, 1), got {self.label_smoothing}")
        if self.lr <= 0:
            raise ConfigError(f"{where}.lr: must be > 0, got {self.lr}")
        for name in ("lr", "clip_norm", "weight_decay", "adam_eps", "warmup_init_lr"):  # .nan and .inf read as numbers
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ConfigError(f"{where}.{name}: must be a finite number >= 0, got {getattr(self, name)}")
        if not all(0.0 <= beta < 1.0 for beta in self.adam_betas):
            raise ConfigError(f"{where}.adam_betas: each must be in [0, 1), got {list(self.adam_betas)}")
        if self.max_minutes is not None and math.isnan(self.max_minutes):
            raise ConfigError(f"{where}.max_minutes: must be > 0 or null, got {self.max_minutes}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"{where}.optimizer: unknown optimizer {self.optimizer!r} "
                              f"(known: {', '.join(OPTIMIZERS)})")
        if self.lr_scheduler not in LR_SCHEDULERS:
            raise ConfigError(f"{where}.lr_scheduler: unknown schedule {self.lr_scheduler!r} "
                              f"(known: {', '.join(LR_SCHEDULERS)})")
        if not re.fullmatch(r"auto|cpu|cuda(:[0-9]+)?|mps", self.device):
            raise ConfigError(f"{where}.device: expected auto, cpu, cuda or cuda:N, got {self.device!r}")


MAX_LEN_PENALTY = 20.0  # |decode.len_penalty| beyond it: ((5 + |y|) / 6) ** α leaves float range for long outputs


@dataclass
class DecodeConfig:
    """Search settings shared by `translate`, validation BLEU and `quickstart`."""

    beam_size: int = 5
    nbest: int = 1  # hypotheses per input (beam search: at most beam_size); with sampling, samples per input
    len_penalty: float = 0.6  # GNMT alpha: score / ((5 + |y|) / 6) ** alpha
    max_len_a: float = 1.5  # output length limit a * |x| + b
    max_len_b: int = 10
    min_len: int = 0  # no EOS before this many output tokens (the length limit wins)
    max_input_tokens: int = 512  # longer inputs are truncated (with a warning)
    max_tokens: int = 6000  # source tokens per decoding batch
    greedy: bool = False
    sampling: bool = False  # draw outputs at random (e.g. back-translation) instead of searching
    temperature: float = 1.0  # sampling: the model's log-probabilities are divided by it
    top_k: int = 0  # sampling: only from the k most likely tokens (0: all)
    top_p: float = 1.0  # sampling: only from the nucleus of this probability mass (1.0: all)
    seed: int | None = None  # sampling: the same seed draws the same samples (null: a fresh random seed)
    precision: str = "fp32"  # fp32 | bf16 (a bf16 copy of the weights; logits, log-softmax and scores in fp32)
    workers: int = 1  # CPU decoding in N processes, the threads shared out among them (nmtflow.decode.workers)

    SAMPLING_ONLY: ClassVar[dict[str, Any]] = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": None}

    def search_problems(self) -> Iterator[tuple[str, str]]:
        """(key, what is wrong) for each out-of-range length limit or sampling setting, for messages in the config's
        terms (:meth:`validate`) or the command line's (``nmtflow.decode.translate.check_search``)."""
        if not math.isfinite(self.len_penalty):
            yield "len_penalty", f"must be a finite number, got {self.len_penalty}"
        elif abs(self.len_penalty) > MAX_LEN_PENALTY:  # ((5 + |y|) / 6) ** α overflows (or reaches 0) past it
            yield "len_penalty", (f"must be between -{MAX_LEN_PENALTY:g} and {MAX_LEN_PENALTY:g} (GNMT's α; 0: "
                                  f"none, usually 0.6-2), got {self.len_penalty}")
        if not (math.isfinite(self.max_len_a) and self.max_len_a >= 0):
            yield "max_len_a", f"must be >= 0 (and finite), got {self.max_len_a}"
        for name in ("max_len_b", "min_len"):
            if getattr(self, name) < 0:
                yield name, f"must be >= 0, got {getattr(self, name)}"
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            yield "temperature", f"must be a number > 0, got {self.temperature}"
        if self.top_k < 0:
            yield "top_k", f"must be >= 0 (0: no top-k filtering), got {self.top_k}"
        if not 0 <= self.top_p <= 1:
            yield "top_p", f"must be between 0 and 1 (1.0: no nucleus filtering), got {self.top_p}"
        if self.seed is not None and self.seed < 0:
            yield "seed", f"must be >= 0 (or null: a fresh random seed), got {self.seed}"
        if self.sampling and self.greedy:
            yield "sampling", ("draws tokens at random, greedy search takes the most likely one: set only one "
                               "of sampling and greedy")
        if self.sampling and self.workers > 1:
            yield "workers", (f"{self.workers} worker processes do not sample (which worker draws which batch would "
                              "change the samples): use workers: 1 with sampling")

    def validate(self, where: str) -> None:
        if self.precision not in DECODE_PRECISIONS:
            raise ConfigError(f"{where}.precision: unknown precision {self.precision!r} "
                              f"(known: {', '.join(DECODE_PRECISIONS)})")
        for name in ("beam_size", "nbest", "max_input_tokens", "max_tokens", "workers"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{where}.{name}: must be >= 1, got {getattr(self, name)}")
        for name, problem in self.search_problems():
            raise ConfigError(f"{where}.{name}: {problem}")
        if not self.sampling:
            for name, default in self.SAMPLING_ONLY.items():
                if getattr(self, name) != default:
                    raise ConfigError(f"{where}.{name}: {getattr(self, name)} applies to sampling only (set "
                                      f"sampling: true, or leave {name} at {default})")
            if self.nbest > self.beam_size:
                raise ConfigError(f"{where}.nbest: {self.nbest} is more than beam_size {self.beam_size} (beam search "
                                  "keeps at most beam_size hypotheses)")
            if self.nbest > 1 and self.greedy:
                raise ConfigError(f"{where}.nbest: {self.nbest} with greedy: true (greedy search finds one "
                                  "translation; an n-best list needs beam search, or samples need sampling: true)")


@dataclass
class Config:
    """A whole experiment: the model section is typed by the registered model's config class."""

    model: Any = None
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)


# --------------------------------------------------------------------------------------------------
# strict dict → dataclass conversion


def _origin_is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (Union, types.UnionType)


def coerce(tp: Any, value: Any, where: str) -> Any:
    """Convert a YAML value to type ``tp`` (dataclasses, Optional, lists, tuples, dicts, scalars)."""
    if tp is Any:
        return value
    if _origin_is_union(tp):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return coerce(arg, value, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: invalid value {value!r}")
    if dataclasses.is_dataclass(tp):
        if dataclasses.is_dataclass(value) and isinstance(value, tp):
            return value
        return from_dict(tp, value, where)
    origin = typing.get_origin(tp)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(args) != len(value):
                raise ConfigError(f"{where}: expected {len(args)} values, got {len(value)}")
            return tuple(coerce(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
        item = args[0] if args else Any
        items = [coerce(item, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        _, val_tp = typing.get_args(tp) or (Any, Any)
        return {k: coerce(val_tp, v, f"{where}.{k}") for k, v in value.items()}
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true/false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    return value


# (top-level ``where``, key path → file or override) while load_config types a config
_ORIGINS: contextvars.ContextVar[tuple[str, dict[tuple[str, ...], str]] | None] = \
    contextvars.ContextVar("nmtflow_config_origins", default=None)


def _where_set(where: str, key: str) -> str:
    """``where`` (``FILE: section.sub``), naming the base file or override that set ``key`` if not FILE itself."""
    context = _ORIGINS.get()
    if context is None or not where.startswith(context[0] + ": "):
        return where
    section = where[len(context[0]) + 2:]
    source = context[1].get(tuple(section.split(".")) + (str(key),))
    return f"{source}: {section}" if source and source != context[0] else where


def from_dict(cls: type, data: Any, where: str = "config") -> Any:
    """Build dataclass ``cls`` from a mapping; unknown keys and wrong types raise ConfigError.

    A dataclass may define ``resolve(cls, data) -> type`` (a classmethod) to pick a more specific
    class from the data itself (used for registry-typed sections such as ``model`` and attention).
    """
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {data!r}")
    resolver = getattr(cls, "resolve", None)
    if resolver is not None:
        cls, data = resolver(data, where)
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in known]
    if unknown:
        raise ConfigError(f"{_where_set(where, unknown[0])}: unknown key {unknown[0]!r} "
                          f"(known: {', '.join(sorted(known))})")
    kwargs = {k: coerce(hints[k], v, f"{where}.{k}") for k, v in data.items()}
    obj = cls(**kwargs)
    post = getattr(obj, "validate", None)
    if post is not None:
        post(where)
    return obj


def to_dict(obj: Any) -> Any:
    """Dataclass → plain YAML/JSON-able structure (tuples become lists)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


# Model settings that are not the architecture (regularisation, the weight of auxiliary losses; at any depth: a
# language-label model's backbone.dropout too): a fine-tuning run may change them (nmtflow.train.finetune), and
# checkpoints that differ only in them hold the same model (nmtflow.checkpoint.average_checkpoints)
NON_ARCHITECTURE_MODEL_KEYS = frozenset({
    "preset",  # only a name: the values it stands for are compared
    "dropout", "attention_dropout", "activation_dropout",
    "penalty", "penalty_scale", "penalty_batch",  # the attention bridge's penalty (a loss term, not a weight)
})


def not_architecture(name: str) -> bool:
    """Whether the dotted key ``name`` (``model.dropout``, ``model.backbone.dropout``) is a model setting of
    :data:`NON_ARCHITECTURE_MODEL_KEYS`."""
    return name != "model" and name.rpartition(".")[2] in NON_ARCHITECTURE_MODEL_KEYS


def architecture_changes(saved: dict[str, Any] | None, current: dict[str, Any] | None) -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, current value) of the model settings that differ between two ``model`` config
    dicts, leaving out :data:`NON_ARCHITECTURE_MODEL_KEYS`; empty when they define the same architecture."""
    return differing_settings({"model": saved}, {"model": current}, not_architecture)


def differing_settings(saved: dict[str, Any], current: dict[str, Any], may_change: typing.Callable[[str], bool],
                       prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, current value) of the settings of two config dicts that differ, sorted, leaving out
    the keys (and whole sections) for which ``may_change(dotted key)`` holds.

    Keys missing on either side (settings added to nmtflow since ``saved`` was written) are not compared; a list
    equals a tuple of the same items.
    """
    changed = []
    for key in saved.keys() & current.keys():
        name, old, new = f"{prefix}{key}", saved[key], current[key]
        if may_change(name):
            continue
        if isinstance(old, dict) and isinstance(new, dict):
            changed += differing_settings(old, new, may_change, name + ".")
        elif old != new and not (isinstance(old, (list, tuple)) and list(old) == list(new or [])):
            changed.append((name, old, new))
    return sorted(changed)


# --------------------------------------------------------------------------------------------------
# files, inheritance and overrides


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in override.items():
        if value is None and isinstance(out.get(key), dict):
            continue  # an empty section (`train:` with every entry commented out) changes nothing
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            if key == "model" and value.get("name", out[key].get("name")) != out[key].get("name"):
                out[key] = dict(value)  # another model: nothing of the base's model section applies
            else:
                out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _record_origins(data: dict[str, Any], source: str, origins: dict[tuple[str, ...], str],
                    prefix: tuple[str, ...] = ()) -> None:
    """Note ``source`` as where every key path of ``data`` was last set (for errors that name the right file)."""
    for key, value in data.items():
        origins[prefix + (str(key),)] = source
        if isinstance(value, dict):
            _record_origins(value, source, origins, prefix + (str(key),))


PRESETS_DIR = Path(__file__).resolve().parents[1] / "configs"  # the shipped presets (a source checkout's configs/)
CONFIG_IN_DIR = "config.yaml"  # what a training run writes into its save dir (the config it ran)


def preset_path(name: str) -> Path | None:
    """The shipped preset ``configs/NAME.yaml`` for a bare ``name`` (``transformer-small``), if there is one."""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        return None
    path = PRESETS_DIR / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
    return path if path.is_file() else None


EMPTY_CONFIG_HINT = "give at least its model and data (e.g. 'base: transformer-small' and data.path), or '{}' for " \
    "every default"


def read_yaml(path: str | Path, _seen: tuple[Path, ...] = (),
              origins: dict[tuple[str, ...], str] | None = None, empty_hint: str = EMPTY_CONFIG_HINT) -> dict[str, Any]:
    """Read a config file, following ``base:`` chains (relative to the including file). A path that is no file
    but a bare preset name (``transformer-small``) reads the shipped preset ``configs/NAME.yaml``.

    ``origins``, if given, receives the file each key path comes from (a child's keys replace its base's); a file of
    nothing but blanks and comments is an error, with ``empty_hint`` on what it should hold.
    """
    path = Path(path)
    if not path.is_file():
        preset = preset_path(str(path))
        if preset is None:
            if path.is_dir():  # e.g. a save dir: its config is SAVE_DIR/config.yaml
                raise ConfigError(f"{path}: a directory, not a config file"
                                  + (f" (its {CONFIG_IN_DIR} is one)" if (path / CONFIG_IN_DIR).is_file() else ""))
            hint = f" (nor a preset of {PRESETS_DIR.name}/, e.g. transformer-small)" if PRESETS_DIR.is_dir() else ""
            raise ConfigError(f"{path}: config file not found{hint}")
        path = preset
    if path.resolve() in _seen:
        raise ConfigError(f"{path}: circular 'base:' chain")
    try:
        data = yaml_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f":{mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}{line}: invalid YAML ({getattr(exc, 'problem', exc)})") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if data is None:  # nothing but blanks and comments: not a config of nmtflow's defaults (a 44M Transformer)
        raise ConfigError(f"{path}: an empty file; {empty_hint}")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    base = data.pop("base", None)
    if base is not None and not (isinstance(base, str) and base.strip()):
        raise ConfigError(f"{path}: base: expected the path of another config file, got {base!r}")
    own = data  # this file's keys (merging builds new dicts: own stays as read)
    if base is not None:
        base_path = Path(base)
        if not base_path.is_absolute():
            base_path = path.parent / base_path
        if not base_path.is_file() and (preset := preset_path(base)) is not None:  # base: transformer-small
            base_path = preset
        if not base_path.is_file():
            what = "a directory, not a config file" if base_path.is_dir() else "config file not found"
            hint = f" (nor a preset of {PRESETS_DIR.name}/)" if PRESETS_DIR.is_dir() and not base_path.is_dir() else ""
            relative = "" if Path(base).is_absolute() else \
                f"; a relative base is read from the directory of {path.name} ({base_path})"
            raise ConfigError(f"{path}: base: {base}: {what}{hint}{relative}")
        data = _deep_merge(read_yaml(base_path, _seen + (path.resolve(),), origins, empty_hint), own)
    if origins is not None:  # after the base's: this file's keys override its origins
        _record_origins(own, str(path), origins)
    return data


SECTIONS = ("model", "data", "train", "decode")  # a config's top-level keys


def parse_override(text: str) -> tuple[list[str], Any]:
    """``train.max_updates=100`` → (["train", "max_updates"], 100) with YAML typing of the value."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. train.max_updates=100")
    key, value = text.split("=", 1)
    try:
        return key.strip().split("."), yaml_load(value)
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {text!r}: invalid YAML value ({getattr(exc, 'problem', None) or exc})") from None


def apply_overrides(data: dict[str, Any], overrides: list[str],
                    origins: dict[tuple[str, ...], str] | None = None) -> dict[str, Any]:
    data = dict(data)
    for text in overrides:
        keys, value = parse_override(text)
        if len(keys) == 1 and value is None and keys[0] in SECTIONS:  # `model=null`: the default Transformer
            raise ConfigError(f"override {text!r}: {keys[0]!r} is a section, not a value; set its keys "
                              f"({keys[0]}.KEY=VALUE)")
        if origins is not None:
            _record_origins({keys[-1]: value}, f"override {text!r}", origins, tuple(keys[:-1]))
        node = data
        for k in keys[:-1]:
            if node.get(k) is None:  # absent, or an empty section
                node[k] = {}
            node = node[k]
            if not isinstance(node, dict):
                raise ConfigError(f"override {text!r}: {k!r} is not a section")
        node[keys[-1]] = value
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                data: dict[str, Any] | None = None) -> Config:
    """Load a YAML config (or a dict), apply ``a.b=c`` overrides, and type-check it all."""
    origins: dict[tuple[str, ...], str] = {}
    raw = read_yaml(path, origins=origins) if path is not None else dict(data or {})
    raw = apply_overrides(raw, overrides or [], origins)
    where = str(path) if path is not None else "config"
    raw.setdefault("model", {"name": "transformer"})
    hints = dict(zip(SECTIONS, (ModelConfig, DataConfig, TrainConfig, DecodeConfig)))
    unknown = [k for k in raw if k not in hints]
    if unknown:
        source = origins.get((str(unknown[0]),), where)
        if unknown[0] == "base":  # read_yaml takes a file's own; this one is an override's
            raise ConfigError(f"{source}: 'base' can only be given in a config file")
        raise ConfigError(f"{source}: unknown key {unknown[0]!r} (known: base, {', '.join(hints)})")
    token = _ORIGINS.set((where, origins))
    try:
        return Config(**{k: from_dict(tp, raw.get(k), f"{where}: {k}") for k, tp in hints.items()})
    except ConfigError as exc:
        raise ConfigError(name_origin(str(exc), where, origins)) from None
    finally:
        _ORIGINS.reset(token)


def name_origin(message: str, where: str, origins: dict[tuple[str, ...], str]) -> str:
    """``message`` (``WHERE: a.b.c: problem``) naming the base file or override that set ``a.b.c`` instead of WHERE."""
    if not message.startswith(where + ": "):
        return message  # already names its origin (an unknown key) or no key
    rest = message[len(where) + 2:]
    keys = tuple(re.sub(r"\[\d+\]", "", re.split(r"[:\s]", rest, maxsplit=1)[0]).split("."))  # a.b[0]: → (a, b)
    for n in range(len(keys), 0, -1):
        source = origins.get(keys[:n])
        if source is not None:
            return message if source == where else f"{source}: {rest}"
    return message


def config_from_dict(data: dict[str, Any]) -> Config:
    """Rebuild a Config saved inside a checkpoint."""
    return load_config(data=data)
