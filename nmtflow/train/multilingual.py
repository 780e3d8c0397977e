"""Multilingual training (SPEC §5): many directions of one multi-way prepared directory, one model.

:class:`MultilingualTrainer` is the ordinary :class:`~nmtflow.train.trainer.Trainer` with its data and model
seams filled in for ``data.multilingual``:

* ``setup_data``: one bitext and one token sampler per direction, joined by the
  :class:`~nmtflow.data.multilingual.LanguageRotatingSampler`; batches are
  :class:`~nmtflow.data.multilingual.PairBatch` es that carry ``src_lang``/``tgt_lang``; a language-label
  model gets the ``<2TGT>`` tag before every source;
* ``model_for(batch)`` = ``model.pair(batch.src_lang, batch.tgt_lang)``: the training step is unchanged;
* validation: loss and BLEU per direction (logged as ``valid_directions``); model selection uses the mean
  over the supervised directions (the copy directions A→A only if every training direction is one), zero-shot
  ones are only reported;
* adding a language (``init_checkpoint`` + ``new_langs``): the trained model is loaded and everything but
  the new languages' encoders and decoders is frozen — the bridge included;
* fine-tuning (``train.init_from``, :mod:`nmtflow.train.finetune`): the model keeps every language of the trained
  one (a language the data lacks takes its tokenizer from the checkpoint) and trains on the listed directions.

Resume, checkpoints, logging and the schedule of updates are the base trainer's. A multilingual checkpoint
adds ``multilingual: True``, per-language vocabulary sizes under ``vocab`` and one tokenizer per language.
"""
from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch

from nmtflow.checkpoint import load_checkpoint, model_mismatch
from nmtflow.config import Config, ConfigError, to_dict
from nmtflow.data.batching import Batch, TokenBatchSampler
from nmtflow.data.bitext import check_sentence_lengths, tokenizer_path
from nmtflow.data.multilingual import (Direction, LanguageRotatingSampler, MultiBitext, open_directions,
                                       plan_directions)
from nmtflow.data.prepare import load_meta
from nmtflow.data.tokenizer import Tokenizer, same_model
from nmtflow.data.vocab import lang_tag
from nmtflow.decode.translate import Translator, bytes_tensor
from nmtflow.evaluate.metrics import bleu
from nmtflow.models.base import EncoderDecoder, position_limits
from nmtflow.models.multilingual import LanguageVocabularies, MultilingualModel
from nmtflow.registry import MODELS
from nmtflow.train import distributed
from nmtflow.train.loss import label_smoothed_nll
from nmtflow.train.trainer import Trainer, check_valid_split

log = logging.getLogger("nmtflow.train")


def tag_ids(tokenizers: dict[str, Tokenizer], langs: list[str], where: str) -> dict[str, int]:
    """Ids of the ``<2xx>`` target tags of ``langs`` in a joint vocabulary."""
    if len({t.model_proto for t in tokenizers.values()}) != 1:
        raise ConfigError(f"{where}: a language-label model needs a joint vocabulary (prepare without "
                          "--separate-vocab)")
    tok = next(iter(tokenizers.values()))
    missing = [lang for lang in langs if lang_tag(lang) not in tok]
    if missing:
        raise ConfigError(f"{where}: no {lang_tag(missing[0])} tag in the vocabulary (prepare with --lang-tags)")
    return {lang: tok.id(lang_tag(lang)) for lang in langs}


def tokenizer_tensors(tokenizers: dict[str, Tokenizer]) -> dict[str, torch.Tensor]:
    """Language → the SentencePiece model's bytes as loaded (not its file now); a joint model is stored once (shared
    tensor)."""
    by_model: dict[bytes, torch.Tensor] = {}
    for tok in tokenizers.values():
        if tok.model_proto not in by_model:
            by_model[tok.model_proto] = bytes_tensor(tok.model_proto)
    return {lang: by_model[tok.model_proto] for lang, tok in tokenizers.items()}


def trainer_for(config: Config, *, resume: bool = True) -> Trainer:
    """The trainer ``nmtflow train`` runs ``config`` with: :class:`MultilingualTrainer` where ``data.multilingual``
    is set (many directions, one model; SPEC §5), else :class:`~nmtflow.train.trainer.Trainer`."""
    return (Trainer if config.data.multilingual is None else MultilingualTrainer)(config, resume=resume)


class MultilingualTrainer(Trainer):
    """Trains a :class:`MultilingualModel` on ``data.multilingual``; see the module docstring."""

    model: MultilingualModel
    find_unused_parameters = True  # a step updates one direction's encoder and decoder, not the others

    def check_model_fits_trainer(self) -> None:
        """Nothing here: :meth:`setup_data` checks the model and ``data.multilingual``."""

    # ---- data --------------------------------------------------------------------------------------
    def setup_data(self) -> None:
        tc, dc = self.config.train, self.config.data
        mc = dc.multilingual
        if mc is None:
            raise ConfigError("data.multilingual: missing (the multilingual trainer needs its directions)")
        model_cls = MODELS.get(self.config.model.name).cls
        if not issubclass(model_cls, MultilingualModel):
            raise ConfigError(f"model.name: {self.config.model.name!r} is not a multilingual model "
                              "(bridge or language_label)")
        self.uses_tags = model_cls.uses_language_tags
        meta = load_meta(dc.path)
        self.directions, self.zero_shot = plan_directions(meta["langs"], mc)
        # adding languages (init_checkpoint) or fine-tuning (train.init_from): the trained model's languages come from
        # that checkpoint when the run starts, and from the run's own checkpoint when it resumes (it holds them all,
        # and the weights that resuming loads): a resumed run does not need the init file any more
        if mc.init_checkpoint and tc.init_from:
            raise ConfigError("train.init_from: fine-tuning and data.multilingual.init_checkpoint (adding languages) "
                              "both start from a trained model; set one of them")
        init_path = (self.resume_from or mc.init_checkpoint or tc.init_from) \
            if mc.init_checkpoint or tc.init_from else None
        self.init_checkpoint = self.init_source if self.init_source is not None else \
            load_checkpoint(init_path) if init_path else None
        encoders = {d.src: 0 for d in self.directions}
        decoders = {d.tgt: 0 for d in self.directions}
        if self.init_checkpoint is not None:  # keep every module of the model that languages are added to
            encoders.update(self.init_checkpoint["vocab"].get("encoders", {}))
            decoders.update(self.init_checkpoint["vocab"].get("decoders", {}))
        langs = sorted({*encoders, *decoders, *(lang for d in self.zero_shot for lang in (d.src, d.tgt))})
        # a language of the trained model that the data lacks (fine-tuning on some directions) keeps its tokenizer
        saved = (self.init_checkpoint or {}).get("tokenizers", {})
        self.tokenizers = {lang: Tokenizer(tokenizer_path(dc.path, meta, lang)) if lang in meta["langs"] or
                           lang not in saved else Tokenizer.from_bytes(saved[lang].numpy().tobytes(), str(init_path),
                                                                       what=f"its {lang} SentencePiece model")
                           for lang in langs}
        if self.init_checkpoint is not None and mc.init_checkpoint:
            self._check_tokenizers(self.init_checkpoint, str(init_path))
            vocab = self.init_checkpoint["vocab"]
            had = {*vocab.get("encoders", {}), *vocab.get("decoders", {})}
            again = [lang for lang in mc.new_langs if lang in had]
            if again and self.resume_from is None:  # (a resumed run's own checkpoint has them: it added them)
                raise ConfigError(f"data.multilingual.new_langs: {again[0]!r} is already a language of "
                                  f"{init_path}; new_langs adds languages the model lacks (to retrain {again[0]}'s "
                                  "directions, fine-tune with train.init_from)")
        encoders = {lang: self.tokenizers[lang].vocab_size for lang in encoders}
        decoders = {lang: self.tokenizers[lang].vocab_size for lang in decoders}
        self.vocabs = LanguageVocabularies(max(encoders.values()), max(decoders.values()),
                                           joint=len({t.model_proto for t in self.tokenizers.values()}) == 1,
                                           encoders=encoders, decoders=decoders)
        self.src_tok, self.tgt_tok = self.tokenizers[self.directions[0].src], self.tokenizers[self.directions[0].tgt]
        tags = tag_ids(self.tokenizers, langs, dc.path) if self.uses_tags else {}
        self.prefixes = {d: tags[d.tgt] for d in [*self.directions, *self.zero_shot]} if tags else {}

        self.train_data = open_directions(dc.path, dc.train_split, self.directions, self.prefixes, mc.max_sentences)
        # copy directions are validated only when there is nothing else to select the model on
        valid = ([d for d in self.directions if not d.is_copy] or list(self.directions)) + self.zero_shot
        check_valid_split(dc.path, dc.valid_split, meta)
        self.valid_data = open_directions(dc.path, dc.valid_split, valid, self.prefixes) \
            if dc.valid_split and valid else None
        samplers = [TokenBatchSampler(*self.train_data.sizes(i), dc.max_tokens, shuffle=True, seed=tc.seed + 1000 * i,
                                      max_sentences=dc.max_sentences, src_prefix_len=int(self.uses_tags))
                    for i in range(len(self.directions))]
        self.sampler = LanguageRotatingSampler(samplers, mc.schedule, tc.seed, self.train_data.limits,
                                               num_shards=self.dist.world_size, shard_id=self.dist.rank)
        log.info("multilingual: %s schedule over %s%s", mc.schedule, ", ".join(map(str, self.directions)),
                 f"; zero-shot {', '.join(map(str, self.zero_shot))}" if self.zero_shot else "")

    def _check_tokenizers(self, ckpt: dict[str, Any], path: str) -> None:
        """The trained model's languages must keep their tokenizers; adding a language needs per-language ones."""
        for lang, data in ckpt.get("tokenizers", {}).items():
            mine = self.tokenizers.get(lang)
            if mine is None or same_model(mine.model_proto, data.numpy().tobytes()):
                continue
            if (ckpt.get("vocab") or {}).get("joint"):
                raise ConfigError(f"data.path: the {lang} tokenizer differs from the one in {path}, whose model has a "
                                  "joint vocabulary (one learned on more languages always differs): adding a language "
                                  "needs per-language vocabularies; train the model on data prepared with "
                                  "--separate-vocab")
            raise ConfigError(f"data.path: the {lang} tokenizer differs from the one in {path}; prepare all languages "
                              "with --separate-vocab and without --lang-tags from the trained model's training files")

    def check_lengths(self) -> None:
        """Stop before update 1 if a train or valid sentence of any direction is longer than the model's positions
        (source + EOS, + the ``<2xx>`` tag of a language-label model; target + EOS), naming its split, language
        and row or line."""
        src_limit, tgt_limit = position_limits(self.model.config)
        dc = self.config.data
        tag = int(self.uses_tags)
        seen: set[tuple[str, str, int, int]] = set()  # max_sentences may give a language's directions other rows
        splits = [(dc.train_split, self.train_data)] + ([(dc.valid_split, self.valid_data)] if self.valid_data else [])
        for split, multi in splits:
            for i, d in enumerate(multi.directions):
                src_sizes, tgt_sizes = multi.sizes(i)
                sides = ((d.src, src_sizes, 1 + tag, src_limit), (d.tgt, tgt_sizes, 1, tgt_limit))
                for lang, sizes, extra, limit in sides:
                    if (split, lang, extra, len(sizes)) in seen:
                        continue
                    seen.add((split, lang, extra, len(sizes)))
                    counted = "with EOS" + (f" and the {lang_tag(d.tgt)} tag" if extra > 1 else "")
                    try:
                        check_sentence_lengths(dc.path, split, lang, sizes, extra, limit,
                                               cleaned=split == dc.train_split, counted=counted)
                    except ConfigError as exc:  # a language-label model's positions are its backbone's
                        if not hasattr(self.model.config, "backbone"):
                            raise
                        raise ConfigError(str(exc).replace("model.max_positions", "model.backbone.max_positions")) \
                            from None

    # ---- model -------------------------------------------------------------------------------------
    def create_model(self) -> EncoderDecoder:
        model = super().create_model()
        for d in self.zero_shot:
            try:
                model.check_pair(d.src, d.tgt)
            except ValueError as exc:
                raise ConfigError(f"data.multilingual.zero_shot: {d}: {exc}") from None
        mc = self.config.data.multilingual
        # adding languages: the trained modules (new ones stay as built); fine-tuning loads all in the base trainer
        if mc.init_checkpoint and self.resume_from is None:  # resuming loads the run's own weights
            try:
                _, unexpected = model.load_state_dict(self.init_checkpoint["model"], strict=False)
            except RuntimeError as exc:
                raise ConfigError(f"data.multilingual.init_checkpoint: {mc.init_checkpoint} does not fit this "
                                  f"model ({model_mismatch(exc, 200)}); give the model section the checkpoint was "
                                  "trained with") from None
            if unexpected:
                raise ConfigError(f"data.multilingual.init_checkpoint: unexpected parameters {unexpected[:3]}")
        if self.init_checkpoint is not None:  # the weights are in the model now (or come from resuming): not kept
            self.init_checkpoint = {k: v for k, v in self.init_checkpoint.items()
                                    if k not in ("model", "optimizer", "scheduler", "rng")}
        if self.init_checkpoint is not None and mc.new_langs:  # a resumed run too: the optimiser's parameters
            if not hasattr(model, "language_modules"):
                raise ConfigError("data.multilingual.new_langs: this model has no language-specific modules")
            model.requires_grad_(False)  # the bridge and every other language stay as they are
            for module in model.language_modules(list(mc.new_langs)):
                module.requires_grad_(True)
        return model

    def model_for(self, batch: Batch) -> EncoderDecoder:
        return self.model.pair(batch.src_lang, batch.tgt_lang)  # type: ignore[attr-defined]

    def tokenizer_models(self) -> dict[str, Tokenizer]:
        return dict(self.tokenizers)

    def translator(self, d: Direction, decode: Any = None) -> Translator:
        return Translator(self.model.pair(d.src, d.tgt), self.tokenizers[d.src], self.tokenizers[d.tgt],
                          decode or self.config.decode, self.config, src_prefix=self.prefixes.get(d))

    # ---- checkpoints -------------------------------------------------------------------------------
    def checkpoint(self, with_training_state: bool = True) -> dict[str, Any]:
        ckpt = super().checkpoint(with_training_state)
        v = self.vocabs
        ckpt["vocab"] = {"src_size": v.src_size, "tgt_size": v.tgt_size, "joint": v.joint,
                         "encoders": dict(v.encoders), "decoders": dict(v.decoders)}
        ckpt["langs"] = {"directions": self.all_directions(), "zero_shot": self.all_zero_shot()}
        ckpt["tokenizers"] = tokenizer_tensors(self.tokenizer_models())
        ckpt["multilingual"] = True
        return ckpt

    def check_resumable(self, ckpt: dict[str, Any], path: Path) -> None:
        """The run's directions, then the base checks: ``langs`` and ``pairs`` default to every prepared language,
        so data prepared again with other languages changes the directions under an unchanged config."""
        langs = ckpt.get("langs") or {}
        saved_config = ((ckpt.get("config") or {}).get("data") or {}).get("multilingual")
        if "directions" in langs and saved_config == to_dict(self.config.data.multilingual):
            saved = [*langs["directions"], *(f"{d} (zero-shot)" for d in langs.get("zero_shot", []))]
            mine = [*self.all_directions(), *(f"{d} (zero-shot)" for d in self.all_zero_shot())]
            changes = [f"{verb} {', '.join(ds[:4])}{' …' if len(ds) > 4 else ''}" for verb, ds in
                       (("adds", [d for d in mine if d not in saved]), ("drops", [d for d in saved if d not in mine]))
                       if ds]
            if changes:
                raise ConfigError(f"{path}: {self.config.data.path} {' and '.join(changes)} (the languages prepared "
                                  "there are not the run's: data.multilingual.langs and pairs default to all of them); "
                                  "give the data directory the run was trained on, or start afresh with --restart or "
                                  "another --save-dir")
        super().check_resumable(ckpt, path)

    def all_directions(self) -> list[str]:
        """This run's training directions after those the model was trained on before (``init_checkpoint``: a
        model languages are added to translates its earlier directions too)."""
        before = (self.init_checkpoint or {}).get("langs", {}).get("directions", [])
        before = [d for d in before if Direction.parse(d) not in self.zero_shot]
        return list(dict.fromkeys([*before, *(str(d) for d in self.directions)]))

    def all_zero_shot(self) -> list[str]:
        """This run's zero-shot directions, then those of the model it started from (fine-tuning, adding languages)
        that it does not train: they stay untrained, and the checkpoint says so."""
        before = (self.init_checkpoint or {}).get("langs", {}).get("zero_shot", [])
        trained = set(self.all_directions())
        return list(dict.fromkeys([*(str(d) for d in self.zero_shot), *(d for d in before if d not in trained)]))

    # ---- validation --------------------------------------------------------------------------------
    @torch.no_grad()
    def validation_loss(self) -> tuple[float, int]:
        """Mean NLL per target token over the supervised directions; every direction is logged."""
        valid: MultiBitext = self.valid_data  # type: ignore[assignment]
        self.model.eval()
        per: dict[str, float] = {}
        nll_sum, tokens = 0.0, 0
        sums = []  # (nll, tokens) of this rank's share of each direction (all of it with one process)
        for i, d in enumerate(valid.directions):
            sampler = TokenBatchSampler(*valid.sizes(i), self.config.data.max_tokens, shuffle=False,
                                        src_prefix_len=int(self.uses_tags))
            d_nll, d_tokens = 0.0, 0
            for rows in distributed.shard(sampler.batches(1), self.dist):
                b = valid.batch((i, rows)).to(self.device)
                _, nll = label_smoothed_nll(self.model_for(b)(b.src, b.tgt_in), b.tgt_out, 0.0)
                d_nll += float(nll)
                d_tokens += b.num_tgt_tokens
            sums += [d_nll, d_tokens]
        sums = distributed.all_reduce(sums, self.device)
        for i, d in enumerate(valid.directions):
            d_nll, d_tokens = sums[2 * i], int(sums[2 * i + 1])
            per[f"nll.{d}"] = d_nll / max(d_tokens, 1)
            if d not in self.zero_shot:
                nll_sum, tokens = nll_sum + d_nll, tokens + d_tokens
        self.record("valid_directions", per)
        return nll_sum / max(tokens, 1), tokens

    def validation_bleu(self) -> float:
        """BLEU per direction (logged); returns the mean over the supervised directions."""
        valid: MultiBitext = self.valid_data  # type: ignore[assignment]
        tc = self.config.train
        decode = dataclasses.replace(self.config.decode, beam_size=tc.valid_beam_size, nbest=1,
                                     greedy=tc.valid_beam_size == 1, sampling=False,  # BLEU of the search
                                     workers=1)  # the model in training, here: no worker processes
        self.model.eval()
        scores: dict[str, float] = {}
        mine: list[list[str]] = []  # this rank's share of each direction's hypotheses (DDP: gathered below)
        counts: list[int] = []
        for i, d in enumerate(valid.directions):
            n = valid.limits[i] if tc.valid_bleu_max_sentences is None else min(valid.limits[i],
                                                                                 tc.valid_bleu_max_sentences)
            bitext, tgt_tok = valid.bitexts[i], self.tokenizers[d.tgt]
            rows = distributed.shard(range(n), self.dist)
            hyps = self.translator(d, decode).translate_ids([bitext.src[j].tolist() for j in rows])
            mine.append([tgt_tok.decode(h[0].tokens) for h in hyps])
            counts.append(n)
        gathered = distributed.all_gather_object(mine)
        for i, d in enumerate(valid.directions):
            bitext, tgt_tok, n = valid.bitexts[i], self.tokenizers[d.tgt], counts[i]
            hyp_text = distributed.unshard([part[i] for part in gathered], n)
            refs = [tgt_tok.decode(bitext.tgt[j].tolist()) for j in range(n)]
            scores[str(d)] = bleu(hyp_text, refs, tokenize=self.config.train.valid_bleu_tokenize).score
        self.record("valid_directions", {f"bleu.{k}": v for k, v in scores.items()})
        supervised = [scores[str(d)] for d in valid.directions if d not in self.zero_shot]
        return float(np.mean(supervised)) if supervised else 0.0
