"""Fine-tuning (domain adaptation): a new run that starts from a trained checkpoint's weights.

``train.init_from`` (``nmtflow train CONFIG --init-from CKPT``) is fairseq's ``--restore-file`` with
``--reset-optimizer --reset-dataloader --reset-lr-scheduler``: the run has its own save dir, run id, optimiser,
learning-rate schedule, update counter and data position, and only the model's parameters come from CKPT. Once it
has written ``checkpoint_last.pt`` it resumes from that like any run (CKPT is not read again). Its checkpoints
record where it started: ``init_from`` = {``path``, ``run_id`` (the source run's), ``sha256`` (of CKPT's file),
``update`` (CKPT's update count)}.

What may differ from CKPT is decided here, in :func:`may_change`: everything outside ``model`` (the data and its
batching, every ``train`` setting — optimiser, schedule, label smoothing, budgets — and decoding), and in ``model``
only the keys named in :data:`FINE_TUNABLE_MODEL_KEYS` (regularisation and the weight of auxiliary losses, at any
depth: a language-label model's ``backbone.dropout`` too). Every other model setting defines the architecture
(sizes, layers, heads, attention variants, embedding tying, positions) and must match; the vocabulary must be
CKPT's, i.e. the data prepared with ``nmtflow prepare --tokenizer-from CKPT``.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from nmtflow.checkpoint import file_sha256
from nmtflow.config import (NON_ARCHITECTURE_MODEL_KEYS, Config, ConfigError, differing_settings, not_architecture,
                            to_dict)
from nmtflow.data.tokenizer import Tokenizer, same_model

log = logging.getLogger("nmtflow.train")

#: model settings (the last part of a dotted key, at any depth of ``model``) that fine-tuning may change
FINE_TUNABLE_MODEL_KEYS = NON_ARCHITECTURE_MODEL_KEYS


def may_change(name: str) -> bool:
    """Whether a fine-tuning run may set the dotted config key ``name`` otherwise than its checkpoint's run."""
    return name.partition(".")[0] != "model" or not_architecture(name)


def origin(ckpt: dict[str, Any], path: str | Path) -> dict[str, Any]:
    """What a fine-tuning run records of the checkpoint it starts from (``init_from`` in its checkpoints)."""
    run_id = ckpt.get("run_id")
    update = (ckpt.get("progress") or {}).get("update")
    return {"path": str(path), "run_id": None if run_id is None else str(run_id), "sha256": file_sha256(path),
            "update": None if update is None else int(update)}


def check_resumed_origin(recorded: dict[str, Any] | None, init_from: str | None, path: str | Path) -> None:
    """A one-line :class:`ConfigError` naming the run's checkpoint ``path`` when a resumed fine-tuning run is given
    another ``init_from`` than the one it started from: a path other than the recorded one, to a file with other
    bytes (sha256). The recorded file moved elsewhere, gone, or rewritten in place is fine: a resumed run takes its
    weights from its own checkpoint, and its records keep naming where it started."""
    if not recorded or not init_from or not recorded.get("sha256"):
        return
    if Path(init_from).resolve() == Path(str(recorded.get("path", ""))).resolve() or not Path(init_from).is_file():
        return
    if file_sha256(init_from) != recorded["sha256"]:
        raise ConfigError(f"{path}: this run was fine-tuned from {recorded.get('path')} (sha256 "
                          f"{recorded['sha256'][:12]}…), not from {init_from} (train.init_from, --init-from); resume "
                          "it with its own config.yaml, or fine-tune from the other checkpoint in a save dir of its "
                          "own (or start afresh there with --restart)")


def check_architecture(ckpt: dict[str, Any], path: str | Path, config: Config) -> None:
    """A one-line :class:`ConfigError` naming ``path`` when ``config``'s model is not the one the checkpoint holds:
    another kind (bilingual, multilingual), model type, or architecture setting (the first ones named)."""
    multilingual = config.data.multilingual is not None
    if bool(ckpt.get("multilingual")) != multilingual:
        kinds = ("a bilingual", "a multilingual")
        raise ConfigError(f"{path}: holds {kinds[bool(ckpt.get('multilingual'))]} model but the config trains "
                          f"{kinds[multilingual]} one (data.multilingual); fine-tune it with a config of its kind")
    saved = (ckpt.get("config") or {}).get("model") or {}
    if saved.get("name", config.model.name) != config.model.name:
        raise ConfigError(f"{path}: holds a {saved['name']!r} model but the config says model.name="
                          f"{config.model.name!r}; fine-tuning keeps the checkpoint's model")
    changed = differing_settings({"model": saved}, {"model": to_dict(config.model)}, may_change)
    if changed:
        shown = "; ".join(f"{key}: {old!r} → {new!r}" for key, old, new in changed[:4])
        more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
        raise ConfigError(f"{path}: fine-tuning keeps the checkpoint's architecture, but the config's model differs "
                          f"({shown}{more}); use the model section it was trained with (its config.yaml): only "
                          f"{', '.join(sorted(FINE_TUNABLE_MODEL_KEYS - {'preset'}))} may change")


def check_tokenizers(ckpt: dict[str, Any], path: str | Path, data_path: str, tokenizers: dict[str, Tokenizer]) -> None:
    """A one-line :class:`ConfigError` when the data's tokenizers (by the checkpoint's keys: ``src``/``tgt``, or
    languages) are not the checkpoint's: the token ids would mean other pieces."""
    saved = ckpt.get("tokenizers") or {}

    def same(key: str, tok: Tokenizer) -> bool:
        return same_model(saved[key].cpu().numpy().tobytes(), tok.model_proto)

    if {"src", "tgt"} <= saved.keys() and tokenizers.keys() == {"src", "tgt"} \
            and not same("src", tokenizers["src"]) and same("src", tokenizers["tgt"]) \
            and same("tgt", tokenizers["src"]):
        raise ConfigError(f"{data_path}: its source and target vocabularies are {path}'s swapped: this data runs "
                          "the other way than the checkpoint, whose encoder and decoder each know one language "
                          "(separate vocabularies); fine-tune it in its own direction (data.src_lang, "
                          "data.tgt_lang as trained), or train the reverse direction from scratch")
    for key, tok in tokenizers.items():
        if key not in saved:
            raise ConfigError(f"{path}: has no {key} model; fine-tuning trains the checkpoint's languages (adding one "
                              "is data.multilingual.new_langs with init_checkpoint)")
        if not same(key, tok):
            raise ConfigError(f"{data_path}: prepared with another vocabulary than {path} (its {key} SentencePiece "
                              f"model differs); prepare the data to fine-tune on with nmtflow prepare --tokenizer-from "
                              f"{path}")


def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], path: str | Path) -> None:
    """Copy ``state`` into ``model``: every parameter and buffer, each of the same shape; otherwise a one-line
    :class:`ConfigError` naming the first missing, unexpected or mis-shaped tensors."""
    mine = model.state_dict()
    missing = [name for name in mine if name not in state]
    unexpected = [name for name in state if name not in mine]
    shapes = [f"{name} is {tuple(state[name].shape)} there, {tuple(tensor.shape)} here" for name, tensor in mine.items()
              if name in state and state[name].shape != tensor.shape]
    problems = [f"{what} {', '.join(names[:3])}{f' and {len(names) - 3} more' if len(names) > 3 else ''}"
                for what, names in (("missing", missing), ("unexpected", unexpected), ("shape:", shapes)) if names]
    if problems:
        raise ConfigError(f"{path}: its tensors do not fit this model ({'; '.join(problems)}); fine-tuning needs the "
                          "checkpoint's model (and, for a model of your own, its code as it was)")
    model.load_state_dict(state)


def initialise(model: torch.nn.Module, ckpt: dict[str, Any], path: str | Path, config: Config,
               tokenizers: dict[str, Tokenizer]) -> None:
    """Check the data's ``tokenizers`` against the checkpoint's and load its weights into ``model`` (its
    architecture was checked before the model was built: :func:`check_architecture`)."""
    check_tokenizers(ckpt, path, config.data.path, tokenizers)
    load_weights(model, ckpt["model"], path)
    langs = ckpt.get("langs") or {}
    if "src" in langs and (langs.get("src"), langs.get("tgt")) != (config.data.src_lang, config.data.tgt_lang):
        log.warning("%s: trained %s→%s, fine-tuned %s→%s", path, langs.get("src"), langs.get("tgt"),
                    config.data.src_lang, config.data.tgt_lang)
    log.info("fine-tuning: initialised from %s (update %s)", path, (ckpt.get("progress") or {}).get("update"))
