"""The training loop: token batches, accumulation, validation (loss + BLEU), checkpoints, exact resume.

Exact resume: a checkpoint holds the model, optimiser, scheduler, torch RNG state and the data position
(epoch, index of the next batch in that epoch's deterministic batch order), so an interrupted run that
resumes reproduces the uninterrupted run's losses bit for bit on CPU. With DDP every rank's generators are
gathered into rank 0's checkpoint and each rank restores its own; the checkpoint records the number of
processes, and resuming with another number is an error (the data shards would differ).
"""
from __future__ import annotations

import gc
import json
import logging
import math
import shutil
import signal
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from nmtflow.checkpoint import (CheckpointError, FORMAT, integrity_code, load_checkpoint, lock_save_dir, new_run_id,
                                periodic_checkpoints, remove_interrupted_saves, save_atomic, unlock_save_dir,
                                write_atomic, write_failure, write_text_atomic)
from nmtflow.config import CUDA_ONLY_PRECISIONS, Config, ConfigError, differing_settings, to_dict, yaml_dump
from nmtflow.data.batching import Batch, TokenBatchSampler
from nmtflow.data.bitext import check_sentence_lengths, open_bitext, tokenizer_path
from nmtflow.data.prepare import load_meta
from nmtflow.data.tokenizer import Tokenizer, same_model
from nmtflow.decode.translate import Translator, bytes_tensor
from nmtflow.evaluate.metrics import bleu
from nmtflow.models.base import EncoderDecoder, Vocabularies, build_model, count_parameters, position_limits
from nmtflow.nn.compiled import compile_regions, compiler_missing
from nmtflow.runtime import (RunningClock, autocast, keep_freed_memory, release_freed_memory, use_precision,
                             warn_if_bf16_emulated)
from nmtflow.train import distributed, finetune
from nmtflow.train.loss import label_smoothed_nll
from nmtflow.train.optim import build_optimizer, build_scheduler

log = logging.getLogger("nmtflow.train")


def check_valid_split(data_dir: str | Path, split: str | None, meta: dict[str, Any]) -> None:
    """A :class:`ConfigError` where ``data.valid_split`` names a split ``data_dir`` does not hold, with the two ways
    out (``train.validate_every: 0`` still validates at the end of the run, so it does not need one less)."""
    if split and split not in meta["splits"]:
        raise ConfigError(f"data.valid_split: {split!r} is not prepared in {data_dir} (splits: "
                          f"{', '.join(meta['splits'])}); prepare it (nmtflow prepare --valid PREFIX), or set "
                          "data.valid_split: null to train without validating")


def resolve_device(name: str) -> torch.device:
    """``auto`` → cuda if there is one, else cpu; a device this machine lacks is a one-line ValueError."""
    return distributed.check_device(name)


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint."""

    update: int = 0
    epoch: int = 1
    position: int = 0  # index of the next batch in this epoch's batch list
    best: float | None = None  # best metric of the scheduled validations (early stopping compares with it)
    best_seen: float | None = None  # best metric of any validation, a budget's final one included (checkpoint_best)
    bad_validations: int = 0
    elapsed: float = 0.0  # training seconds, summed over resumed runs
    stopped: str = ""  # why training ended, once it has
    bad_updates: int = 0  # consecutive updates skipped for a non-finite loss
    validated_at: int | None = None  # the update of the last validation


@dataclass
class TrainResult:
    progress: Progress
    save_dir: Path
    history: list[dict[str, Any]] = field(default_factory=list)


class Trainer:
    """Trains ``config.model`` on ``config.data`` according to ``config.train``.

    Everything written goes to ``train.save_dir``: ``checkpoint_last.pt``, ``checkpoint_best.pt``,
    ``checkpoint_UPDATE.pt``, ``log.jsonl`` (one JSON line per logged event), ``config.yaml`` and
    TensorBoard scalars under ``tensorboard/``.
    """

    # DDP: every parameter takes part in every step (no extra autograd-graph traversal per update)
    find_unused_parameters: bool = False

    def __init__(self, config: Config, *, resume: bool = True) -> None:
        self.config = config
        tc = config.train
        self.check_model_fits_trainer()
        if tc.patience is not None and not tc.validate_every:  # here, not in TrainConfig: old checkpoints still load
            raise ConfigError("train.patience: early stopping counts scheduled validations, but train.validate_every "
                              "is 0 (never); set validate_every, or patience: null")
        keep_freed_memory()
        if tc.threads:
            torch.set_num_threads(tc.threads)
        self.dist = distributed.env_info()
        try:
            self.device = distributed.device_for(tc.device, self.dist)
        except ValueError as exc:
            raise ConfigError(f"train.{exc}") from None
        self.dist = distributed.setup(self.device)  # DDP when launched by torchrun with WORLD_SIZE > 1
        if tc.precision in CUDA_ONLY_PRECISIONS and self.device.type != "cuda":
            raise ConfigError(f"train.precision: {tc.precision} needs a CUDA device (this run is on {self.device}); "
                              "use fp32 or bf16 on CPU")
        if tc.precision == "bf16":
            warn_if_bf16_emulated("train.precision", "trains", self.device)
        use_precision(tc.precision)
        self.save_dir = Path(tc.save_dir)
        if self.save_dir.exists() and not self.save_dir.is_dir():
            raise ConfigError(f"{self.save_dir}: the save dir (train.save_dir, --save-dir) is a file, not a directory")
        self.save_dir.mkdir(parents=True, exist_ok=True)
        if self.dist.is_main:  # one training per save dir; released at the end of train() or at exit
            lock_save_dir(self.save_dir)
            remove_interrupted_saves(self.save_dir)
        torch.manual_seed(tc.seed)
        last = self.save_dir / "checkpoint_last.pt"
        if resume and self.dist.is_main and not last.is_file():
            self.complete_first_save()
        if resume and self.dist.enabled:  # every rank sees what rank 0 completed
            distributed.barrier()
        self.resume_from: Path | None = last if resume and last.is_file() else None  # set before the seams run
        # fine-tuning (train/finetune.py): a new run loads the weights of train.init_from; a resumed one its own
        self.init_source: dict[str, Any] | None = None  # that checkpoint, until its weights are in the model
        self.init_from: dict[str, Any] | None = None  # where the run started, recorded in its checkpoints
        if tc.init_from and self.resume_from is None:
            self.init_source = load_checkpoint(tc.init_from)
            finetune.check_architecture(self.init_source, tc.init_from, config)
            self.init_from = finetune.origin(self.init_source, tc.init_from)

        self.setup_data()
        self.model: EncoderDecoder = self.create_model().to(self.device)
        if tc.compile:
            self.compile_model()
        if self.init_source is not None:
            finetune.initialise(self.model, self.init_source, tc.init_from, config, self.tokenizer_models())
            self.init_source = None
        self.check_lengths()
        if self.dist.rank > 0:  # each rank draws its own dropout masks; rank 0 keeps the single-process stream
            torch.manual_seed(tc.seed + self.dist.rank)
        self.optimizer = build_optimizer([p for p in self.model.parameters() if p.requires_grad], tc)
        self.scheduler = build_scheduler(self.optimizer, tc)
        self.scaler = torch.amp.GradScaler("cuda") if tc.precision == "fp16" else None
        self.progress = Progress()
        self.writer = None
        self._purge_step: int | None = None  # set on resume: TensorBoard drops later events
        self.run_id = new_run_id()  # in every checkpoint of the run: `nmtflow average` keeps runs apart
        if self.resume_from is not None:
            try:
                ckpt = load_checkpoint(last, self.device)
            except CheckpointError as exc:  # truncated or corrupted: say which intact checkpoint could take its place
                raise CheckpointError(f"{exc}{self.resume_instead_hint()}") from None
            self.run_id = str(ckpt.get("run_id") or self.run_id)  # a checkpoint of an older version has none
            missing = [key for key in ("optimizer", "scheduler", "rng", "progress") if key not in ckpt]
            if missing:  # e.g. `nmtflow average ... -o SAVE_DIR/checkpoint_last.pt`
                raise ConfigError(f"{last}: holds a model but no training state ({', '.join(missing)}), like an "
                                  "averaged checkpoint; training resumes only from the checkpoint_last.pt it wrote: "
                                  "start afresh with --restart or another --save-dir")
            self.check_resumable(ckpt, last)
            self.init_from = ckpt.get("init_from")
            try:
                self.load_state(ckpt)
            except (RuntimeError, KeyError, ValueError) as exc:  # a model or optimiser of another shape
                lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()] or [type(exc).__name__]
                detail = lines[1 if len(lines) > 1 else 0][:200]  # e.g. "size mismatch for ...: copying a param"
                raise ConfigError(f"{last}: cannot resume with this config ({detail}); "
                                  "use the run's own config.yaml, or start afresh with --restart or another "
                                  "--save-dir") from None
            log.info("resumed from %s at update %d (epoch %d, batch %d)", last, self.progress.update,
                     self.progress.epoch, self.progress.position)
        elif resume and (earlier := self.earlier_checkpoints()):  # e.g. killed between the first save's files
            names = ", ".join(path.name for path in earlier)
            raise ConfigError(f"{self.save_dir}: holds checkpoints of an earlier run ({names}) but no "
                              "checkpoint_last.pt to resume from; start afresh with --restart (removes them) or use "
                              f"another --save-dir{self.resume_instead_hint()}")
        elif self.dist.is_main:
            self.clear_previous_run()
        # DDP all-reduces gradients during backward (hooks); it starts from rank 0's parameters
        self.ddp = None if not self.dist.enabled else DistributedDataParallel(
            _StepModule(self.model), device_ids=[self.device.index] if self.device.type == "cuda" else None,
            find_unused_parameters=self.find_unused_parameters)
        if self.dist.is_main:
            write_text_atomic(self.save_dir / "config.yaml", yaml_dump(to_dict(config)), "the run's config")

    def check_model_fits_trainer(self) -> None:
        """A :class:`ConfigError` for a config this trainer cannot train as written: ``data.multilingual`` (many
        directions: :class:`~nmtflow.train.multilingual.MultilingualTrainer`), or the language-label model, which
        trained on one direction would be its backbone, no tag in any source."""
        from nmtflow.registry import MODELS

        name = self.config.model.name
        if self.config.data.multilingual is not None:  # MultilingualTrainer overrides this check
            raise ConfigError("data.multilingual: set, but this trainer trains one direction (data.src_lang → "
                              "data.tgt_lang) and would ignore it; train with "
                              "nmtflow.train.multilingual.MultilingualTrainer, or nmtflow.train.multilingual."
                              "trainer_for(config), which picks the trainer as nmtflow train does")
        if getattr(MODELS.get(name).cls, "uses_language_tags", False):
            raise ConfigError(f"model.name: {name!r} is a multilingual model: every source starts with its target "
                              "language's tag, so it trains on the directions of data.multilingual (a prepared "
                              "directory with --lang-tags); for one direction without tags, train its backbone")

    def clear_previous_run(self) -> None:
        """A fresh start (``--restart``, or a save dir without checkpoints): remove the earlier run's checkpoints,
        log and TensorBoard events, which would otherwise mix with this run's (checkpoint rotation,
        ``nmtflow average --last``, the curves)."""
        last = self.save_dir / "checkpoint_last.pt"
        old = ([last] if last.is_file() else []) + self.earlier_checkpoints()  # last first: a clearing cut short
        for path in old:  # leaves nothing that a plain rerun would resume from
            path.unlink()
        if old:
            log.warning("fresh start in %s: removed the earlier run's %s", self.save_dir,
                        ", ".join(path.name for path in old))
        (self.save_dir / "log.jsonl").unlink(missing_ok=True)
        shutil.rmtree(self.save_dir / "tensorboard", ignore_errors=True)

    def resume_instead_hint(self) -> str:
        """``"; the save dir's checkpoint_N.pt is intact ... copy it to checkpoint_last.pt"`` for the newest readable
        checkpoint of the save dir (periodic or best) that holds the whole training state, or "" when none does.

        Training saves one dict to all of them, so resuming from such a copy replays the run exactly from update N
        (the log and TensorBoard events after N are dropped); it is the user's choice, never made silently.
        """
        found = [(int(ckpt["progress"].get("update", 0)), path) for path, ckpt in self.training_states().items()
                 if ckpt is not None]
        if not found:
            return ""
        update, path = max(found, key=lambda item: item[0])
        return (f"; the save dir's {path.name} is intact and holds the training state at update {update}: to resume "
                "from there, copy it to checkpoint_last.pt")

    def complete_first_save(self) -> None:
        """Finish a first save cut short (``kill -9``) after its ``checkpoint_best.pt`` or ``checkpoint_N.pt`` but
        before ``checkpoint_last.pt``: the save dir's checkpoints are then intact copies of one training state (one
        run, one update) saved by this config, and checkpoint_last.pt becomes one more copy, so a plain rerun
        resumes exactly. Anything else (checkpoints of several updates or runs, other settings, a damaged file)
        is left for the error that asks the user."""
        states = self.training_states()
        if not states or None in states.values():
            return
        first, ckpt = next(iter(states.items()))
        same = {(c.get("run_id"), c["progress"].get("update")) for c in states.values()}
        if len(same) != 1 or ckpt.get("run_id") is None or changed_settings(ckpt.get("config") or {},
                                                                            to_dict(self.config)):
            return
        data = first.read_bytes()
        write_atomic(self.save_dir / "checkpoint_last.pt", lambda handle: handle.write(data), "the checkpoint")
        log.warning("%s: the first save, at update %d, was cut short before checkpoint_last.pt; completed it from "
                    "%s, which holds the same training state", self.save_dir, ckpt["progress"].get("update"),
                    first.name)

    def training_states(self) -> dict[Path, dict[str, Any] | None]:
        """Each of :meth:`earlier_checkpoints` with its contents when it is intact and holds the whole training
        state (model, optimiser, schedule, RNG, progress), else None."""
        states: dict[Path, dict[str, Any] | None] = {}
        for path in self.earlier_checkpoints():
            try:
                ckpt: dict[str, Any] | None = load_checkpoint(path)
            except CheckpointError:
                ckpt = None
            if ckpt is not None and not (all(key in ckpt for key in ("optimizer", "scheduler", "rng"))
                                         and isinstance(ckpt.get("progress"), dict)):
                ckpt = None
            states[path] = ckpt
        return states

    def earlier_checkpoints(self) -> list[Path]:
        """The save dir's periodic checkpoints and checkpoint_best.pt (checkpoint_last.pt aside)."""
        best = self.save_dir / "checkpoint_best.pt"
        return periodic_checkpoints(self.save_dir) + ([best] if best.is_file() else [])

    # ---- set-up (seams for subclasses, e.g. nmtflow.train.multilingual.MultilingualTrainer) ---------
    def setup_data(self) -> None:
        """Tokenizers, vocabularies, training/validation data and the batch sampler (one direction here)."""
        tc, dc = self.config.train, self.config.data
        meta = load_meta(dc.path)
        self.src_tok = Tokenizer(tokenizer_path(dc.path, meta, dc.src_lang))
        self.tgt_tok = Tokenizer(tokenizer_path(dc.path, meta, dc.tgt_lang))
        self.vocabs = Vocabularies(self.src_tok.vocab_size, self.tgt_tok.vocab_size,
                                   joint=self.src_tok.path == self.tgt_tok.path)
        self.train_data = open_bitext(dc.path, dc.train_split, dc.src_lang, dc.tgt_lang)
        check_valid_split(dc.path, dc.valid_split, meta)
        self.valid_data = open_bitext(dc.path, dc.valid_split, dc.src_lang, dc.tgt_lang) if dc.valid_split else None
        self.sampler = TokenBatchSampler(self.train_data.src.sizes, self.train_data.tgt.sizes, dc.max_tokens,
                                         shuffle=True, seed=tc.seed, max_sentences=dc.max_sentences,
                                         num_shards=self.dist.world_size, shard_id=self.dist.rank)

    def check_lengths(self) -> None:
        """Stop before training if a sentence is longer than the model's positions (its line named), not at it."""
        dc = self.config.data
        prefix = int(self.train_data.src_prefix is not None)
        src_limit, tgt_limit = position_limits(self.model.config)
        splits = [(dc.train_split, self.train_data)] + ([(dc.valid_split, self.valid_data)] if self.valid_data else [])
        for split, bitext in splits:
            for lang, data, extra, limit in ((dc.src_lang, bitext.src, 1 + prefix, src_limit),
                                             (dc.tgt_lang, bitext.tgt, 1, tgt_limit)):
                check_sentence_lengths(dc.path, split, lang, data.sizes, extra, limit,
                                       cleaned=split == dc.train_split)

    def create_model(self) -> EncoderDecoder:
        """The model to train; its trainable parameters (``requires_grad``) go to the optimiser."""
        return build_model(self.config.model, self.vocabs)

    def compile_model(self) -> None:
        """``train.compile``: the model's repeated layers and the loss run through ``torch.compile`` in training."""
        if (why := compiler_missing(self.device)) is not None:
            raise ConfigError(f"train.compile: {why}; set train.compile: false")
        regions = compile_regions(self.model)
        if regions:
            log.info("train.compile: compiling %s and the loss (the first batches of each new shape class take "
                     "longer)", ", ".join(regions))
        else:
            log.warning("train.compile: %s has no compiled layers; only the loss is compiled",
                        type(self.model).__name__)

    def model_for(self, batch: Batch) -> EncoderDecoder:
        """The model that runs ``batch`` (the multilingual trainer picks the batch's direction)."""
        return self.model

    def tokenizer_models(self) -> dict[str, Tokenizer]:
        """The run's tokenizers under the keys of a checkpoint's ``tokenizers`` (``src``, ``tgt``)."""
        return {"src": self.src_tok, "tgt": self.tgt_tok}

    # ---- state ------------------------------------------------------------------------------------
    def checkpoint(self, with_training_state: bool = True) -> dict[str, Any]:
        ckpt: dict[str, Any] = {
            "format": FORMAT,
            "config": to_dict(self.config),
            "model": self.model.state_dict(),
            "vocab": {"src_size": self.vocabs.src_size, "tgt_size": self.vocabs.tgt_size, "joint": self.vocabs.joint},
            "langs": {"src": self.config.data.src_lang, "tgt": self.config.data.tgt_lang},
            # the models as loaded when the run started, not the files now (a data dir prepared again meanwhile)
            "tokenizers": {side: bytes_tensor(tok.model_proto) for side, tok in self.tokenizer_models().items()},
            "progress": vars(self.progress).copy(),
            "world_size": self.dist.world_size,  # the data shards depend on it: resuming needs the same number
            "run_id": self.run_id,
        }
        if self.init_from is not None:
            ckpt["init_from"] = dict(self.init_from)
        if with_training_state:
            ckpt["optimizer"] = self.optimizer.state_dict()
            ckpt["scheduler"] = self.scheduler.state_dict()
            ckpt["rng"] = {"torch": torch.get_rng_state()}
            if self.scaler is not None:
                ckpt["scaler"] = self.scaler.state_dict()
            if torch.cuda.is_available():
                ckpt["rng"]["cuda"] = torch.cuda.get_rng_state_all()
            if self.dist.enabled and getattr(self, "_rank_rng", None) is not None:
                ckpt["rng"]["ranks"] = self._rank_rng  # every rank's own generators, gathered by save()
        return ckpt

    def rng_state(self) -> dict[str, torch.Tensor]:
        """This process's random generators (CPU, and its CUDA device when it has one)."""
        state = {"torch": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        return state

    def check_resumable(self, ckpt: dict[str, Any], path: Path) -> None:
        """A one-line :class:`ConfigError` naming ``path`` when its run cannot continue under this config:
        another number of processes, model type, direction or vocabulary, a fine-tuning config (``init_from``)
        for a run trained from scratch, or another checkpoint to fine-tune from than the run's."""
        init_from = self.config.train.init_from
        if init_from and not ckpt.get("init_from"):  # e.g. the trained checkpoint copied into the new save dir
            raise ConfigError(f"{path}: a run trained from scratch, not one fine-tuned from {init_from} "
                              "(train.init_from, --init-from); give the fine-tuning run a save dir of its own (without "
                              "checkpoint_last.pt), or start afresh there with --restart")
        finetune.check_resumed_origin(ckpt.get("init_from"), init_from, path)
        world, saved_world = self.dist.world_size, ckpt.get("world_size")
        if saved_world is not None and int(saved_world) != world:
            raise ConfigError(f"{path}: written by a run of {saved_world} process(es) but this run has {world}; "
                              f"the data shards would differ, so resume with {saved_world} (torchrun --nproc-per-node "
                              f"{saved_world}), or start afresh with --restart or another --save-dir")
        name = (ckpt.get("config") or {}).get("model", {}).get("name")
        if name is not None and name != self.config.model.name:
            raise ConfigError(f"{path}: holds a {name!r} model but the config says model.name="
                              f"{self.config.model.name!r}; resume with the run's own config.yaml, or start afresh "
                              "with --restart or another --save-dir")
        changed = changed_settings(ckpt.get("config") or {}, to_dict(self.config))
        if changed:
            shown = "; ".join(f"{key}: {old!r} → {new!r}" for key, old, new in changed[:4])
            more = f" and {len(changed) - 4} more" if len(changed) > 4 else ""
            raise ConfigError(f"{path}: this run was trained with other settings ({shown}{more}); resume with "
                              "the run's own config.yaml (only budgets, validation, checkpointing, logging, device, "
                              "precision and decoding may change), or start afresh with --restart or another --save-dir")
        mine = self.checkpoint(with_training_state=False)
        langs = ckpt.get("langs") or {}
        if "src" in langs and "src" in mine["langs"] and langs != mine["langs"]:
            raise ConfigError(f"{path}: trained {langs['src']}→{langs['tgt']} but the config says "
                              f"{mine['langs']['src']}→{mine['langs']['tgt']} (data.src_lang, data.tgt_lang)")
        saved = ckpt.get("tokenizers") or {}
        for key, data in mine["tokenizers"].items():
            if key not in saved or not same_model(saved[key].cpu().numpy().tobytes(), data.numpy().tobytes()):
                raise ConfigError(f"{path}: its vocabulary ({key!r} SentencePiece model) differs from the one in "
                                  f"{self.config.data.path}; give the data directory the run was trained on, or start "
                                  "afresh with --restart or another --save-dir")

    def load_state(self, ckpt: dict[str, Any]) -> None:
        self.model.load_state_dict(ckpt["model"])
        self.optimizer.load_state_dict(ckpt["optimizer"])
        self.scheduler.load_state_dict(ckpt["scheduler"])
        if self.scaler is not None and "scaler" in ckpt:
            self.scaler.load_state_dict(ckpt["scaler"])
        torch.set_rng_state(ckpt["rng"]["torch"].cpu())
        if "cuda" in ckpt["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in ckpt["rng"]["cuda"]])
        ranks = ckpt["rng"].get("ranks")
        if self.dist.enabled and ranks and len(ranks) == self.dist.world_size:  # DDP: this rank's own generators
            mine = ranks[self.dist.rank]
            torch.set_rng_state(mine["torch"].cpu())
            if "cuda" in mine and self.device.type == "cuda":
                torch.cuda.set_rng_state(mine["cuda"].cpu(), self.device)
        saved = {k: v for k, v in ckpt["progress"].items() if k in Progress.__dataclass_fields__}
        stopped = saved.get("stopped", "")
        if "validated_at" not in saved and stopped and not stopped.startswith("interrupted"):
            saved["validated_at"] = saved.get("update")  # older checkpoints: a run that ended validated at its end
        if stopped.startswith(RECHECKED_STOPS):  # budgets and patience are checked again: they may have been raised
            stopped = ""
        self.progress = Progress(**{**saved, "stopped": stopped})
        if self.progress.best_seen is None:  # checkpoints written before best_seen existed
            self.progress.best_seen = self.progress.best
        self._purge_step = self.progress.update + 1  # TensorBoard: drop events written after this checkpoint
        if self.dist.is_main:  # drop log lines written after this checkpoint by the interrupted run
            trim_log(self.save_dir / "log.jsonl", self.progress.update)

    def save(self, best: bool = False) -> None:
        if self.dist.enabled:  # a collective: every rank reaches save() at the same update
            self._rank_rng = distributed.all_gather_object(self.rng_state())
        if not self.dist.is_main:  # one writer; every rank resumes from the same files
            return
        ckpt = self.checkpoint()
        code = integrity_code(ckpt)  # once for the two or three files
        tc = self.config.train
        if best:  # before checkpoint_last, whose progress already counts this model as the best
            save_atomic(ckpt, self.save_dir / "checkpoint_best.pt", code)
        if tc.save_every and self.progress.update % tc.save_every == 0:
            save_atomic(ckpt, self.save_dir / f"checkpoint_{self.progress.update}.pt", code)
            for old in periodic_checkpoints(self.save_dir)[:-tc.keep_checkpoints or None]:
                old.unlink(missing_ok=True)
        save_atomic(ckpt, self.save_dir / "checkpoint_last.pt", code)

    # ---- logging ----------------------------------------------------------------------------------
    def record(self, kind: str, values: dict[str, float]) -> None:
        if not self.dist.is_main:
            return
        entry = {"kind": kind, "update": self.progress.update, **values}
        path = self.save_dir / "log.jsonl"
        try:
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(entry) + "\n")
        except OSError as exc:  # a full disk: the log named (a failed write's error names no file)
            raise write_failure(path, "the log", exc) from None
        if self.writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.writer = SummaryWriter(str(self.save_dir / "tensorboard"),
                                            purge_step=self._purge_step)
            except ImportError:  # tensorboard is optional at run time
                self.writer = False
        if self.writer:
            for k, v in values.items():
                self.writer.add_scalar(f"{kind}/{k}", v, self.progress.update)

    # ---- the loop ---------------------------------------------------------------------------------
    def epoch_batches(self, epoch: int) -> list[np.ndarray]:
        """This epoch's deterministic batch order (computed once per epoch)."""
        if getattr(self, "_epoch_cache", (None,))[0] != epoch:
            self._epoch_cache = (epoch, self.sampler.batches(epoch))
        return self._epoch_cache[1]

    def batches(self) -> Iterator[tuple[int, int, Batch]]:
        """Training batches from the saved position on: (epoch, position after this batch, batch)."""
        epoch, start = self.progress.epoch, self.progress.position
        while True:
            order = self.epoch_batches(epoch)
            if not order:  # more processes than batches: every epoch would be empty on some rank
                raise ConfigError(f"{self.config.data.path}: the training split makes fewer batches of "
                                  f"data.max_tokens={self.config.data.max_tokens} than the {self.dist.world_size} "
                                  "processes training on it; lower data.max_tokens or use fewer processes")
            for pos in range(start, len(order)):
                yield epoch, pos + 1, self.train_data.batch(order[pos])
            epoch, start = epoch + 1, 0

    def next_group(self, stream: Iterator[tuple[int, int, Batch]]) -> list[tuple[int, int, Batch]]:
        """The batches of the next update: ``train.update_freq`` of them, fewer at the end of an epoch (an update
        never mixes two epochs, so ``max_epochs`` stops after exactly that many passes over the data; with DDP
        every rank's shard of an epoch has the same length, so the ranks shorten the same update)."""
        group = [next(stream)]
        while len(group) < self.config.train.update_freq and group[-1][1] < len(self.epoch_batches(group[-1][0])):
            group.append(next(stream))
        return group

    def train_step(self, batches: list[Batch]) -> dict[str, float]:
        """One update from ``batches`` (gradient accumulation; with DDP, this rank's share of the update).

        The loss is normalised by the target tokens of the whole update over all ranks, so N ranks equal one
        process that accumulates their batches. A non-finite loss or gradient norm skips the update
        (``skipped`` = 1, gradients zeroed; ``overflow`` = 1 where only fp16 gradients overflowed, which lowers
        the loss scale); all ranks agree because the loss and the gradients are all-reduced.
        """
        tc = self.config.train
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        tokens = int(distributed.all_reduce([sum(b.num_tgt_tokens for b in batches)], self.device)[0])
        world = self.dist.world_size
        loss_sum = nll_sum = 0.0
        for i, b in enumerate(batches):
            b = b.to(self.device)
            model = self.model_for(b)
            sync = self.ddp is None or i == len(batches) - 1  # all-reduce gradients on the last batch only
            with nullcontext() if sync else self.ddp.no_sync():
                with self.autocast():
                    if self.ddp is not None:
                        loss, nll, aux = self.ddp(model, b, tc.label_smoothing, tc.compile)
                    else:
                        loss, nll, aux = _batch_loss(model, b, tc.label_smoothing, tc.compile)
                # an auxiliary term is on the scale of the summed cross-entropy and normalised with it (SPEC §5)
                objective = loss if aux is None else loss + aux
                total = objective * world / tokens if world > 1 else objective / tokens  # DDP averages over ranks
                (self.scaler.scale(total) if self.scaler is not None else total).backward()
            loss_sum += float(loss.detach())
            nll_sum += float(nll)
        loss_sum, nll_sum = distributed.all_reduce([loss_sum, nll_sum], self.device)
        stats = {"loss": loss_sum / tokens, "nll": nll_sum / tokens, "tokens": tokens,
                 "lr": self.optimizer.param_groups[0]["lr"]}
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        clip = tc.clip_norm
        params = [p for p in self.model.parameters() if p.grad is not None]
        gnorm = float(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf")))
        if not (math.isfinite(loss_sum) and math.isfinite(gnorm)):
            self.optimizer.zero_grad(set_to_none=True)
            if self.scaler is not None:
                self.scaler.update()  # lowers the fp16 loss scale after an overflow
            # a finite loss with fp16 gradients that overflowed at this loss scale: the scale was too high, not
            # the model broken; the batch is dropped and neither the update count nor the schedule advances
            overflow = float(self.scaler is not None and math.isfinite(loss_sum))
            return {**stats, "gnorm": gnorm, "skipped": 1.0, "overflow": overflow}
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.scheduler.step()
        return {**stats, "gnorm": gnorm, "skipped": 0.0}

    def autocast(self) -> Any:
        """The mixed-precision context of ``train.precision`` (a no-op for fp32 and tf32)."""
        return autocast(self.config.train.precision, self.device)

    def train(self) -> TrainResult:
        tc = self.config.train
        p = self.progress
        log.info("model %s: %s parameters; %d training pairs, %d batches per epoch%s", self.config.model.name,
                 f"{count_parameters(self.model):,}", len(self.train_data), len(self.epoch_batches(p.epoch)),
                 f" in each of {self.dist.world_size} processes" if self.dist.world_size > 1 else "")
        bar = tqdm(total=tc.max_updates, initial=p.update, disable=not (tc.progress and self.dist.is_main) or None,
                   desc="train", unit="upd", dynamic_ncols=True)
        clock = RunningClock()  # not counting time the process stood stopped (SIGSTOP, Ctrl-Z)
        start = clock() - p.elapsed
        window_start = clock()
        window = dict.fromkeys(("updates", "tokens", "loss", "nll"), 0.0)  # since the last log line (token-weighted)
        stream = self.batches()
        started = False
        with _graceful_interrupt() as interrupted:
            while not p.stopped:
                reason = self.budget_spent()
                if reason:  # e.g. the same command again after the run finished: nothing more to do
                    p.stopped = reason
                    if self.valid_data is not None and p.validated_at != p.update:  # resumed from a checkpoint
                        # that never had the end-of-run validation: interrupted, or periodic under a budget
                        # lowered since; like any budget's last validation, it does not count for patience
                        self.save(best=self.validate(scheduled=False))
                    break
                if not started:  # what `nmtflow compare --status` needs for a run's total and its ETA
                    self.record("start", {"batches_per_epoch": len(self.epoch_batches(p.epoch)),
                                          "elapsed": p.elapsed})
                    started = True
                group = self.next_group(stream)
                stats = self.train_step([b for _, _, b in group])
                p.epoch, p.position = group[-1][0], group[-1][1]
                if p.position == len(self.epoch_batches(p.epoch)):
                    p.epoch, p.position = p.epoch + 1, 0
                p.elapsed = clock() - start
                skipped = bool(stats["skipped"])
                if stats.get("overflow"):  # (only with fp16's GradScaler)
                    assert self.scaler is not None
                    scale = self.scaler.get_scale()
                    self.record("overflow", {"loss_scale": scale})
                    log.info("fp16 gradients overflowed after update %d: loss scale lowered to %g, batch dropped",
                             p.update, scale)
                    if scale < MIN_LOSS_SCALE:
                        p.stopped = (f"stopped after the fp16 loss scale fell below {MIN_LOSS_SCALE:g} (gradients "
                                     "overflow even unscaled): resume with precision bf16, or lower lr")
                        log.error("%s", p.stopped)
                elif skipped:
                    p.bad_updates += 1
                    self.record("skip", {"loss": stats["loss"], "gnorm": stats["gnorm"], "bad_updates": p.bad_updates})
                    log.warning("non-finite loss %s (gradient norm %s) after update %d: update skipped (%d in a row)",
                                stats["loss"], stats["gnorm"], p.update, p.bad_updates)
                    if p.bad_updates >= tc.max_bad_updates:
                        p.stopped = (f"stopped after {p.bad_updates} consecutive non-finite losses (train.max_bad_updates"
                                     f"={tc.max_bad_updates}): lower lr, use clip_norm, or check the data")
                        log.error("%s", p.stopped)
                else:
                    p.bad_updates = 0
                    p.update += 1
                    window["updates"] += 1
                    window["tokens"] += stats["tokens"]
                    window["loss"] += stats["loss"] * stats["tokens"]
                    window["nll"] += stats["nll"] * stats["tokens"]
                if not skipped and p.update % tc.log_every == 0:
                    # the update's own loss (exactly the same after a resume) and the means since the last line
                    # (a multilingual run's batches differ by direction: one batch's loss swings from line to line)
                    tokens, updates = max(window["tokens"], 1), int(window["updates"])
                    loss_mean, nll_mean = window["loss"] / tokens, window["nll"] / tokens
                    speed = window["tokens"] / max(clock() - window_start, 1e-9)
                    window, window_start = dict.fromkeys(window, 0.0), clock()
                    self.record("train", {**{k: stats[k] for k in ("loss", "nll", "lr", "gnorm")},
                                          "loss_mean": loss_mean, "nll_mean": nll_mean, "mean_of_updates": updates})
                    self.record("speed", {"tgt_tokens_per_s": speed, "elapsed": p.elapsed})
                    log.info("update %d | epoch %d | loss %.3f | ppl %.2f (means of %d updates) | lr %.2e | %.0f tok/s",
                             p.update, p.epoch, loss_mean, math.exp(min(nll_mean, 50)), updates, stats["lr"], speed)
                bar.update(0 if skipped else 1)
                bar.set_postfix(loss=f"{stats['loss']:.3f}", epoch=p.epoch, refresh=False)
                if tc.max_epochs is not None and p.epoch > tc.max_epochs:
                    p.stopped = f"reached max_epochs={tc.max_epochs}"
                # every rank must leave the loop at the same update: agree on the time budget and signals
                time_up, stop_signal = distributed.all_reduce(
                    [float(tc.max_minutes is not None and p.elapsed >= 60 * tc.max_minutes), float(interrupted())],
                    self.device, op="max")
                if time_up:
                    p.stopped = f"reached max_minutes={tc.max_minutes}"
                if p.update >= tc.max_updates:
                    p.stopped = f"reached max_updates={tc.max_updates}"
                if stop_signal and not p.stopped:  # a budget that ends at this update ends the run as without it
                    p.stopped = "interrupted (resume with the same command)"
                due_valid = bool(tc.validate_every and p.update % tc.validate_every == 0 and not skipped)
                is_best = False
                set_aside = clock()  # validation and saving are not training speed
                validated = self.valid_data is not None and (
                    due_valid or bool(p.stopped and not p.stopped.startswith("interrupted")))
                if validated:
                    is_best = self.validate(scheduled=due_valid)
                if is_best or p.stopped or (not skipped and tc.save_every and p.update % tc.save_every == 0):
                    self.save(best=is_best)
                if validated:
                    release_freed_memory()  # what validation's decoding left in the heap, which steps never reuse
                window_start += clock() - set_aside
        bar.close()
        clock.close()
        if self.writer:
            self.writer.flush()
        log.info("training stopped: %s (update %d, %.1f min)", p.stopped, p.update, p.elapsed / 60)
        if self.dist.enabled:
            distributed.barrier()  # rank 0 has written its last checkpoint
            self.ddp = None  # DDP's reducer holds the process group and its last work: gone before the group is
            gc.collect()
            distributed.cleanup()
        if self.dist.is_main:
            unlock_save_dir(self.save_dir)
        return TrainResult(p, self.save_dir, read_log(self.save_dir))

    # ---- validation -------------------------------------------------------------------------------
    # With DDP every rank validates its share (every world_size-th batch or sentence) on the unwrapped model,
    # which runs no collective, and the sums or hypotheses are then combined: no work is duplicated, and
    # every rank ends up with the same numbers, hence the same best-model and early-stopping decisions.
    @torch.no_grad()
    def validation_loss(self) -> tuple[float, int]:
        """Mean NLL per target token on the validation split."""
        assert self.valid_data is not None
        self.model.eval()
        sampler = TokenBatchSampler(self.valid_data.src.sizes, self.valid_data.tgt.sizes,
                                    self.config.data.max_tokens, shuffle=False)
        nll_sum, tokens = 0.0, 0
        for idx in distributed.shard(sampler.batches(1), self.dist):
            b = self.valid_data.batch(idx).to(self.device)
            _, nll = label_smoothed_nll(self.model(b.src, b.tgt_in), b.tgt_out, 0.0)
            nll_sum += float(nll)
            tokens += b.num_tgt_tokens
        nll_sum, total = distributed.all_reduce([nll_sum, tokens], self.device)
        return nll_sum / max(total, 1), int(total)

    def validation_bleu(self) -> float:
        assert self.valid_data is not None
        tc = self.config.train
        n = len(self.valid_data) if tc.valid_bleu_max_sentences is None else min(len(self.valid_data),
                                                                               tc.valid_bleu_max_sentences)
        decode = type(self.config.decode)(**{**vars(self.config.decode), "beam_size": tc.valid_beam_size,
                                             "nbest": 1, "greedy": tc.valid_beam_size == 1,
                                             "sampling": False,  # BLEU of the search, never of samples
                                             "workers": 1})  # the model in training, here: no worker processes
        self.model.eval()
        translator = Translator(self.model, self.src_tok, self.tgt_tok, decode)
        sources = [self.valid_data.src[i].tolist() for i in distributed.shard(range(n), self.dist)]
        mine = [self.tgt_tok.decode(h[0].tokens) for h in translator.translate_ids(sources)]
        hyp_text = distributed.unshard(distributed.all_gather_object(mine), n)
        refs = [self.tgt_tok.decode(self.valid_data.tgt[i].tolist()) for i in range(n)]
        return bleu(hyp_text, refs, tokenize=self.config.train.valid_bleu_tokenize).score

    def budget_spent(self) -> str:
        """Why training must not take another update (a budget or early stopping), or ""."""
        tc, p = self.config.train, self.progress
        if p.update >= tc.max_updates:
            return f"reached max_updates={tc.max_updates}"
        if tc.max_epochs is not None and p.epoch > tc.max_epochs:
            return f"reached max_epochs={tc.max_epochs}"
        if tc.max_minutes is not None and p.elapsed >= 60 * tc.max_minutes:
            return f"reached max_minutes={tc.max_minutes}"
        if tc.patience is not None and p.bad_validations >= tc.patience:
            return f"early stopping: no improvement in {tc.patience} validations"
        if p.bad_updates >= tc.max_bad_updates:
            return f"stopped after {p.bad_updates} consecutive non-finite losses (train.max_bad_updates)"
        return ""

    def validate(self, scheduled: bool = True) -> bool:
        """Validation loss (and BLEU); returns whether this is the best model so far.

        Only ``scheduled`` validations (every ``validate_every`` updates) count for early stopping and the
        ``reduce_on_rise`` schedule; the extra one when a budget ends may still make checkpoint_best. So a run
        cut short by a budget and then continued trains exactly as one that was never cut.
        """
        tc, p = self.config.train, self.progress
        p.validated_at = p.update
        nll, _ = self.validation_loss()
        values = {"nll": nll, "ppl": math.exp(min(nll, 50))}
        if tc.valid_bleu:
            values["bleu"] = self.validation_bleu()
        self.record("valid", values)
        log.info("validation at update %d: %s", p.update, " | ".join(f"{k} {v:.3f}" for k, v in values.items()))
        metric = values["bleu"] if tc.early_stop_metric == "bleu" and tc.valid_bleu else -nll
        is_best = p.best_seen is None or metric > p.best_seen
        if is_best:
            p.best_seen = metric
        if not scheduled:
            return is_best
        if p.best is None or metric > p.best:
            p.best, p.bad_validations = metric, 0
        else:
            p.bad_validations += 1
            if tc.patience is not None and p.bad_validations >= tc.patience:
                p.stopped = f"early stopping: no improvement in {tc.patience} validations"
        validation_end = getattr(self.scheduler, "validation_end", None)  # e.g. reduce_on_rise (train/optim.py)
        if validation_end is not None and (reason := validation_end(nll)):
            p.stopped = reason
        return is_best


class _StepModule(torch.nn.Module):
    """What DDP wraps: the forward pass and loss of one batch on a view of the trained model."""

    def __init__(self, model: EncoderDecoder) -> None:
        super().__init__()
        self.model = model

    def forward(self, view: EncoderDecoder, batch: Batch, epsilon: float,
                compiled: bool = False) -> tuple[torch.Tensor, ...]:
        return _batch_loss(view, batch, epsilon, compiled)


def _batch_loss(model: EncoderDecoder, b: Batch, epsilon: float,
                compiled: bool = False) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(label-smoothed loss sum, NLL sum, auxiliary loss or None) of one batch; ``compiled``: the compiled loss."""
    enc = model.encode(b.src)
    logits = model.decode(b.tgt_in, enc)
    loss, nll = label_smoothed_nll(logits, b.tgt_out, epsilon, compiled=compiled)
    return loss, nll, model.auxiliary_loss(enc, b.num_tgt_tokens)


def _log_entries(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(line, entry) of every complete line of a log.jsonl; a line cut off by a kill or a full disk is skipped."""
    entries = []
    for line in path.read_text(encoding="utf-8").splitlines() if path.is_file() else []:
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            entries.append((line, entry))
    return entries


def read_log(save_dir: str | Path) -> list[dict[str, Any]]:
    return [entry for _, entry in _log_entries(Path(save_dir) / "log.jsonl")]


def trim_log(path: Path, update: int) -> None:
    """Keep the lines of ``path`` up to ``update`` (those after it come from the run's interrupted tail).

    The rewrite is atomic (:func:`~nmtflow.checkpoint.write_text_atomic`): a crash or a full disk during it
    leaves the old log whole.
    """
    if path.is_file():  # a start at the update is a resume from this same checkpoint that was cut short in turn
        kept = [line for line, entry in _log_entries(path) if entry.get("update", 0) < update
                or (entry.get("update", 0) == update and entry.get("kind") != "start")]
        write_text_atomic(path, "".join(line + "\n" for line in kept), "the log")


MIN_LOSS_SCALE = 1e-4  # fp16: below this loss scale gradients overflow even unscaled, so training stops
# Settings a resumed run may change: they do not alter the trajectory of the parameters (the data order, the
# model, the optimiser and its schedule), only how long it runs, what it records and where. Keys are dotted
# config paths; a key ending in "." stands for its whole section.
RESUMABLE_CHANGES = (
    "train.save_dir", "train.device", "train.threads", "train.precision", "train.fused_optimizer",
    "train.max_updates", "train.max_epochs", "train.max_minutes", "train.patience", "train.max_bad_updates",
    "train.validate_every", "train.valid_bleu_max_sentences", "train.valid_bleu_tokenize", "train.valid_beam_size",
    "train.save_every", "train.keep_checkpoints", "train.log_every", "train.progress", "data.path",
    "data.multilingual.init_checkpoint", "train.init_from",  # (a resumed run takes its weights from its checkpoint)
    "train.compile", "decode.")
# saved reasons for a stop that a resume examines again (the budget or patience may have been raised)
RECHECKED_STOPS = ("reached max_", "early stopping", "interrupted", "stopped after")


def changed_settings(saved: dict[str, Any], current: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, current value) of the settings that differ and may not change on resume.

    Keys missing on either side (settings added to nmtflow since the checkpoint was written) are not compared.
    """
    return differing_settings(saved, current, may_change_on_resume)


def may_change_on_resume(name: str) -> bool:
    """Whether a resumed run may set the dotted config key ``name`` otherwise (:data:`RESUMABLE_CHANGES`)."""
    return name in RESUMABLE_CHANGES or any(name.startswith(s) for s in RESUMABLE_CHANGES if s.endswith("."))


@contextmanager
def _graceful_interrupt() -> Iterator[Any]:
    """SIGINT/SIGTERM set a flag: the loop finishes its update, saves a checkpoint and exits cleanly."""
    hit = {"flag": False}

    def handler(signum: int, frame: Any) -> None:
        if hit["flag"]:  # a second signal: stop now
            raise KeyboardInterrupt
        hit["flag"] = True
        log.warning("signal %d received: saving a checkpoint after this update", signum)

    with on_signals(handler):
        yield lambda: hit["flag"]


@contextmanager
def on_signals(handler: Callable[[int, Any], None]) -> Iterator[None]:
    """Route SIGINT/SIGTERM to ``handler`` inside the block, then restore the previous handlers.

    Outside the main thread (where handlers cannot be installed) this does nothing.
    """
    previous = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread
        previous = {}
    try:
        yield
    finally:
        for sig, h in previous.items():
            signal.signal(sig, h)

