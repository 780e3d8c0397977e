"""The ``nmtflow`` command line. Each subcommand parses its arguments and calls into the package."""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

log = logging.getLogger("nmtflow")

COMMANDS: dict[str, Callable[[argparse.Namespace], int | None]] = {}


def command(fn: Callable[[argparse.Namespace], int | None]) -> Callable[[argparse.Namespace], int | None]:
    COMMANDS[fn.__name__.removeprefix("cmd_")] = fn
    return fn


# --------------------------------------------------------------------------------------------------
@command
def cmd_corpus(args: argparse.Namespace) -> None:
    from nmtflow.data.synthetic import generate_corpus

    counts = generate_corpus(args.out, langs=args.langs, n_train=args.train, n_valid=args.valid,
                             n_test=args.test, seed=args.seed, force=args.force)
    print(f"wrote {args.out}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))


def _named_prefixes(values: list[str], option: str, taken: dict[str, str]) -> dict[str, str]:
    """``NAME=PREFIX`` arguments → {name: prefix}; a name twice, or one in ``taken`` (name → its option), is an error."""
    named: dict[str, str] = {}
    for extra in values:
        name, eq, prefix = extra.partition("=")
        if not (eq and name and prefix):
            raise ValueError(f"{option} {extra!r}: expected NAME=PREFIX, e.g. {option} test2=corpus/newstest2014")
        if name in taken or name in named:
            where = taken.get(name, f"another {option}")
            raise ValueError(f"{option} {extra!r}: the {name} split is already given ({where})")
        named[name] = prefix
    return named


@command
def cmd_prepare(args: argparse.Namespace) -> None:
    from nmtflow.data.corpus import CleanConfig
    from nmtflow.data.prepare import add_splits, prepare

    if args.add:
        given = [f"--{o.replace('_', '-')}" for o in ("train", "valid", "test", "split", "langs", "force",
                                                       "tokenizer_from") if getattr(args, o)]
        if not args.byte_fallback:
            given.append("--no-byte-fallback")
        if given:
            raise ValueError(f"--add binarizes further splits with the tokenizers of --out; {', '.join(given)} "
                             "belong to a new preparation (leave them out)")
        meta = add_splits(args.out, _named_prefixes(args.add, "--add", {}))
        for split in dict.fromkeys(extra.partition("=")[0] for extra in args.add):
            print(f"{split}: {meta['splits'][split]['rows']} rows")
        print(f"added to {args.out} (tokenizers and the other splits unchanged)")
        return
    tokenizers = _checkpoint_tokenizers(args) if args.tokenizer_from else None
    langs = args.langs or (list(tokenizers) if tokenizers else None)
    if not (args.train and langs):
        raise ValueError("--train and --langs are required (or --add NAME=PREFIX to add splits to --out)")
    splits = {"train": args.train}
    if args.valid:
        splits["valid"] = args.valid
    if args.test:
        splits["test"] = args.test
    splits.update(_named_prefixes(args.split or [], "--split", {name: f"--{name}" for name in splits}))
    for flag, value, least in (("--max-len", args.max_len, 1), ("--max-ratio", args.max_ratio, 1),
                               ("--workers", args.workers, 1)):
        if not value >= least:  # NaN too
            raise ValueError(f"{flag} must be >= {least}, got {value}")
    vocab_size = DEFAULT_VOCAB_SIZE if args.vocab_size is None else args.vocab_size
    meta = prepare(splits, langs, Path(args.out), vocab_size=vocab_size, joint=not args.separate_vocab,
                   clean=CleanConfig(max_len=args.max_len, max_ratio=args.max_ratio), lang_tags=args.lang_tags,
                   workers=args.workers, replace_other=args.force, byte_fallback=args.byte_fallback,
                   tokenizers=tokenizers)
    for split, info in meta["splits"].items():
        print(f"{split}: {info['rows']} rows" + (f" ({info['dropped']} dropped by cleaning)" if info.get("dropped") else ""))
    for name, size in {meta["tokenizers"][lang]: meta["vocab_size"][lang] for lang in meta["langs"]}.items():
        if size < vocab_size and not tokenizers:  # SentencePiece stopped early: the training text has no more merges
            print(f"nmtflow prepare: note: {name} has {size} pieces, fewer than --vocab-size {vocab_size} "
                  "(the training data yields no more)", file=sys.stderr)
    print(f"prepared data in {args.out}")


DEFAULT_VOCAB_SIZE = 8000  # prepare --vocab-size


def _checkpoint_tokenizers(args: argparse.Namespace) -> dict[str, Any]:
    """``prepare --tokenizer-from CKPT``: language → the checkpoint's SentencePiece model (checked), for the
    languages of ``--langs`` (default: all of the checkpoint's)."""
    from nmtflow.checkpoint import checkpoint_tokenizers, load_checkpoint
    from nmtflow.data.tokenizer import Tokenizer

    given = [f"--{o.replace('_', '-')}" for o in ("vocab_size", "separate_vocab", "lang_tags")
             if getattr(args, o) not in (None, False)] + ([] if args.byte_fallback else ["--no-byte-fallback"])
    if given:
        raise ValueError(f"--tokenizer-from uses the checkpoint's SentencePiece models as they are; {', '.join(given)} "
                         "belong to learning new ones (leave them out)")
    path = args.tokenizer_from
    models = checkpoint_tokenizers(load_checkpoint(path), path)
    unknown = [lang for lang in args.langs or [] if lang not in models]
    if unknown:
        raise ValueError(f"--langs {' '.join(unknown)}: {path} has no tokenizer for {', '.join(unknown)} (its "
                         f"languages: {', '.join(models)})")
    return {lang: Tokenizer.from_bytes(models[lang], path, what=f"its {lang} SentencePiece model")
            for lang in args.langs or models}


def _term_as_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


@command
def cmd_train(args: argparse.Namespace) -> int:
    """``nmtflow train``; SIGTERM stops it as Ctrl-C does, in set-up too (the loop saves first)."""
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _term_as_interrupt) if main_thread else None
    try:
        return _train(args)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)


def _train(args: argparse.Namespace) -> int:
    from nmtflow.config import load_config
    from nmtflow.train.multilingual import trainer_for

    config = load_config(args.config, args.set)
    if args.save_dir:
        config.train.save_dir = args.save_dir
    if args.data:
        config.data.path = args.data
    if args.init_from:
        config.train.init_from = args.init_from
    result = trainer_for(config, resume=not args.restart).train()
    if int(os.environ.get("RANK", "0")) == 0:  # torchrun: one line, not one per process
        print(f"{result.progress.stopped}; checkpoints in {result.save_dir}")
    return 130 if result.progress.stopped.startswith("interrupted") else 0  # scripts can tell a stop from the end


@command
def cmd_average(args: argparse.Namespace) -> None:
    from nmtflow.checkpoint import average_checkpoints, is_training_checkpoint_name, periodic_checkpoints, save_atomic

    paths = [Path(p) for p in args.checkpoints]
    missing = next((p for p in paths if not p.exists()), None)
    if missing is not None:
        raise ValueError(f"{missing}: no such checkpoint or save dir")
    if args.last is not None and args.last < 1:
        raise ValueError(f"--last: must be >= 1, got {args.last}")
    if len(paths) == 1 and paths[0].is_dir():
        found = periodic_checkpoints(paths[0])
        if not found:
            raise ValueError(f"{paths[0]}: no checkpoint_UPDATE.pt files to average")
        paths = found[-(args.last or 5):]
    elif args.last is not None:
        raise ValueError(f"--last {args.last} picks from a save dir's periodic checkpoints; with checkpoint files "
                         "given, every one is averaged (leave out --last, or give the save dir)")
    _refuse_overwrite(args.output, {f"checkpoint {p}": p for p in paths}, "average")
    if is_training_checkpoint_name(Path(args.output).name):
        raise ValueError(f"-o {args.output}: a name training gives its own checkpoints (checkpoint_last.pt resumes a "
                         "run, checkpoint_UPDATE.pt are what --last averages); name the average otherwise, e.g. "
                         f"{Path(args.output).with_name('averaged.pt')}")
    save_atomic(average_checkpoints(paths, allow_different_runs=args.allow_different_runs), args.output)
    print(f"averaged {len(paths)} checkpoints ({', '.join(str(p) for p in paths)}) into {args.output}")


def _translator(args: argparse.Namespace):
    from nmtflow.decode.ensemble import open_translators
    from nmtflow.train.trainer import resolve_device

    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads {args.threads}: must be >= 1")
    translator = open_translators(args.checkpoint, resolve_device(args.device), args.src_lang, args.tgt_lang)
    d = translator.decode
    for field, value in (("beam_size", args.beam), ("nbest", args.nbest), ("len_penalty", args.lenpen),
                         ("max_len_a", args.max_len_a), ("max_len_b", args.max_len_b),
                         ("max_tokens", args.batch_tokens), ("min_len", args.min_len),
                         ("temperature", args.temperature), ("top_k", args.top_k), ("top_p", args.top_p),
                         ("seed", args.seed), ("precision", args.precision), ("workers", args.workers)):
        if value is not None:
            setattr(d, field, value)
    if args.greedy:
        d.greedy = True
    if args.sampling:
        d.sampling = True
    if not d.sampling:
        _refuse(args, SAMPLING_OPTIONS, "applies to sampling only: add --sampling")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    return translator


def _same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name one file (through links too; paths of files not yet there by their real paths)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _refuse_overwrite(output: str | None, inputs: dict[str, str | Path | None], what: str, *,
                      text: bool = False) -> None:
    """A ValueError when ``-o output`` names one of the ``inputs`` (option → path): writing ``what`` there would
    replace the file being read; with ``text`` (``what`` is lines of text) also when it names any PyTorch file,
    e.g. another run's checkpoint_last.pt."""
    if output is None:
        return
    for option, path in inputs.items():
        if path is not None and str(path) != "-" and _same_file(output, path):
            raise ValueError(f"-o {output}: is the {option} file; writing the {what} there would replace it "
                             "(give -o another file)")
    if text and os.path.isfile(output):
        from nmtflow.checkpoint import TORCH_MAGIC

        try:
            with open(output, "rb") as handle:
                magic = handle.read(4)
        except OSError:  # unreadable: writing it says why
            return
        if magic == TORCH_MAGIC:  # a checkpoint, not text to replace
            raise ValueError(f"-o {output}: holds a PyTorch checkpoint; writing the {what} there would destroy it "
                             "(give -o another file)")


def _read_lines(path: str) -> list[str]:
    from nmtflow.data.corpus import read_lines

    return read_lines(path)


def _stdin_lines():
    """stdin line by line, each as it arrives; invalid UTF-8 is a CorpusError naming ``<stdin>`` and the line."""
    from nmtflow.data.corpus import CorpusError, cr_ended, cr_ended_error

    stream = getattr(sys.stdin, "buffer", None)
    if stream is None:  # a replaced text stream
        yield from sys.stdin
        return
    for n, raw in enumerate(stream, 1):
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CorpusError("<stdin>", f"invalid UTF-8 at byte offset {exc.start} of the line ({exc.reason})",
                              line=n) from None
        if n == 1 and not raw.endswith(b"\n") and cr_ended(text):  # all of stdin is one line
            raise cr_ended_error("<stdin>", text)
        yield text


@contextlib.contextmanager
def _progress_bar(translator: Any, total: int | None, *, to_stdout: bool) -> Iterator[None]:
    """A bar on stderr while ``total`` sentences are translated: only where stderr is a terminal and the
    translations are not written (``to_stdout``) to that terminal as they come."""
    from tqdm import tqdm

    show = total is not None and sys.stderr.isatty() and not (to_stdout and sys.stdout.isatty())
    with tqdm(total=total, desc="translate", unit=" sent", disable=not show, leave=False, dynamic_ncols=True) as bar:
        translator.progress = bar.update if show else None
        try:
            yield
        finally:
            translator.progress = None


@command
def cmd_translate(args: argparse.Namespace) -> int | None:
    from nmtflow.decode.translate import check_search, output_file

    args.input, args.output = (None if path == "-" else path for path in (args.input, args.output))  # stdin, stdout
    _refuse_overwrite(args.output, {"-i": args.input, "--prefix": args.prefix,
                                    **{f"checkpoint {path}": path for path in args.checkpoint}}, "translations",
                      text=True)
    translator = _translator(args)
    check_search(translator.decode)  # before any input is read: an interactive session fails at once
    interactive = args.input is None and sys.stdin.isatty()
    total = None
    prefixes = None if args.prefix is None else _read_lines(args.prefix)
    aligned = {"prefixes": prefixes, "prefix_name": args.prefix}
    if args.input is not None:  # read (and check) the whole input before any output is written
        lines = _read_lines(args.input)
        total = len(lines)
        if prefixes is not None and len(prefixes) != total:
            raise ValueError(f"{args.prefix} has {len(prefixes)} lines but {args.input} has {total} (--prefix: one "
                             "prefix per input line, an empty line for none)")
        results = translator.translate_stream(lines, chunk=1000, name=args.input, **aligned)
    else:
        if interactive:
            print("nmtflow: type a sentence and press Enter (Ctrl-D to quit)", file=sys.stderr)
        results = translator.translate_stream(_stdin_lines(), chunk=1 if interactive or args.unbuffered else 1000,
                                              **aligned)
    written, interrupted = 0, False
    bar = _progress_bar(translator, total, to_stdout=args.output is None)
    with output_file(args.output) as out, bar:  # stdout without -o
        try:
            for n, nbest in enumerate(results):
                if translator.decode.nbest > 1:
                    for text, score in nbest:
                        out.write(f"{n}\t{score:.4f}\t{text}\n")
                else:
                    out.write(nbest[0][0] + "\n")
                written = n + 1
                if interactive or args.unbuffered:
                    out.flush()
        except KeyboardInterrupt:
            if args.input is not None:  # a file's translation cut short: -o keeps its previous contents
                raise
            interrupted = True  # read from stdin: what was translated so far is kept, in -o too
    if interrupted:
        print(f"interrupted: {written} translation(s) written" + (f" to {args.output}" if args.output else ""),
              file=sys.stderr)
        return 130
    return None


SAMPLING_OPTIONS = ("temperature", "top_k", "top_p", "seed")
SEARCH_OPTIONS = ("beam", "nbest", "greedy", "lenpen", "max_len_a", "max_len_b", "min_len", "sampling", "workers",
                  *SAMPLING_OPTIONS)


def _refuse(args: argparse.Namespace, options: Iterable[str], why: str) -> None:
    """A ValueError naming the first of ``options`` given on the command line (they would be silently ignored)."""
    given = [o for o in options if getattr(args, o, None) not in (None, False, [])]
    if given:
        flag = "-o" if given[0] == "output" else "--" + given[0].replace("_", "-")
        raise ValueError(f"{flag}: {why}")


@command
def cmd_evaluate(args: argparse.Namespace) -> None:
    from nmtflow.config import BLEU_TOKENIZER, check_tokenizer
    from nmtflow.evaluate.metrics import DEFAULT_METRICS, check_metrics, corpus_scores, warn_not_nfc

    if args.perplexity:
        _refuse(args, ("hyp", "src", "ref", "output", "metrics", "tokenize", "lowercase", *SEARCH_OPTIONS),
                "does not apply to --perplexity (teacher-forced scoring of --data's split; nothing is translated)")
        return _evaluate_perplexity(args)
    metrics = args.metrics or DEFAULT_METRICS
    if args.tokenize not in (None, BLEU_TOKENIZER) and "bleu" not in metrics:
        raise ValueError("--tokenize: sets BLEU's tokenizer, but --metrics has no bleu")
    for option, check, value in (("--metrics", check_metrics, metrics),
                                 ("--tokenize", check_tokenizer, args.tokenize or BLEU_TOKENIZER)):
        try:
            check(value)  # before anything is translated
        except ValueError as exc:
            raise ValueError(f"{option}: {exc}") from None
    _refuse(args, ("data",), "is for --perplexity; BLEU and chrF score --hyp, or CHECKPOINT's translations of --src")
    if args.hyp:
        _refuse(args, SEARCH_OPTIONS, "--hyp scores a file of translations: nothing is searched")
    if args.nbest is not None and args.nbest > 1:
        raise ValueError(f"--nbest {args.nbest}: evaluate scores one translation per sentence (use translate --nbest)")
    if not args.ref:
        raise ValueError("evaluate needs --ref FILE (or --perplexity CKPT --data DIR)")
    if args.hyp and (args.checkpoint or args.src or args.output):  # else one of the two would be silently ignored
        raise ValueError("--hyp scores a file of translations; CHECKPOINT, --src and -o translate --src instead: "
                         "give one or the other")
    if not (args.hyp or (args.checkpoint and args.src)):
        raise ValueError("evaluate needs --hyp FILE, or a CHECKPOINT with --src FILE")
    _refuse_overwrite(args.output, {"--src": args.src, **{f"--ref {path}": path for path in args.ref},
                                    **{f"checkpoint {path}": path for path in args.checkpoint}}, "translations",
                      text=True)
    refs = [_read_lines(path) for path in args.ref]
    lines = _read_lines(args.hyp or args.src)
    for path, stream in zip(args.ref, refs):
        if len(lines) != len(stream):  # before any translation
            raise ValueError(f"{args.hyp or args.src} has {len(lines)} lines but {path} has {len(stream)}")
    if not lines:
        raise ValueError(f"{args.ref[0]} is empty: no sentences to score")
    for path, stream in zip([*args.ref, args.hyp], [*refs, lines]):
        if path:
            warn_not_nfc(stream, path)
    if args.hyp:
        hyps = lines
    else:
        from nmtflow.decode.translate import output_file

        translator = _translator(args)
        with _progress_bar(translator, len(lines), to_stdout=False):
            hyps = [nb[0][0] for nb in translator.translate(lines, name=args.src)]
        if args.output:
            with output_file(args.output) as out:
                out.write("".join(h + "\n" for h in hyps))
    scores = corpus_scores(hyps, refs, metrics, tokenize=args.tokenize or BLEU_TOKENIZER, lowercase=args.lowercase)
    if args.json:
        print(json.dumps({s.name: {"score": round(s.score, 2), "signature": s.signature} for s in scores}))
    else:
        for s in scores:
            print(s)


def _evaluate_perplexity(args: argparse.Namespace) -> None:
    from nmtflow.evaluate.perplexity import checkpoint_perplexity
    from nmtflow.train.trainer import resolve_device

    if not (args.checkpoint and args.data):
        raise ValueError("evaluate --perplexity needs a CHECKPOINT and --data DIR (a prepared directory)")
    result = checkpoint_perplexity(args.checkpoint, args.data, args.split, max_tokens=args.batch_tokens,
                                   device=resolve_device(args.device), src_lang=args.src_lang, tgt_lang=args.tgt_lang)
    if args.json:  # a diverged model's inf perplexity as null
        from nmtflow.evaluate.metrics import json_safe

        print(json.dumps(json_safe(result)))
    else:
        print(f"perplexity = {result['ppl']:.2f}  (nll {result['nll']:.4f} nats/token over {result['tokens']} "
              f"tokens, {result['sentences']} sentences of {args.split}, {result['direction']})")


@command
def cmd_score(args: argparse.Namespace) -> None:
    _refuse(args, SEARCH_OPTIONS, "score computes log P(translation | source) of given translations: nothing is "
            "searched")
    if args.batch_tokens is not None and args.batch_tokens < 1:  # as translate says it
        raise ValueError(f"--batch-tokens {args.batch_tokens} (decode.max_tokens): must be >= 1")
    if args.candidates and (args.src or args.tgt):  # else --src/--tgt would be silently ignored
        raise ValueError("--candidates scores its own sources and translations; leave out --src and --tgt "
                         "(or --candidates)")
    if args.candidates:
        from nmtflow.decode.contrastive import contrastive_accuracy, read_candidates

        rows = read_candidates(args.candidates)  # checked before the model is loaded
        result = contrastive_accuracy(_translator(args), args.candidates, rows)
        print(json.dumps(result) if args.json else
              f"contrastive accuracy {result['accuracy']:.4f} ({result['correct']}/{result['total']})")
        return
    if not (args.src and args.tgt):
        raise ValueError("score needs --src FILE --tgt FILE, or --candidates FILE")
    src, tgt = _read_lines(args.src), _read_lines(args.tgt)  # (checked before the model is loaded)
    if len(src) != len(tgt):
        raise ValueError(f"{args.src} has {len(src)} lines but {args.tgt} has {len(tgt)}")
    scores = _translator(args).score(src, tgt, files=(args.src, args.tgt))
    if args.json:  # one JSON list: log P(target | source) of each line, in order (NaN as null)
        from nmtflow.evaluate.metrics import json_safe

        print(json.dumps(json_safe(scores)))
        return
    for lp in scores:
        print(f"{lp:.4f}")


@command
def cmd_info(args: argparse.Namespace) -> None:
    from nmtflow.config import load_config
    from nmtflow.models.base import Vocabularies, build_model, count_parameters, parameters_by_module

    from nmtflow.data.vocab import NUM_SPECIAL

    if args.vocab_size <= NUM_SPECIAL:
        raise ValueError(f"--vocab-size {args.vocab_size}: must be > {NUM_SPECIAL} (the special pieces <pad>, <unk>, "
                         "<s>, </s>, and at least one more)")
    config = load_config(args.config, args.set)
    model = build_model(config.model, Vocabularies(args.vocab_size, args.vocab_size, joint=True))
    info = {"model": config.model.name, "parameters": count_parameters(model),
            "modules": parameters_by_module(model)}
    if args.json:
        print(json.dumps({"parameters": info["parameters"], "modules": info["modules"]}))
        return
    print(f"model: {info['model']} (vocabulary {args.vocab_size}, joint)")
    for name, n in info["modules"].items():
        print(f"  {name:<20} {n:>14,}")
    print(f"  {'total':<20} {info['parameters']:>14,}")


@command
def cmd_export(args: argparse.Namespace) -> None:
    from nmtflow.decode.export import QUANTIZATIONS, TARGETS, export_ctranslate2

    if args.to not in TARGETS:
        raise ValueError(f"--to {args.to}: unknown export target; expected one of: {', '.join(TARGETS)}")
    if args.quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization {args.quantization}: expected one of {', '.join(QUANTIZATIONS)}")
    out = export_ctranslate2(args.checkpoint, args.output, quantization=args.quantization, force=args.force)
    print(f"wrote {out} (CTranslate2, {args.quantization}): ctranslate2.Translator({str(out)!r}) translates "
          "pieces of its source.spm into pieces of its target.spm; its nmtflow.json gives the translate_batch "
          "options that search as nmtflow does")


@command
def cmd_analyze(args: argparse.Namespace) -> None:
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {args.out}: a file, not a directory (every analysis writes a directory of files)")
    for parent in out.parents:  # a file on the way makes mkdir fail with a bare errno
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"--out {args.out}: {parent} is a file, not a directory")
    if args.analysis == "attention":
        return _analyze_attention(args)
    if args.analysis in ("length-bleu", "bridge-attention", "bridge-entropy"):
        return _analyze_bridge(args)
    from nmtflow.analysis.probes import ProbeConfig, run_probes
    from nmtflow.analysis.report import layer_table
    from nmtflow.analysis.similarity import SimilarityConfig, run_similarity
    from nmtflow.train.trainer import resolve_device

    common = dict(split=args.split, labels=args.labels, device=resolve_device(args.device))
    limits = dict(max_sentences=args.max_sentences, max_tokens=args.batch_tokens, seed=args.seed)
    if args.analysis == "probe":
        cfg = ProbeConfig(epochs=args.epochs, holdout=args.holdout, **limits)
        result = run_probes(args.checkpoints, args.data, args.out, cfg=cfg, **common)
    else:
        result = run_similarity(args.checkpoints, args.data, args.out, cfg=SimilarityConfig(**limits), **common)
    print(f"{result['metric']} per layer (E = embeddings):")
    print(layer_table({label: {s: m[s] for s in ("encoder", "decoder")} for label, m in result["models"].items()}))
    print("wrote " + ", ".join(result["files"]))


def _analyze_attention(args: argparse.Namespace) -> None:
    from nmtflow.analysis.attention_maps import run_attention_analysis
    from nmtflow.train.trainer import resolve_device

    files = run_attention_analysis(args.checkpoint, args.out, src=args.src, tgt=args.tgt, data=args.data,
                                   split=args.split, max_sentences=args.max_sentences, max_tokens=args.batch_tokens,
                                   device=resolve_device(args.device), src_lang=args.src_lang,
                                   tgt_lang=args.tgt_lang)
    print(f"wrote {len(files)} files to {args.out}")


def _analyze_bridge(args: argparse.Namespace) -> None:
    """BLEU by source length, bridge heat maps, bridge head entropy (SPEC §5; nmtflow/analysis/bridge.py)."""
    from nmtflow.analysis import bridge
    from nmtflow.train.trainer import resolve_device

    common = dict(src_lang=args.src_lang, labels=args.labels, device=resolve_device(args.device))
    if args.analysis == "length-bleu":
        result = bridge.run_length_bleu(args.checkpoints, args.src, args.ref, args.out, tgt_lang=args.tgt_lang,
                                        buckets=args.buckets, beam_size=args.beam, greedy=args.greedy,
                                        max_tokens=args.batch_tokens, max_sentences=args.max_sentences, **common)
        print(f"BLEU by source length in words (sentences), {result['sentences']} sentences of {args.src}:")
        print(bridge.length_table(result))
    elif args.analysis == "bridge-attention":
        result = bridge.run_bridge_heat_maps(args.checkpoints, args.sentence, args.out, **common)
        for label, m in result["models"].items():
            print(f"{label}: A is {len(m['attention'])} heads × {len(m['tokens'])} source positions")
    else:
        result = bridge.run_head_entropy(args.checkpoints, args.src, args.out, max_sentences=args.max_sentences,
                                         max_words=args.max_words, max_tokens=args.batch_tokens, **common)
        print(f"mean bridge-head entropy (nats) over {result['sentences']} sentences; n = source positions:")
        print(bridge.entropy_table(result))
    print("wrote " + ", ".join(result["files"]))


def _embedder(args: argparse.Namespace):
    """(sentences, language) → embeddings of a checkpoint (SPEC §5): a multilingual one in any of its languages, a
    bilingual one in its source language (a bilingual bridge's M, or another encoder's mean states)."""
    from nmtflow.analysis.embeddings import sentence_embeddings
    from nmtflow.checkpoint import load_checkpoint
    from nmtflow.decode.multilingual import MultilingualCheckpoint, is_multilingual, load_multilingual
    from nmtflow.decode.translate import Translator
    from nmtflow.train.trainer import resolve_device

    saved = load_checkpoint(args.checkpoint)
    if is_multilingual(saved):
        ckpt = load_multilingual(args.checkpoint, resolve_device(args.device), ckpt=saved)
    else:
        translator = Translator.from_checkpoint(args.checkpoint, resolve_device(args.device), ckpt=saved)
        ckpt = MultilingualCheckpoint.source_side(translator, (saved.get("langs") or {}).get("src") or "src")
    for option in ("lang", "test_lang", "lang2"):  # checked before any file is read or embedded
        lang = getattr(args, option, None)
        if lang is not None and lang not in ckpt.tokenizers:
            raise ValueError(f"--{option.replace('_', '-')} {lang}: {args.checkpoint} has no language {lang!r} "
                             f"(its languages: {', '.join(ckpt.tokenizers)})")

    def embed(lines: list[str], lang: str, **where: Any) -> Any:
        return sentence_embeddings(ckpt, lang, lines, pooling=args.pooling, max_tokens=args.batch_tokens, **where)

    return embed


@command
def cmd_serve(args: argparse.Namespace) -> None:
    try:
        from nmtflow.serve.app import create_app, load_models, serve
    except ImportError as exc:
        raise ValueError(f"serve needs the serve extra: pip install 'nmtflow[serve]' ({exc})") from None

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: expected 0-65535")
    models = load_models(args.checkpoints, args.name, device=args.device, ensemble=args.ensemble,
                         precision=args.precision)
    app = create_app(models, max_sentences=args.max_sentences, max_chars=args.max_chars,
                     max_batch_tokens=args.max_batch_tokens)
    serve(app, args.host, args.port)


@command
def cmd_embed(args: argparse.Namespace) -> None:
    import numpy as np

    vectors = _embedder(args)(_read_lines(args.input), args.lang, name=args.input)
    output = args.output if args.output.endswith(".npy") else args.output + ".npy"  # what np.save writes
    Path(output).parent.mkdir(parents=True, exist_ok=True)  # as every analyze command does for its --out
    np.save(output, vectors)
    print(f"wrote {output}: {vectors.shape[0]} sentences × {vectors.shape[1]} ({args.pooling} pooling)")


@command
def cmd_downstream(args: argparse.Namespace) -> None:
    from nmtflow.analysis import downstream

    embed = _embedder(args)
    if args.task == "classify":
        result = downstream.classification(embed, args.train, args.lang, args.test, args.test_lang, l2=args.l2)
        line = (f"accuracy {result['accuracy']:.4f} on {result['test_examples']} {result['test_lang']} examples "
                f"(probe trained on {result['train_examples']} {result['train_lang']} examples, "
                f"train accuracy {result['train_accuracy']:.4f})")
    else:
        result = downstream.similarity(embed, args.data, args.lang, args.lang2)
        line = (f"pearson {result['pearson']:.4f} | spearman {result['spearman']:.4f} "
                f"({result['examples']} pairs, {result['lang']}–{result['lang2']})")
    print(json.dumps(result) if args.json else line)


@command
def cmd_quickstart(args: argparse.Namespace) -> None:
    from nmtflow.quickstart import run_quickstart

    run_quickstart(Path(args.workdir), minutes=args.minutes, threads=args.threads)


@command
def cmd_compare(args: argparse.Namespace) -> None:
    from nmtflow.evaluate.compare import run_comparison

    only = [n.strip() for n in args.only.split(",") if n.strip()] if args.only is not None else None
    if only == []:
        raise ValueError(f"--only {args.only!r}: name one or more runs of the experiment, e.g. --only NAME,NAME")
    if args.status:
        from nmtflow.evaluate.compare_status import show_status

        print(show_status(args.experiment, out=args.out, overrides=args.set, only=only))
        return
    result = run_comparison(args.experiment, out=args.out, overrides=args.set, plugins=args.plugin, only=only)
    print(result.table)
    print(f"results: {result.out / 'results.md'}")
    if result.failed:
        raise ValueError(f"{len(result.failed)} run(s) failed ({', '.join(result.failed)}); see "
                         f"{result.out / 'results.md'}; rerun the same command to retry them")
    if result.busy:
        raise ValueError(f"{len(result.busy)} run(s) not started ({', '.join(result.busy)}): another process is "
                         "training them (another nmtflow compare of this --out?); run the same command again when it "
                         "has ended")


# --------------------------------------------------------------------------------------------------
def _decode_options(p: argparse.ArgumentParser) -> None:
    from nmtflow.config import DECODE_PRECISIONS

    p.add_argument("checkpoint", nargs="*" if p.prog.endswith("evaluate") else "+",
                   help="a checkpoint (.pt); several: an ensemble (their probabilities averaged)")
    p.add_argument("--beam", type=int, help="beam size (default: the config's, 5)")
    p.add_argument("--nbest", type=int,
                   help="hypotheses per input, at most --beam, best first; above 1 printed as INDEX<TAB>SCORE<TAB>TEXT "
                        "(INDEX: 0-based input line; SCORE: length-normalised log-probability); exactly NBEST lines per "
                        "input (distinct piece sequences, which may detokenise alike) unless fewer fit its length "
                        "limit (a vocabulary of a few pieces); an empty input gets one, the empty translation, score 0")
    p.add_argument("--greedy", action="store_true", help="greedy search (one hypothesis: no --nbest above 1)")
    p.add_argument("--sampling", action="store_true",
                   help="draw each output token at random instead of searching (back-translation); --nbest N: N "
                        "independent samples per input, in the order drawn, SCORE their log-probability")
    p.add_argument("--temperature", type=float, help="sampling: divide the log-probabilities by T (default 1.0)")
    p.add_argument("--top-k", type=int, help="sampling: only from the K most likely tokens (default 0: all)")
    p.add_argument("--top-p", type=float,
                   help="sampling: only from the nucleus, the fewest most likely tokens of mass >= P (default 1.0: all)")
    p.add_argument("--seed", type=int, help="sampling: the same seed draws the same samples (default: a fresh seed)")
    p.add_argument("--lenpen", type=float, help="GNMT length penalty alpha")
    p.add_argument("--max-len-a", type=float, help="output length limit a·|x| + b: a")
    p.add_argument("--max-len-b", type=int, help="output length limit a·|x| + b: b")
    p.add_argument("--min-len", type=int, help="no output ends before N tokens (the length limit wins; default 0)")
    p.add_argument("--batch-tokens", type=int, help="source tokens per decoding batch")
    p.add_argument("--precision", choices=DECODE_PRECISIONS,
                   help="fp32, or bf16: a bf16 copy of the weights, the output layer, log-softmax and scores in fp32 "
                        "(faster on CPUs with AMX or AVX-512 BF16 and on GPUs; default: the config's, fp32)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--threads", type=int, help="CPU threads")
    p.add_argument("--workers", type=int,
                   help="CPU decoding in N processes sharing the threads (faster than threads alone for small models "
                        "on few cores; not with --sampling; default 1)")
    p.add_argument("--src-lang", help="multilingual model: source language (any trained or zero-shot direction)")
    p.add_argument("--tgt-lang", help="multilingual model: target language")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nmtflow", description="Neural machine translation research on information flow.")
    parser.add_argument("--plugin", action="append", default=[], metavar="MODULE",
                        help="import MODULE first (to register your own models or attention variants)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("quickstart", help="generate the built-in corpus, train a small Transformer, translate, print BLEU")
    p.add_argument("--workdir", default="runs/quickstart", help="where everything is written (default: %(default)s)")
    p.add_argument("--minutes", type=float, default=6.0, help="training budget in minutes (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None)

    p = sub.add_parser("compare", help="train several configs under one budget; BLEU/chrF/speed/memory table + plots")
    p.add_argument("experiment", help="experiment file (experiments/*.yaml)")
    p.add_argument("--out", help="output directory (default: runs/compare-NAME); rerunning resumes it")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. data.path=DIR")
    p.add_argument("--only", metavar="NAME,NAME", help="train and report only these runs of the experiment")
    p.add_argument("--status", action="store_true", help="train nothing: show where each run stands (state, "
                   "updates of its budget, speed, time left, last validation BLEU per direction)")

    p = sub.add_parser("corpus", help="write the built-in synthetic multilingual corpus")
    p.add_argument("out")
    p.add_argument("--langs", nargs="+", default=["en", "de", "fr"])
    p.add_argument("--train", type=int, default=20000)
    p.add_argument("--valid", type=int, default=500)
    p.add_argument("--test", type=int, default=500)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--force", action="store_true", help="write over SPLIT.LANG files in OUT without a corpus.json "
                   "(a corpus of an earlier version); without it they are refused as someone's own")

    p = sub.add_parser("prepare", help="validate, clean, learn SentencePiece, binarize a parallel corpus")
    p.add_argument("--train", metavar="PREFIX", help="training files PREFIX.LANG (required unless --add)")
    p.add_argument("--valid", metavar="PREFIX")
    p.add_argument("--test", metavar="PREFIX")
    p.add_argument("--split", action="append", metavar="NAME=PREFIX", help="further splits")
    p.add_argument("--add", action="append", default=[], metavar="NAME=PREFIX",
                   help="binarize further splits (a new test set) into an existing --out with its tokenizers; "
                        "nothing else changes, so models trained on it can use the new split")
    p.add_argument("--langs", nargs="+", help="languages (required unless --add)")
    p.add_argument("--out", required=True,
                   help="the prepared directory: built beside it (.NAME.new-PID) and swapped in when complete, so a "
                        "failed or killed run leaves it as it was; one prepare at a time (.NAME.lock beside it); files "
                        "in it that prepare did not write are kept")
    p.add_argument("--force", action="store_true",
                   help="replace an --out prepared from other training files (without it, an error; one prepared from "
                        "the same files is replaced, with a note of what it held)")
    p.add_argument("--vocab-size", type=int, help=f"SentencePiece pieces to learn (default {DEFAULT_VOCAB_SIZE})")
    p.add_argument("--tokenizer-from", metavar="CKPT",
                   help="use the SentencePiece model(s) of this checkpoint instead of learning them (data to fine-tune "
                        "it on, train --init-from CKPT); --langs default to its languages")
    p.add_argument("--separate-vocab", action="store_true", help="one SentencePiece model per language")
    p.add_argument("--lang-tags", action="store_true", help="reserve <2xx> target-language tags")
    p.add_argument("--no-byte-fallback", dest="byte_fallback", action="store_false",
                   help="characters the training text lacks become <unk> (by default 256 of the --vocab-size pieces "
                        "are bytes that spell them, so any text round-trips)")
    p.add_argument("--max-len", type=int, default=250, help="cleaning: drop training rows longer than this (tokens)")
    p.add_argument("--max-ratio", type=float, default=3.0, help="cleaning: drop rows whose length ratio exceeds this")
    p.add_argument("--workers", type=int, default=1,
                   help="processes that encode with SentencePiece (output identical to 1; order preserved)")

    p = sub.add_parser("train", help="train (and resume) a model from a YAML config")
    p.add_argument("config")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override, e.g. train.max_updates=100")
    p.add_argument("--save-dir")
    p.add_argument("--data", help="prepared data directory (overrides data.path)")
    p.add_argument("--init-from", metavar="CKPT",
                   help="fine-tune: start a new run from this checkpoint's weights (optimiser, schedule, update count "
                        "and data position start afresh; sets train.init_from)")
    p.add_argument("--restart", action="store_true",
                   help="start afresh: ignore an existing checkpoint_last.pt and delete the earlier run's checkpoints "
                        "and TensorBoard events in the save dir")

    p = sub.add_parser("average", help="average checkpoints (a save dir's last N, or given files)")
    p.add_argument("checkpoints", nargs="+")
    p.add_argument("--last", type=int, help="with a save dir: average its last N periodic checkpoints (default 5)")
    p.add_argument("--allow-different-runs", action="store_true",
                   help="average checkpoints of different training runs too (a model soup); without it they are "
                        "an error, since the mean of independently trained models is far worse than each")
    p.add_argument("-o", "--output", required=True)

    p = sub.add_parser("translate", help="translate a file or stdin")
    _decode_options(p)
    p.add_argument("-i", "--input", help="input file (default or -: stdin, line by line)")
    p.add_argument("-o", "--output", help="output file (default or -: stdout)")
    p.add_argument("--unbuffered", action="store_true", help="translate and flush each stdin line at once")
    p.add_argument("--prefix", metavar="FILE",
                   help="target prefixes, one per input line (an empty line: none): each translation starts with its "
                        "line's prefix and the search continues after it")

    p = sub.add_parser("evaluate", help="sacreBLEU BLEU, chrF, chrF++, TER (of a file, or of a checkpoint's "
                       "translations)")
    _decode_options(p)
    p.add_argument("--hyp", help="hypotheses file")
    p.add_argument("--src", help="source file to translate with CHECKPOINT")
    p.add_argument("--ref", nargs="+", metavar="REF", help="reference file(s): several are references of the same "
                   "lines (multi-reference scores)")
    p.add_argument("--metrics", nargs="+", metavar="METRIC",
                   help="bleu, chrf, chrf++, ter (default: bleu chrf)")
    p.add_argument("--tokenize", help="sacreBLEU's BLEU tokenizer: 13a (default), intl, zh, char, "
                   "none, or one that needs extras or a download (ja-mecab, ko-mecab, spm, flores101, flores200, "
                   "spBLEU-1K)")
    p.add_argument("--lowercase", action="store_true", help="case-insensitive BLEU and chrF (TER always is)")
    p.add_argument("--perplexity", action="store_true",
                   help="instead: perplexity of CHECKPOINT on --data DIR --split NAME (teacher-forced)")
    p.add_argument("--data", help="prepared data directory, for --perplexity")
    p.add_argument("--split", default="valid", help="prepared split, for --perplexity")
    p.add_argument("-o", "--output", help="write the translations here")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("score", help="log-probabilities of given translations; contrastive accuracy")
    _decode_options(p)
    p.add_argument("--src")
    p.add_argument("--tgt")
    p.add_argument("--candidates", help="TSV: source, correct translation, incorrect translations…")
    p.add_argument("--json", action="store_true")

    from nmtflow.config import DECODE_PRECISIONS

    p = sub.add_parser("serve", help="an HTTP server: translate, score and explore the information flow of "
                                     "checkpoints in the browser (needs the serve extra)")
    p.add_argument("checkpoints", nargs="+", metavar="CKPT", help="checkpoints (.pt) served side by side")
    p.add_argument("--name", nargs="+", help="the models' names in the API (default: each file's stem, or its "
                                             "folder's name for checkpoint_*.pt)")
    p.add_argument("--ensemble", action="store_true", help="serve all checkpoints as one ensemble named 'ensemble'")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s, this machine "
                                                      "only; 0.0.0.0 opens it to the network)")
    p.add_argument("--port", type=int, default=8080, help="default: %(default)s")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--max-sentences", type=int, default=32, help="sentences per request (default: %(default)s)")
    p.add_argument("--max-chars", type=int, default=1000, help="characters per sentence (default: %(default)s)")
    p.add_argument("--max-batch-tokens", type=int, default=4000,
                   help="source tokens per decoding batch (default: %(default)s)")
    p.add_argument("--precision", choices=DECODE_PRECISIONS,
                   help="of translating and scoring: fp32, or bf16 (see translate --precision; the flow's maps "
                        "stay fp32; default: each checkpoint's decode.precision)")

    p = sub.add_parser("embed", help="sentence embeddings (a bridge's M, pooled; other encoders: mean states) → .npy")
    _embedding_options(p)
    p.add_argument("-i", "--input", required=True, help="sentences, one per line")
    p.add_argument("-o", "--output", required=True, help="output .npy: float32 (N, d_h) for mean, (N, k·d_h) for flat")

    p = sub.add_parser("downstream", help="sentence-embedding tasks: logistic-regression classification, "
                                          "cosine similarity vs gold scores")
    tasks = p.add_subparsers(dest="task", required=True, metavar="TASK")
    q = tasks.add_parser("classify", help="TSV sentence<TAB>label: probe trained on --train, accuracy on --test")
    _embedding_options(q)
    q.add_argument("--train", required=True, help="labelled training sentences (TSV) in --lang")
    q.add_argument("--test", required=True, help="labelled test sentences (TSV) in --test-lang")
    q.add_argument("--test-lang", help="language of --test (default --lang; another one: cross-lingual transfer)")
    q.add_argument("--l2", type=float, default=1e-3, help="L2 weight of the logistic regression")
    q.add_argument("--json", action="store_true")
    q = tasks.add_parser("similarity", help="TSV sentence1<TAB>sentence2<TAB>gold: Pearson/Spearman of the cosine")
    _embedding_options(q)
    q.add_argument("--data", required=True, help="the sentence pairs with gold scores (TSV)")
    q.add_argument("--lang2", help="language of the second sentences (default --lang)")
    q.add_argument("--json", action="store_true")

    p = sub.add_parser("info", help="parameters of a config's model, per top-level module")
    p.add_argument("config")
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser("export", help="convert a Transformer checkpoint for deployment (CTranslate2)")
    p.add_argument("checkpoint", help="a bilingual Transformer checkpoint (.pt)")
    p.add_argument("--to", required=True, metavar="TARGET", help="export format: ctranslate2")
    p.add_argument("-o", "--output", required=True, metavar="DIR", help="the model directory to write")
    p.add_argument("--quantization", default="float32", metavar="TYPE",
                   help="CTranslate2 weight type: float32 (default), int8, int8_float32, int8_float16, "
                        "int8_bfloat16, int16, float16, bfloat16")
    p.add_argument("--force", action="store_true", help="replace DIR if it is an earlier export (it holds nmtflow.json)")

    p = sub.add_parser("analyze", help="compare checkpoints layer by layer: lexical probes, similarity to E, gates")
    analyses = p.add_subparsers(dest="analysis", required=True, metavar="ANALYSIS")
    q = analyses.add_parser("probe", help="per-layer lexical probes: held-out accuracy of predicting each sub-word")
    _analysis_options(q)
    q.add_argument("--epochs", type=int, default=10, help="probe training epochs")
    q.add_argument("--holdout", type=float, default=0.2, help="share of the sentences held out for evaluation")
    q = analyses.add_parser("similarity", help="cosine similarity of each layer to the embeddings E; gate statistics")
    _analysis_options(q)
    q = analyses.add_parser("attention", help="attention heat maps (token-to-token | token-to-phrase halves) and "
                                              "the share of attention mass on phrases per layer")
    q.add_argument("checkpoint", metavar="CKPT", help="a checkpoint (.pt)")
    q.add_argument("--src", help="a source sentence to draw heat maps for")
    q.add_argument("--tgt", help="its target sentence (default: the model's translation of --src)")
    q.add_argument("--data", help="prepared data directory: phrase share per layer over --split (JSON)")
    q.add_argument("--split", default="valid", help="prepared split for --data")
    q.add_argument("--src-lang", help="multilingual checkpoints: source language")
    q.add_argument("--tgt-lang", help="multilingual checkpoints: target language")
    q.add_argument("--out", required=True, help="output directory (PNG heat maps, phrase_share.json)")
    q.add_argument("--max-sentences", type=int, help="use only the first N sentences of --split")
    q.add_argument("--batch-tokens", type=int, default=4000, help="tokens per batch through the model")
    q.add_argument("--device", default="auto", help="auto | cpu | cuda")
    q = analyses.add_parser("length-bleu", help="sacreBLEU per source-length bucket (words), one line per checkpoint")
    _bridge_analysis_options(q, "any models")
    q.add_argument("--tgt-lang", help="multilingual checkpoints: target language")
    q.add_argument("--src", required=True, help="source sentences, one per line")
    q.add_argument("--ref", required=True, help="reference translations, line-aligned with --src")
    q.add_argument("--buckets", nargs="+", metavar="LOW-HIGH|LOW+",
                   help="source-length buckets in words (default: 1-10 11-15 16-20 21-25 26+)")
    q.add_argument("--beam", type=int, help="beam size (default: each checkpoint's, 5)")
    q.add_argument("--greedy", action="store_true", help="greedy search")
    q.add_argument("--batch-tokens", type=int, help="source tokens per decoding batch")
    q.add_argument("--max-sentences", type=int, help="use only the first N lines of --src/--ref")
    q = analyses.add_parser("bridge-attention", help="heat maps of the attention bridge's A (k heads × source "
                                                     "tokens) for one sentence")
    _bridge_analysis_options(q, "attention-bridge models")
    q.add_argument("--sentence", required=True, help="the source sentence (in --src-lang)")
    q = analyses.add_parser("bridge-entropy", help="entropy of each bridge head over a file: all heads, heads with "
                                                   "index < sentence length, the rest")
    _bridge_analysis_options(q, "attention-bridge models")
    q.add_argument("--src", required=True, help="source sentences (in --src-lang), one per line")
    q.add_argument("--max-sentences", type=int, help="use only the first N (non-empty, short enough) lines")
    q.add_argument("--max-words", type=int, help="skip sentences longer than this (the paper: 40)")
    q.add_argument("--batch-tokens", type=int, default=4000, help="source tokens per batch")
    return parser


def _embedding_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", help="a multilingual checkpoint (.pt)")
    p.add_argument("--lang", required=True, help="language of the sentences (of the first sentences for similarity)")
    p.add_argument("--pooling", choices=("mean", "flat"), default="mean",
                   help="mean over the k rows of M (d_h values) or the flattened M (k·d_h values)")
    p.add_argument("--batch-tokens", type=int, default=6000, help="source tokens per batch")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")


def _bridge_analysis_options(p: argparse.ArgumentParser, models: str) -> None:
    p.add_argument("checkpoints", nargs="+", metavar="CKPT", help=f"checkpoints to compare ({models})")
    p.add_argument("--src-lang", help="multilingual checkpoints: source language")
    p.add_argument("--out", required=True, help="output directory for the JSON table and PNG plot")
    p.add_argument("--labels", nargs="+", help="names of the checkpoints in tables and plots")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")


def _analysis_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoints", nargs="+", metavar="CKPT", help="bilingual Transformer checkpoints to compare")
    p.add_argument("--data", required=True, help="prepared data directory (the checkpoints' vocabulary)")
    p.add_argument("--split", default="valid", help="prepared split to analyse")
    p.add_argument("--out", required=True, help="output directory for the JSON table and PNG plots")
    p.add_argument("--labels", nargs="+", help="names of the checkpoints in tables and plots")
    p.add_argument("--max-sentences", type=int, default=2000, help="sentences used (a seeded random choice)")
    p.add_argument("--batch-tokens", type=int, default=4000, help="tokens per batch through the frozen model")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S")
    from nmtflow.checkpoint import CheckpointError
    from nmtflow.config import ConfigError

    expected: tuple[type[BaseException], ...] = (ConfigError, CheckpointError, ValueError, OSError, KeyError)
    from nmtflow.runtime import keep_freed_memory

    keep_freed_memory()
    try:
        for module in args.plugin:
            sys.path.insert(0, os.getcwd())
            try:
                importlib.import_module(module)
            except ImportError as exc:
                print(f"nmtflow: error: --plugin {module}: {exc} (run from the directory that holds it, or put it "
                      "on PYTHONPATH)", file=sys.stderr)
                return 2
        code = COMMANDS[args.command](args)
        sys.stdout.flush()  # now rather than at exit, so that a reader gone away is the BrokenPipeError below
    except BrokenPipeError:  # the reader of stdout went away (`| head`): not an error (caught before OSError)
        _silence_stdout()
        return 0
    except expected as exc:
        if os.environ.get("NMTFLOW_DEBUG"):
            raise
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        rank = int(os.environ.get("RANK", "0") or 0)  # torchrun: every process meets a config error alike
        if rank == 0 or not isinstance(exc, ConfigError):
            print(f"nmtflow {args.command}: error: {f'rank {rank}: ' if rank else ''}{message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return code or 0


def _silence_stdout() -> None:
    """Point stdout's descriptor at the null device, so the interpreter's final flush into the closed pipe is quiet."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # a replaced stream without a descriptor: nothing to flush
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
    finally:
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
