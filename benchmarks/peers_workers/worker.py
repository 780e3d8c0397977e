"""One system of ``benchmarks/peers.py``, run in its own process with its own environment's Python.

    python benchmarks/peers_workers/worker.py --system {nmtflow,marian,opennmt} --batches FILE.pt --spec FILE.json

``FILE.pt`` holds the id batches that ``peers.py`` made with nmtflow (``torch.load(..., weights_only=True)``):
``train`` = list of ``{"src", "tgt_in", "tgt_out"}`` int64 tensors (PAD 0 on the right, ``src`` = ids EOS,
``tgt_in`` = BOS ids, ``tgt_out`` = ids EOS), ``decode`` = list of ``{"src", "cap"}``, ``vocab_size`` and
``pieces`` (the SentencePiece pieces, id order). Every system uses the same ids: PAD 0, UNK 1, BOS 2, EOS 3.

The worker builds its model, answers ``{"ready": ...}`` and then serves one JSON command per stdin line, one
JSON answer per line on its original stdout (anything else a library prints goes to stderr):

* ``{"op": "train", "batches": [i, ...]}`` → ``{"seconds", "losses", "tokens"}``: one update per batch, each
  timed with ``time.perf_counter()`` around the update only;
* ``{"op": "decode", "batches": [i, ...]}`` → ``{"seconds", "lengths", "steps"}``: beam search per batch;
* ``{"op": "rss"}`` → ``{"peak_rss_mb"}``;  ``{"op": "quit"}`` ends the process.

The worker imports only torch and its own toolkit, so it runs in a peer's environment without nmtflow.
One update, for every system: forward, label-smoothed (ε from the spec) cross-entropy summed over the non-pad
target tokens and divided by their number, backward, ``clip_grad_norm_`` to the spec's norm, an Adam step
(β, ε and learning rate from the spec) and a step of the inverse-square-root schedule nmtflow uses. nmtflow
itself trains through ``benchmarks/throughput.py``'s ``Optimiser`` (which mirrors ``Trainer.train_step``),
the peers through :class:`TorchStep` below: the same arithmetic written with plain torch.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

PAD, UNK, BOS, EOS = 0, 1, 2, 3


def peak_rss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024


def inverse_sqrt(spec: dict) -> Callable[[int], float]:
    """nmtflow.train.optim.lr_lambda for ``inverse_sqrt``, restated so the peers need no nmtflow."""
    warmup = max(1, int(spec["warmup_updates"]))
    init = spec["warmup_init_lr"] / spec["lr"]

    def schedule(step: int) -> float:
        step = max(step, 1)
        if step < warmup:
            return init + (1.0 - init) * step / warmup
        return (warmup / step) ** 0.5

    return schedule


class TorchStep:
    """One update of a peer model: ``loss_fn(batch) -> (summed loss, target tokens)``, then as described above."""

    def __init__(self, model: Any, loss_fn: Callable[[dict], tuple[Any, int]], spec: dict) -> None:
        import torch
        self.torch, self.model, self.loss_fn, self.spec = torch, model, loss_fn, spec
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.Adam(self.params, lr=spec["lr"], betas=tuple(spec["adam_betas"]),
                                          eps=spec["adam_eps"], weight_decay=0.0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, inverse_sqrt(spec))

    def __call__(self, b: dict) -> float:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss, tokens = self.loss_fn(b)
        (loss / tokens).backward()
        params = [p for p in self.params if p.grad is not None]
        self.torch.nn.utils.clip_grad_norm_(params, self.spec["clip_norm"])
        self.optimizer.step()
        self.scheduler.step()
        return loss.item() / tokens


def smoothed_ce(logits: Any, target: Any, eps: float) -> tuple[Any, int]:
    import torch.nn.functional as F
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), target.reshape(-1), ignore_index=PAD,
                           label_smoothing=eps, reduction="sum")
    return loss, int(target.ne(PAD).sum())


def count_parameters(model: Any) -> int:
    """Distinct trainable parameters (as nmtflow counts them): a tied matrix once, fixed sinusoids not at all."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def versions(*names: str) -> dict[str, str]:
    from importlib import metadata
    out = {"python": sys.version.split()[0]}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


# ---- the systems: each has .model, .step(batch) -> loss/token, .decode(src, cap, forced) -> (lengths, steps)
class Nmtflow:
    def __init__(self, spec: dict, data: dict) -> None:
        import torch
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, for throughput.py
        from nmtflow.config import load_config
        from nmtflow.data.batching import Batch
        from nmtflow.decode.search import beam_search
        from nmtflow.models.base import Vocabularies, build_model
        from throughput import Optimiser
        self.Batch, self.beam_search, self.spec = Batch, beam_search, spec
        cfg = load_config(data={
            "model": {"name": "transformer", "preset": "small", "d_model": spec["d_model"], "heads": spec["heads"],
                      "ffn_dim": spec["ffn_dim"], "encoder_layers": spec["layers"], "decoder_layers": spec["layers"],
                      "dropout": spec["dropout"], "attention_dropout": spec["attention_dropout"],
                      "tie_embeddings": True},
            "data": {"path": spec["data_path"], "src_lang": spec["src"], "tgt_lang": spec["tgt"]},
            "train": {"seed": spec["seed"], "threads": spec["threads"], "label_smoothing": spec["label_smoothing"],
                      "clip_norm": spec["clip_norm"], "lr": spec["lr"], "adam_betas": list(spec["adam_betas"]),
                      "adam_eps": spec["adam_eps"], "warmup_updates": spec["warmup_updates"],
                      "warmup_init_lr": spec["warmup_init_lr"]}})
        v = data["vocab_size"]
        torch.manual_seed(spec["seed"])
        self.model = build_model(cfg.model, Vocabularies(v, v, joint=True))
        self.optimiser = Optimiser(self.model, cfg.train)
        self.versions = versions("nmtflow", "torch", "numpy", "sentencepiece")
        self.settings = {"model": "nmtflow transformer (pre-norm, final LayerNorms, one tied embedding)",
                         "training_step": "benchmarks/throughput.py Optimiser (= Trainer.train_step, one batch)",
                         "search": "nmtflow.decode.search.beam_search (incremental key/value cache)"}

    def step(self, b: dict) -> float:
        import torch
        batch = self.Batch(src=b["src"], tgt_in=b["tgt_in"], tgt_out=b["tgt_out"],
                           indices=torch.arange(b["src"].size(0)))
        return self.optimiser.step(batch)

    def decode(self, src: Any, cap: int, forced: bool) -> tuple[list[int], int]:
        self.model.eval()
        hyps = self.beam_search(self.model, src, beam_size=self.spec["beam"], len_penalty=self.spec["len_penalty"],
                                max_len_a=0.0, max_len_b=cap, min_len=cap if forced else 0)
        lengths = [len(h[0].tokens) for h in hyps]
        return lengths, max(lengths) + 1


class Marian:
    """HF transformers' MarianMTModel built from a MarianConfig (nothing is downloaded)."""

    def __init__(self, spec: dict, data: dict) -> None:
        import torch
        import transformers
        from transformers import GenerationConfig, MarianConfig, MarianMTModel
        transformers.logging.set_verbosity_error()
        self.spec, v = spec, data["vocab_size"]
        config = MarianConfig(
            vocab_size=v, d_model=spec["d_model"], encoder_layers=spec["layers"], decoder_layers=spec["layers"],
            encoder_attention_heads=spec["heads"], decoder_attention_heads=spec["heads"],
            encoder_ffn_dim=spec["ffn_dim"], decoder_ffn_dim=spec["ffn_dim"], dropout=spec["dropout"],
            attention_dropout=spec["attention_dropout"], activation_dropout=0.0, activation_function="relu",
            max_position_embeddings=spec["max_positions"], scale_embedding=True,
            share_encoder_decoder_embeddings=True, tie_word_embeddings=True, pad_token_id=PAD, eos_token_id=EOS,
            bos_token_id=BOS, decoder_start_token_id=BOS, forced_eos_token_id=EOS)
        torch.manual_seed(spec["seed"])
        self.model = MarianMTModel(config)
        eps = spec["label_smoothing"]

        def loss_fn(b: dict) -> tuple[Any, int]:
            out = self.model(input_ids=b["src"], attention_mask=b["src"].ne(PAD), decoder_input_ids=b["tgt_in"],
                             use_cache=False)
            return smoothed_ce(out.logits, b["tgt_out"], eps)

        self.step = TorchStep(self.model, loss_fn, spec)
        self.GenerationConfig = GenerationConfig
        self.versions = versions("transformers", "torch", "tokenizers", "safetensors", "huggingface-hub", "numpy")
        self.settings = {"model": "transformers.MarianMTModel(MarianConfig(...)): post-norm, sinusoidal positions, "
                                  "relu, one tied embedding",
                         "attn_implementation": getattr(config, "_attn_implementation", None),
                         "search": "model.generate(num_beams, early_stopping=True, length_penalty, "
                                   "max_new_tokens=cap+1, min_new_tokens=cap if forced, forced_eos_token_id, "
                                   "suppress_tokens=[PAD, BOS])"}

    def decode(self, src: Any, cap: int, forced: bool) -> tuple[list[int], int]:
        import torch
        self.model.eval()
        gc = self.GenerationConfig(
            num_beams=self.spec["beam"], num_return_sequences=1, do_sample=False, early_stopping=True,
            length_penalty=self.spec["len_penalty"], max_new_tokens=cap + 1, min_new_tokens=cap if forced else 0,
            decoder_start_token_id=BOS, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD,
            forced_eos_token_id=EOS, suppress_tokens=[PAD, BOS], use_cache=True)
        with torch.no_grad():
            seqs = self.model.generate(input_ids=src, attention_mask=src.ne(PAD), generation_config=gc)
        out = seqs[:, 1:]  # drop the decoder start token
        lengths = (out.ne(PAD) & out.ne(EOS) & out.ne(BOS)).sum(1).tolist()
        return lengths, int(out.size(1))


class OpenNMT:
    """OpenNMT-py's Transformer (onmt.model_builder.build_model from its own option parser) and its Translator."""

    def __init__(self, spec: dict, data: dict) -> None:
        import torch
        import onmt
        import onmt.opts
        import pyonmttok
        from onmt.constants import DefaultTokens
        from onmt.model_builder import build_model
        from onmt.translate import GNMTGlobalScorer, Translator
        from onmt.utils.parse import ArgumentParser
        self.spec = spec
        v = data["vocab_size"]
        # a vocabulary whose ids are nmtflow's: the four specials at nmtflow's ids, then the pieces in id order
        specials = [DefaultTokens.PAD, DefaultTokens.UNK, DefaultTokens.BOS, DefaultTokens.EOS]
        pieces = list(data.get("pieces") or [])
        names = specials + (pieces[4:v] if len(pieces) >= v else [f"｟id{i}｠" for i in range(4, v)])
        if len(set(names)) != v:
            names = specials + [f"｟id{i}｠" for i in range(4, v)]
        vocab = pyonmttok.Vocab(special_tokens=specials)
        for name in names[4:]:
            vocab.add_token(name)
        vocab.default_id = UNK
        if len(vocab) != v or any(vocab.lookup_token(t) != i for i, t in enumerate(names)):
            raise RuntimeError("could not build an OpenNMT-py vocabulary with nmtflow's ids")
        self.vocabs = {"src": vocab, "tgt": vocab, "decoder_start_token": DefaultTokens.BOS, "data_task": "seq2seq"}

        parser = ArgumentParser(description="peers.py")
        onmt.opts.model_opts(parser)
        onmt.opts.distributed_opts(parser)
        onmt.opts._add_train_general_opts(parser)
        argv = ["-data", "dummy", "-model_type", "text", "-encoder_type", "transformer", "-decoder_type",
                "transformer", "-position_encoding", "-enc_layers", str(spec["layers"]), "-dec_layers",
                str(spec["layers"]), "-hidden_size", str(spec["d_model"]), "-word_vec_size", str(spec["d_model"]),
                "-transformer_ff", str(spec["ffn_dim"]), "-heads", str(spec["heads"]), "-dropout",
                str(spec["dropout"]), "-attention_dropout", str(spec["attention_dropout"]), "-share_embeddings",
                "-share_decoder_embeddings", "-param_init", "0", "-param_init_glorot", "-label_smoothing",
                str(spec["label_smoothing"]), "-model_dtype", "fp32", "-max_relative_positions", "0"]
        opt, unknown = parser.parse_known_args(argv)
        if unknown:
            raise RuntimeError(f"OpenNMT-py did not know the options {unknown}")
        ArgumentParser.update_model_opts(opt)
        ArgumentParser.validate_model_opts(opt)
        self.opt = opt
        torch.manual_seed(spec["seed"])
        self.model = build_model(opt, opt, self.vocabs, None, 0)
        eps = spec["label_smoothing"]

        def loss_fn(b: dict) -> tuple[Any, int]:
            src = b["src"].unsqueeze(-1)  # (B, S, 1): OpenNMT-py's layout (one feature)
            tgt = torch.cat([b["tgt_in"][:, :1], b["tgt_out"]], dim=1).unsqueeze(-1)  # BOS ids EOS; model drops last
            dec_out, _ = self.model(src, tgt, b["src"].ne(PAD).sum(1), bptt=False, with_align=False)
            return smoothed_ce(self.model.generator(dec_out), b["tgt_out"], eps)

        self.step = TorchStep(self.model, loss_fn, spec)
        self.scorer = GNMTGlobalScorer(alpha=spec["len_penalty"], beta=0.0, length_penalty="wu",
                                       coverage_penalty="none")
        self.Translator = Translator
        self.versions = versions("OpenNMT-py", "torch", "pyonmttok", "ctranslate2", "numpy")
        self.settings = {"model": "onmt.model_builder.build_model: encoder/decoder_type transformer, "
                                  "position_encoding, share_embeddings + share_decoder_embeddings, glorot init",
                         "self_attn_type": getattr(opt, "self_attn_type", None),
                         "layer_norm": getattr(opt, "layer_norm", None),
                         "pos_ffn_activation_fn": getattr(opt, "pos_ffn_activation_fn", None),
                         "search": "onmt.translate.Translator(beam_size, min_length=cap if forced, "
                                   "max_length=cap+1, max_length_ratio=0, GNMTGlobalScorer(wu, alpha)).translate_batch"}

    def decode(self, src: Any, cap: int, forced: bool) -> tuple[list[int], int]:
        import torch
        self.model.eval()
        translator = self.Translator(self.model, self.vocabs, gpu=-1, n_best=1, min_length=cap if forced else 0,
                                     max_length=cap + 1, max_length_ratio=0.0, beam_size=self.spec["beam"],
                                     global_scorer=self.scorer, report_score=False, seed=-1)
        batch = {"src": src.unsqueeze(-1), "srclen": src.ne(PAD).sum(1)}
        with torch.no_grad():
            results = translator.translate_batch(batch, attn_debug=False)
        lengths, steps = [], 0
        for nbest in results["predictions"]:
            pred = nbest[0]
            lengths.append(int((pred.ne(EOS) & pred.ne(PAD) & pred.ne(BOS)).sum()))
            steps = max(steps, int(pred.numel()))
        return lengths, steps


SYSTEMS = {"nmtflow": Nmtflow, "marian": Marian, "opennmt": OpenNMT}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--system", choices=sorted(SYSTEMS), required=True)
    p.add_argument("--batches", type=Path, required=True)
    p.add_argument("--spec", type=Path, required=True)
    args = p.parse_args()
    reply = os.fdopen(os.dup(1), "w", buffering=1)  # answers go here; library prints go to stderr
    os.dup2(2, 1)

    def send(obj: dict) -> None:
        reply.write(json.dumps(obj) + "\n")
        reply.flush()

    try:
        spec = json.loads(args.spec.read_text(encoding="utf-8"))
        t0 = time.perf_counter()
        import torch
        torch.set_num_threads(spec["threads"])
        data = torch.load(args.batches, weights_only=True)
        system = SYSTEMS[args.system](spec, data)
        send({"ready": True, "startup_seconds": time.perf_counter() - t0,
              "parameters": count_parameters(system.model), "versions": system.versions,
              "settings": system.settings, "threads": torch.get_num_threads(), "peak_rss_mb": peak_rss_mb()})
        forced = spec["decode_lengths"] == "forced"
        for line in sys.stdin:
            cmd = json.loads(line)
            op = cmd["op"]
            if op == "train":
                seconds, losses, tokens = 0.0, [], 0
                for i in cmd["batches"]:
                    b = data["train"][i]
                    start = time.perf_counter()
                    losses.append(system.step(b))
                    seconds += time.perf_counter() - start
                    tokens += int(b["tgt_out"].ne(PAD).sum())
                send({"seconds": seconds, "losses": losses, "tokens": tokens})
            elif op == "decode":
                seconds, lengths, steps = 0.0, [], []
                for i in cmd["batches"]:
                    d = data["decode"][i]
                    src = d["src"][:cmd["limit"]] if cmd.get("limit") else d["src"]
                    src = src[:, :int(src.ne(PAD).sum(1).max())]  # no all-PAD columns (OpenNMT-py needs that)
                    start = time.perf_counter()
                    n, s = system.decode(src, int(d["cap"]), forced)
                    seconds += time.perf_counter() - start
                    lengths += n
                    steps.append(s)
                send({"seconds": seconds, "lengths": lengths, "steps": steps})
            elif op == "rss":
                send({"peak_rss_mb": peak_rss_mb()})
            elif op == "quit":
                send({"peak_rss_mb": peak_rss_mb()})
                break
            else:
                raise ValueError(f"unknown op {op!r}")
    except Exception:  # report to the driver, which prints it with the system's log
        send({"error": traceback.format_exc()})
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
