"""``nmtflow serve``: a FastAPI app that translates, scores and shows the information flow of served checkpoints.

Every model call runs on one worker thread (:class:`Worker`) fed by a queue, so a model never runs twice at once
and torch keeps the threads the command line gave it; the async endpoints await the worker's futures. Translate
requests waiting in the queue for the same model, direction and search settings are merged into one call
(micro-batching; sampling requests never are, so that a seed draws the same samples alone or in company) and
each request gets back exactly its own sentences' results. The HTTP/JSON contract is in ``docs/guide/serve.md``.
"""
from __future__ import annotations

import asyncio
import dataclasses
import importlib.resources
import logging
import math
import queue
import threading
from concurrent.futures import Future
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Hashable, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from nmtflow.api import Model, decode_config
from nmtflow.config import ConfigError, DecodeConfig
from nmtflow.data.multilingual import Direction
from nmtflow.data.tokenizer import unicode_problem
from nmtflow.decode.translate import Translator
from nmtflow.serve.flow import architecture, flow_kinds, sentence_flow

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
PLACEHOLDER = ("<!doctype html><meta charset='utf-8'><title>nmtflow serve</title><p>nmtflow serve: the API is at "
               "<a href='/api/models'>/api/models</a> (the explorer page is not installed).</p>")
SAMPLING_ONLY = tuple(DecodeConfig.SAMPLING_ONLY)  # ignored without sampling


class ApiError(Exception):
    """An error answered as ``{"error": message}`` with HTTP ``status``."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


# ---- the worker ---------------------------------------------------------------------------------------------------
@dataclass
class Job:
    """``run(items) → one result per item``; jobs with the same ``key`` (not None) may run as one call."""

    run: Callable[[list[Any]], list[Any]]
    items: list[Any]
    key: Hashable | None
    future: Future


class Worker:
    """The one thread that makes every model call, in arrival order; waiting jobs with the same key are merged
    (up to ``max_merge`` items per call). ``calls`` counts the calls made."""

    def __init__(self, max_merge: int = 256) -> None:
        self.max_merge = max_merge
        self.queue: queue.Queue[Job | None] = queue.Queue()
        self.calls = 0
        self._thread = threading.Thread(target=self._loop, name="nmtflow-serve-model", daemon=True)
        self._thread.start()

    def submit(self, run: Callable[[list[Any]], list[Any]], items: list[Any], key: Hashable | None = None) -> Future:
        future: Future = Future()
        self.queue.put(Job(run, items, key, future))
        return future

    def close(self) -> None:
        self.queue.put(None)
        self._thread.join()

    def _loop(self) -> None:
        while True:
            pending = [self.queue.get()]
            while True:  # everything waiting now: merged where it can be
                try:
                    pending.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            groups: list[list[Job]] = []
            open_groups: dict[Hashable, list[Job]] = {}
            for job in pending:
                if job is None:
                    continue
                if not job.future.set_running_or_notify_cancel():  # its client went away
                    continue
                group = open_groups.get(job.key) if job.key is not None else None
                if group is not None and sum(len(j.items) for j in group) + len(job.items) <= self.max_merge:
                    group.append(job)
                    continue
                groups.append([job])
                if job.key is not None:
                    open_groups[job.key] = groups[-1]
            for group in groups:
                self._call(group)
            if None in pending:
                return

    def _call(self, group: list[Job]) -> None:
        items = [item for job in group for item in job.items]
        self.calls += 1
        try:
            results = group[0].run(items)
        except Exception as exc:  # noqa: BLE001 — answered to its request(s), the worker goes on
            if len(group) > 1:  # whose was it? each alone, so that only that request gets the error
                for job in group:
                    self._call([job])
            else:
                group[0].future.set_exception(exc)
            return
        start = 0
        for job in group:
            job.future.set_result(results[start:start + len(job.items)])
            start += len(job.items)


# ---- the served models --------------------------------------------------------------------------------------------
@dataclass
class Served:
    """A model served under ``name``: an :func:`nmtflow.load` model (one checkpoint or an ensemble)."""

    name: str
    model: Model

    def __post_init__(self) -> None:
        self._lock = threading.Lock()  # the model's cache of translators: filled from the endpoints
        net = self.model.networks[0] if len(self.model.networks) == 1 else None
        self.architecture = architecture(net) if net is not None else "ensemble"
        self.flow = flow_kinds(net) if net is not None else []
        langs = [Direction.parse(d) for d in [*self.model.directions, *self.model.zero_shot]]
        self.src_langs = list(dict.fromkeys(d.src for d in langs)) if self.model.multilingual else None
        self.tgt_langs = list(dict.fromkeys(d.tgt for d in langs)) if self.model.multilingual else None

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "architecture": self.architecture,
                "checkpoint": ", ".join(Path(p).name for p in self.model.paths),
                "multilingual": self.model.multilingual, "src_langs": self.src_langs, "tgt_langs": self.tgt_langs,
                "flow": self.flow, "beam_size": self.model.decode.beam_size}

    def translator(self, src_lang: str | None, tgt_lang: str | None) -> Translator:
        """The translator of a direction; unknown or missing languages are a 422 naming the field."""
        if self.model.multilingual:
            for field, lang, known in (("src_lang", src_lang, self.src_langs), ("tgt_lang", tgt_lang, self.tgt_langs)):
                if lang is None:
                    raise ApiError(422, f"{field}: model {self.name!r} is multilingual; name src_lang and tgt_lang "
                                        f"(source languages {', '.join(self.src_langs or [])}; targets "
                                        f"{', '.join(self.tgt_langs or [])})")
                if lang not in (known or []):
                    raise ApiError(422, f"{field}: unknown language {lang!r} for model {self.name!r} (it has "
                                        f"{', '.join(known or [])})")
        else:
            direction = Direction.parse(self.model.directions[0]) if self.model.directions else None
            for field, lang, own in (("src_lang", src_lang, direction and direction.src),
                                     ("tgt_lang", tgt_lang, direction and direction.tgt)):
                if lang is not None and lang != own:
                    raise ApiError(422, f"{field}: unknown language {lang!r}: model {self.name!r} translates "
                                        f"{self.model.directions[0]} only (leave the languages out)")
            src_lang = tgt_lang = None
        with self._lock:
            try:
                return self.model.translator(src_lang, tgt_lang)
            except ValueError as exc:
                raise ApiError(422, f"src_lang/tgt_lang: {exc}") from None


def model_names(paths: Sequence[str]) -> list[str]:
    """Default names of checkpoints: the file stem, or the parent folder's name for ``checkpoint_*.pt`` files, made
    unique with ``-2``, ``-3``, ..."""
    names: list[str] = []
    for p in map(Path, paths):
        base = p.parent.name if p.stem.startswith("checkpoint") and p.parent.name else p.stem
        name, n = base, 1
        while name in names:
            n += 1
            name = f"{base}-{n}"
        names.append(name)
    return names


# ---- requests -----------------------------------------------------------------------------------------------------
class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, protected_namespaces=())


class TranslateRequest(Strict):
    model: str | None = None
    sentences: list[str] = Field(min_length=1)
    src_lang: str | None = None
    tgt_lang: str | None = None
    beam_size: int | None = Field(None, ge=1, le=64)  # None: the checkpoint's
    nbest: int = Field(1, ge=1, le=64)
    len_penalty: float | None = None
    max_len_a: float | None = Field(None, ge=0, le=10)
    max_len_b: int | None = Field(None, ge=0, le=1024)
    min_len: int | None = Field(None, ge=0)
    greedy: bool = False
    sampling: bool = False
    temperature: float = Field(1.0, gt=0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, ge=0, le=1)
    seed: int | None = Field(None, ge=0)


class ScoreRequest(Strict):
    model: str | None = None
    sources: list[str] = Field(min_length=1)
    targets: list[str] = Field(min_length=1)
    src_lang: str | None = None
    tgt_lang: str | None = None


class FlowRequest(Strict):
    model: str | None = None
    sentence: str
    target: str | None = None
    src_lang: str | None = None
    tgt_lang: str | None = None
    beam_size: int | None = Field(None, ge=1, le=64)  # of the model's own translation; None: the checkpoint's


def _location(loc: Sequence[Any]) -> str:
    """``("body", "sentences", 2)`` → ``sentences[2]``."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        out += f"[{part}]" if isinstance(part, int) else f"{'.' if out else ''}{part}"
    return out


def validation_error(exc: RequestValidationError) -> ApiError:
    """FastAPI's list of errors → one readable sentence naming the first field (400 for a body that is no JSON)."""
    first = exc.errors()[0]
    where = _location(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", first.get("msg", ""))
        return ApiError(400, f"malformed JSON body: {reason}")
    if first.get("type") == "missing" and not where:
        return ApiError(400, "the request body must be a JSON object")
    message = str(first.get("msg", "invalid"))
    if first.get("type") == "extra_forbidden":
        message = "unknown field"
    return ApiError(422, f"{where or 'body'}: {message}")


# ---- the app ------------------------------------------------------------------------------------------------------
def create_app(models: dict[str, Model], *, max_sentences: int = 32, max_chars: int = 1000,
               max_batch_tokens: int = 4000, max_merge: int = 256) -> FastAPI:
    """The app serving ``models`` by name (:func:`nmtflow.load` models): requests of at most ``max_sentences``
    sentences of at most ``max_chars`` characters; ``max_batch_tokens`` source tokens per decoding batch;
    ``max_merge``: sentences of merged translate requests per model call."""
    if not models:
        raise ValueError("serve: no model to serve")
    for option, value in (("--max-sentences", max_sentences), ("--max-chars", max_chars),
                          ("--max-batch-tokens", max_batch_tokens)):
        if value < 1:
            raise ValueError(f"{option}: must be >= 1, got {value}")
    served = {name: Served(name, m) for name, m in models.items()}
    worker = Worker(max_merge)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        worker.close()

    app = FastAPI(title="nmtflow serve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.worker, app.state.served = worker, served

    @app.exception_handler(ApiError)
    async def api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse({"error": exc.message}, status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return await api_error(request, validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"error": f"{request.url.path}: {exc.detail}"}, status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def crash(request: Request, exc: Exception) -> JSONResponse:
        log.exception("%s failed", request.url.path)
        return JSONResponse({"error": f"internal error ({type(exc).__name__}: {exc})"}, status_code=500)

    def pick(name: str | None) -> Served:
        if name is None:
            if len(served) == 1:
                return next(iter(served.values()))
            raise ApiError(422, f"model: name one of the served models ({', '.join(served)})")
        if name not in served:
            raise ApiError(404, f"model: unknown model {name!r} (served: {', '.join(served)})")
        return served[name]

    def check_sentences(field: str, lines: list[str], *, one: bool = False) -> None:
        """413/422 for too many, empty, too long or non-UTF-8 sentences; ``one``: the field holds one (no index)."""
        if len(lines) > max_sentences:
            raise ApiError(413, f"{field}: {len(lines)} sentences; at most {max_sentences} per request")
        for n, line in enumerate(lines):
            name = field if one else f"{field}[{n}]"
            if not line.strip():
                raise ApiError(422, f"{name} is empty")
            if len(line) > max_chars:
                raise ApiError(413, f"{name} has {len(line)} characters; at most {max_chars}")
            if problem := unicode_problem(line):
                raise ApiError(422, f"{name} {problem}")

    async def answer(future: Future) -> list[Any]:
        try:
            return await asyncio.wrap_future(future)
        except (ValueError, ConfigError) as exc:  # the model's own one-line errors (positions, NaN scores, ...)
            raise ApiError(422, str(exc)) from None

    @app.get("/api/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "models": list(served)}

    @app.get("/api/models")
    async def list_models() -> dict[str, Any]:
        return {"models": [s.describe() for s in served.values()]}

    @app.post("/api/translate")
    async def translate(req: TranslateRequest) -> dict[str, Any]:
        s = pick(req.model)
        check_sentences("sentences", req.sentences)
        options = req.model_dump(exclude={"model", "sentences", "src_lang", "tgt_lang"}, exclude_none=True)
        if not req.sampling:
            options = {k: v for k, v in options.items() if k not in SAMPLING_ONLY}
        options["max_tokens"] = max_batch_tokens
        try:
            cfg = decode_config(s.model.decode, options, "request")
        except ConfigError as exc:
            raise ApiError(422, str(exc).removeprefix("decode.")) from None
        translator = dataclasses.replace(s.translator(req.src_lang, req.tgt_lang), decode=cfg)
        check_positions(translator, req.sentences)
        key = None if cfg.sampling else (s.name, req.src_lang, req.tgt_lang, tuple(sorted(options.items())))
        results = await answer(worker.submit(translator.translate, req.sentences, key))
        return {"model": s.name,
                "translations": [{"source": line, "hypotheses": [{"text": t, "score": score} for t, score in hyps]}
                                 for line, hyps in zip(req.sentences, results)]}

    @app.post("/api/score")
    async def score(req: ScoreRequest) -> dict[str, Any]:
        s = pick(req.model)
        if len(req.sources) != len(req.targets):
            raise ApiError(422, f"targets: {len(req.targets)} targets for {len(req.sources)} sources (one each)")
        check_sentences("sources", req.sources)
        check_sentences("targets", req.targets)
        translator = dataclasses.replace(s.translator(req.src_lang, req.tgt_lang),
                                         decode=dataclasses.replace(s.model.decode, max_tokens=max_batch_tokens))
        check_positions(translator, req.sources, "sources")
        pairs = list(zip(req.sources, req.targets))

        def run(items: list[tuple[str, str]]) -> list[tuple[float, list[float]]]:
            return translator.token_scores([a for a, _ in items], [b for _, b in items],
                                           where=lambda n, side: f"{side}s[{n}]")

        results = await answer(worker.submit(run, pairs))
        return {"model": s.name, "scores": [{"score": finite(total), "tokens": len(per_token),
                                             "per_token": [finite(v) for v in per_token]}
                                            for total, per_token in results]}

    @app.post("/api/flow")
    async def flow(req: FlowRequest) -> dict[str, Any]:
        s = pick(req.model)
        check_sentences("sentence", [req.sentence], one=True)
        if req.target is not None:
            check_sentences("target", [req.target], one=True)
        translator = s.translator(req.src_lang, req.tgt_lang)
        if req.beam_size is not None:
            translator = dataclasses.replace(translator, decode=dataclasses.replace(translator.decode,
                                                                                    beam_size=req.beam_size))
        check_positions(translator, [req.sentence], "sentence", one=True)

        def run(items: list[FlowRequest]) -> list[dict[str, Any]]:
            return [sentence_flow(translator, r.sentence, r.target) for r in items]

        result = (await answer(worker.submit(run, [req])))[0]
        if not s.flow:  # an ensemble: its members' flows are not shown
            result.update(attention=[], gates=[], bridge=None)
        return {"model": s.name, **result}

    @app.get("/static/vendor/plotly.min.js")
    async def plotly_js() -> Response:
        try:
            path = importlib.resources.files("plotly") / "package_data" / "plotly.min.js"
            return Response(path.read_bytes(), media_type="application/javascript")
        except (ModuleNotFoundError, FileNotFoundError):
            raise ApiError(404, "plotly.min.js: install the plotly package (pip install 'nmtflow[serve]')") from None

    @app.get("/", response_model=None)
    async def index() -> Response:
        page = STATIC / "index.html"
        return FileResponse(page) if page.is_file() else HTMLResponse(PLACEHOLDER)

    app.mount("/static", StaticFiles(directory=STATIC, check_dir=False), name="static")
    # sources and targets of the longest request, each character escaped as a surrogate pair (12 bytes), and room
    # for the other fields
    app.add_middleware(JsonBodies, max_bytes=2 * max_sentences * max_chars * 12 + 65536)
    return app


class JsonBodies:
    """ASGI wrapper for POST requests: the body is read as JSON whatever its Content-Type says (``curl -d`` sends
    form encoding), and a body over ``max_bytes`` is answered with a 413 before any of it is parsed."""

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-type"]
        scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        chunks, size, more = [], 0, True
        while more:  # read (and count) the body before the app parses it
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                refusal = JSONResponse({"error": f"request body over {self.max_bytes} bytes"}, status_code=413)
                await refusal(scope, receive, send)
                return
        body, replayed = b"".join(chunks), False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


def check_positions(translator: Translator, sentences: list[str], field: str = "sentences", *,
                    one: bool = False) -> None:
    """A 413 naming the first source sentence longer than the model reads, which it would otherwise answer about
    cut short (the CLI truncates it with a warning; a client would get no sign); ``one``: the field holds one."""
    limit = translator.max_source_tokens
    for n, ids in enumerate(translator.src_tokenizer.encode_batch(sentences)):
        if len(ids) > limit:
            name = field if one else f"{field}[{n}]"
            raise ApiError(413, f"{name} has {len(ids)} sub-words; model reads at most {limit}")


def finite(value: float) -> float | None:
    """JSON has no NaN: None for a NaN or infinite score."""
    return value if math.isfinite(value) else None


def load_models(paths: Sequence[str], names: Sequence[str] | None = None, *, device: str = "auto",
                ensemble: bool = False, precision: str | None = None) -> dict[str, Model]:
    """``nmtflow serve``'s models: each checkpoint by name (``names``, default :func:`model_names`), or with
    ``ensemble`` all of them as one model named ``ensemble``; ``precision`` of translating and scoring (default:
    each checkpoint's ``decode.precision``)."""
    decode = {} if precision is None else {"precision": precision}
    if not paths:
        raise ValueError("serve: name at least one checkpoint")
    if ensemble:
        if names:
            raise ValueError("--name: with --ensemble the checkpoints are served as one model named 'ensemble'")
        return {"ensemble": Model(list(paths), device, **decode)}
    names = list(names) if names else model_names(paths)
    if len(names) != len(paths):
        raise ValueError(f"--name: {len(names)} names for {len(paths)} checkpoints (one each)")
    if len(set(names)) != len(names):
        raise ValueError(f"--name: names must differ, got {', '.join(names)}")
    return {name: Model(path, device, **decode) for name, path in zip(names, paths)}


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8080) -> None:
    """Run ``app`` with uvicorn until interrupted."""
    import uvicorn

    log.info("serving %s at http://%s:%d/ (API: /api/models, /api/translate, /api/score, /api/flow)",
             ", ".join(app.state.served), host, port)
    uvicorn.run(app, host=host, port=port, log_level="info")
