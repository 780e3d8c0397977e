"""Export a trained Transformer for deployment with CTranslate2 (``nmtflow export CKPT --to ctranslate2 -o DIR``).

The model is described with CTranslate2's own ``TransformerSpec`` (its Python converter API) and saved with its
``save``: ``DIR/model.bin``, ``config.json`` and the vocabularies (``shared_vocabulary.json``, or
``source_vocabulary.json`` and ``target_vocabulary.json``: the SentencePiece pieces by id). Beside them go the
checkpoint's SentencePiece models (``source.spm``, ``target.spm``) and ``nmtflow.json`` (the checkpoint, the
languages, its decoding settings, and the ``translate_batch`` options that search as nmtflow does: BOS and PAD
suppressed, empty outputs allowed), so that ``ctranslate2.Translator(DIR)`` translates with it:
``translate_batch([source.spm pieces], **info["translate_batch"])`` → pieces for ``target.spm``.

What maps where (nmtflow → CTranslate2): the token embeddings and their √d scale, the sinusoidal position table
itself (written out: CTranslate2's built-in table orders sin and cos differently), q/k/v projections fused into one
matrix (self-attention) or k/v fused (cross-attention), no biases, pre- or post-norm residual layer norms
(ε = 1e-5), the final layer norms of a pre-norm stack, the output projection (tied or not), sources ending in EOS
and targets starting with BOS.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import nn

from nmtflow.checkpoint import CheckpointError, load_checkpoint, model_mismatch, write_failure
from nmtflow.config import config_from_dict
from nmtflow.data.tokenizer import Tokenizer
from nmtflow.data.vocab import BOS_PIECE, EOS_PIECE, PAD_PIECE, UNK_PIECE
from nmtflow.models.base import Vocabularies, build_model

TARGETS = ("ctranslate2",)
QUANTIZATIONS = ("float32", "int8", "int8_float32", "int8_float16", "int8_bfloat16", "int16", "float16", "bfloat16")
INSTALL = "pip install 'ctranslate2>=4.4' (in an nmtflow checkout: pip install -e '.[export]')"
LAYER_NORM_EPSILON = 1e-5  # torch.nn.LayerNorm's default, which every nmtflow Transformer uses
ARCHITECTURES = {  # registered models CTranslate2's TransformerSpec cannot express
    "convs2s": "ConvS2S (convolutional encoder and decoder)",
    "densenmt": "DenseNMT (densely connected convolutional layers)",
    "rnn": "an RNN (LSTM encoder and decoder)",
    "bridge": "the attention bridge (per-language RNN encoders and decoders joined by an inner attention)",
    "language_label": "a language-label model",
    "lm": "a decoder-only language model",
}
ATTENTIONS = {"shortcut": "shortcuts (Emelin et al. 2019)", "phrasal": "phrasal attention"}


def import_ctranslate2() -> ModuleType:
    """The ``ctranslate2`` module, or a ValueError saying how to install it."""
    try:
        import ctranslate2
    except ImportError:
        raise ValueError(f"exporting to CTranslate2 needs the ctranslate2 package, which is not installed: "
                         f"{INSTALL}") from None
    return ctranslate2


def unsupported(model_cfg: Any) -> str | None:
    """Why CTranslate2 cannot run a model of config ``model_cfg`` (None: it can)."""
    name = getattr(model_cfg, "name", None)
    if name != "transformer":
        what = ARCHITECTURES.get(name, f"a {name!r} model")
        return f"{what}; CTranslate2 runs the standard Transformer only"
    for slot in ("encoder_self_attention", "decoder_self_attention", "cross_attention"):
        kind = getattr(model_cfg, slot).type
        if kind != "standard":
            what = ATTENTIONS.get(kind, f"the {kind!r} attention variant")
            return (f"a Transformer with {what} (model.{slot}.type: {kind}); CTranslate2 has standard multi-head "
                    "attention only")
    return None


def _tensor(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().cpu().numpy().copy()


def _linear(spec: Any, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
    spec.weight = _tensor(weight)
    if bias is not None:
        spec.bias = _tensor(bias)


def _layer_norm(spec: Any, norm: nn.LayerNorm) -> None:
    spec.gamma, spec.beta = _tensor(norm.weight), _tensor(norm.bias)


def _attention(spec: Any, attn: nn.Module, self_attention: bool, norm: nn.LayerNorm) -> None:
    """q/k/v (self: fused in one matrix [Wq; Wk; Wv]) or q and [Wk; Wv] (cross), then the output projection."""
    q, k, v = attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight
    if self_attention:
        _linear(spec.linear[0], torch.cat([q, k, v]))
    else:
        _linear(spec.linear[0], q)
        _linear(spec.linear[1], torch.cat([k, v]))
    _linear(spec.linear[-1], attn.out_proj.weight)
    _layer_norm(spec.layer_norm, norm)


def _ffn(spec: Any, layer: nn.Module) -> None:
    _linear(spec.linear_0, layer.ffn.fc1.weight, layer.ffn.fc1.bias)
    _linear(spec.linear_1, layer.ffn.fc2.weight, layer.ffn.fc2.bias)
    _layer_norm(spec.layer_norm, layer.ffn_res.norm)


def _inputs(spec: Any, embedder: nn.Module, embeddings_spec: Any) -> None:
    embeddings_spec.weight = _tensor(embedder.embedding.weight)
    spec.scale_embeddings = float(embedder.scale)  # √d
    spec.position_encodings.encodings = _tensor(embedder.positions.table)  # (max_positions, d), from position 0


def transformer_spec(model: nn.Module, src_pieces: list[str], tgt_pieces: list[str]) -> Any:
    """CTranslate2's ``TransformerSpec`` holding ``model``'s weights (an nmtflow ``Transformer``) and vocabularies."""
    ct2_specs = import_ctranslate2().specs
    cfg = model.config
    activation = {"relu": ct2_specs.Activation.RELU, "gelu": ct2_specs.Activation.GELU}[cfg.activation]
    spec = ct2_specs.TransformerSpec.from_config((cfg.encoder_layers, cfg.decoder_layers), cfg.heads,
                                                 pre_norm=cfg.pre_norm, activation=activation)
    enc, dec = model.encoder, model.decoder
    _inputs(spec.encoder, enc.embedder, spec.encoder.embeddings[0])
    for layer_spec, layer in zip(spec.encoder.layer, enc.layers):
        _attention(layer_spec.self_attention, layer.self_attn, True, layer.attn_res.norm)
        _ffn(layer_spec.ffn, layer)
    _inputs(spec.decoder, dec.embedder, spec.decoder.embeddings)
    for layer_spec, layer in zip(spec.decoder.layer, dec.layers):
        _attention(layer_spec.self_attention, layer.self_attn, True, layer.self_res.norm)
        _attention(layer_spec.attention, layer.cross_attn, False, layer.cross_res.norm)
        _ffn(layer_spec.ffn, layer)
    if cfg.pre_norm:
        _layer_norm(spec.encoder.layer_norm, enc.final_norm)
        _layer_norm(spec.decoder.layer_norm, dec.final_norm)
    _linear(spec.decoder.projection, dec.output_weight)
    spec.register_source_vocabulary(src_pieces)
    spec.register_target_vocabulary(tgt_pieces)
    spec.config.unk_token, spec.config.bos_token, spec.config.eos_token = UNK_PIECE, BOS_PIECE, EOS_PIECE
    spec.config.decoder_start_token = BOS_PIECE  # the decoder reads BOS + y; sources are x + EOS
    spec.config.add_source_eos = True
    spec.config.layer_norm_epsilon = LAYER_NORM_EPSILON
    return spec


def _pieces(tok: Tokenizer, size: int, path: str | Path, side: str) -> list[str]:
    """The pieces of ``tok`` by id; the model's ``size`` must be the tokenizer's."""
    if size != tok.vocab_size:
        raise CheckpointError(f"{path}: the model's {side} vocabulary has {size} entries but its SentencePiece model "
                              f"{tok.vocab_size}")
    return [tok.piece(i) for i in range(size)]


EXPORT_INFO = "nmtflow.json"  # in every exported directory: what it was exported from


def _check_replaceable(out: Path, checkpoint: Path) -> None:
    """A ValueError unless ``--force`` may delete directory ``out``: an earlier export (it holds
    :data:`EXPORT_INFO`) that neither holds ``checkpoint`` nor is (or holds) the working directory."""
    real = out.resolve()
    if checkpoint.resolve().is_relative_to(real):
        raise ValueError(f"-o {out}: holds the checkpoint {checkpoint}; --force would delete it with the directory; "
                         "export to another directory")
    if Path.cwd().resolve().is_relative_to(real):
        raise ValueError(f"-o {out}: is the working directory or one above it; export to another directory")
    if not (real / EXPORT_INFO).is_file():
        raise ValueError(f"-o {out}: not an earlier export (it has no {EXPORT_INFO}); --force replaces only those, so "
                         "remove it yourself or export to another directory")


def export_ctranslate2(checkpoint: str | Path, out_dir: str | Path, *, quantization: str = "float32",
                       force: bool = False) -> Path:
    """Write checkpoint ``checkpoint`` (a bilingual nmtflow Transformer) as a CTranslate2 model directory ``out_dir``
    with its SentencePiece models (``quantization``: CTranslate2's weight type). A ValueError for a model CTranslate2
    cannot express, a missing ctranslate2 package, or an existing ``out_dir`` without ``force``."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization {quantization}: expected one of {', '.join(QUANTIZATIONS)}")
    out = Path(out_dir)
    if out.exists() and not (force and out.is_dir()):
        raise ValueError(f"-o {out}: already exists" + ("; add --force to replace it" if out.is_dir() else ""))
    if out.is_dir():
        _check_replaceable(out, Path(checkpoint))
    ckpt = load_checkpoint(checkpoint)
    if ckpt.get("multilingual"):
        raise ValueError(f"{checkpoint}: a multilingual checkpoint; CTranslate2 export takes a bilingual Transformer")
    try:
        config = config_from_dict(ckpt["config"])
        vocab = Vocabularies(**ckpt["vocab"])
    except (KeyError, TypeError) as exc:
        raise CheckpointError(f"{checkpoint}: not a readable nmtflow checkpoint ({model_mismatch(exc)})") from None
    reason = unsupported(config.model)
    if reason is not None:
        raise ValueError(f"{checkpoint}: cannot export to CTranslate2: {reason}")
    ct2 = import_ctranslate2()
    try:
        model = build_model(config.model, vocab)
        model.load_state_dict(ckpt["model"])
        src_bytes, tgt_bytes = (ckpt["tokenizers"][side].numpy().tobytes() for side in ("src", "tgt"))
    except (KeyError, RuntimeError, TypeError) as exc:
        raise CheckpointError(f"{checkpoint}: checkpoint does not match its model ({model_mismatch(exc)})") from None
    src_tok = Tokenizer.from_bytes(src_bytes, checkpoint, what="its src SentencePiece model")
    tgt_tok = Tokenizer.from_bytes(tgt_bytes, checkpoint, what="its tgt SentencePiece model")
    spec = transformer_spec(model.eval(), _pieces(src_tok, vocab.src_size, checkpoint, "source"),
                            _pieces(tgt_tok, vocab.tgt_size, checkpoint, "target"))
    spec.validate()
    spec.optimize(quantization=quantization)
    out = out.absolute()  # -o . has no name to build a directory beside
    tmp = out.parent / f".{out.name}.new-{os.getpid()}"  # built beside DIR, swapped in whole when complete
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        spec.save(str(tmp))
        (tmp / "source.spm").write_bytes(src_bytes)
        (tmp / "target.spm").write_bytes(tgt_bytes)
        info = {"checkpoint": str(checkpoint), "ctranslate2": ct2.__version__, "quantization": quantization,
                "src_lang": config.data.src_lang, "tgt_lang": config.data.tgt_lang,
                "source_spm": "source.spm", "target_spm": "target.spm",
                "decode": {k: getattr(config.decode, k) for k in ("beam_size", "len_penalty", "max_len_a",
                                                                  "max_len_b")},
                # options of CTranslate2's translate_batch that search as nmtflow does: it never emits BOS or PAD
                # (an undertrained model may rank them first), and may return an empty translation
                "translate_batch": {"suppress_sequences": [[BOS_PIECE], [PAD_PIECE]], "min_decoding_length": 0},
                "note": "nmtflow's len_penalty is GNMT's ((5+|y|)/6)^a; CTranslate2's length_penalty divides by "
                        "|y|^a: equal only at 0"}
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failure(out, "the CTranslate2 model", exc) from None
    return out
