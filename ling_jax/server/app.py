"""The FastAPI application: OpenAI's routes over an `EngineDriver`.

    app = create_app(driver, info, api_key=None)   # then serve it with uvicorn (`runner`)

The routes are module-level functions of `router` (an APIRouter); what they share (the driver, the
model info, metrics, the token formatter, the tokenizer thread pool) is kept on `app.state` by
`create_app`. Completions and chat differ in their chunk and response shapes only: one helper,
`_respond`, runs the choices and streams (or collects) them for both.

Routes: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id}, GET /health,
GET /metrics, POST /tokenize, POST /detokenize. Streaming responses are server-sent events in
OpenAI's chunk format (framed by `fastapi.sse.format_sse_event`), ending with `data: [DONE]`.
With an api key, everything but /health and /metrics needs `Authorization: Bearer KEY` (checked
before the body is read, so a bad body without the key is a 401, not a 400).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import secrets
import time
import uuid
from typing import Callable, Optional

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.sse import format_sse_event
from starlette.exceptions import HTTPException as StarletteHTTPException

from ling_jax.server.driver import EngineDriver
from ling_jax.server.errors import APIError, error_response, install_error_handlers
from ling_jax.server.generation import ChoiceRun, Delta
from ling_jax.server.metrics import ServerMetrics
from ling_jax.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                      ChatCompletionRequest, ChatCompletionResponse, ChatDelta, ChatLogprobs,
                                      ChatMessage, ChatTokenLogprob, CompletionChoice, CompletionChunk,
                                      CompletionLogprobs, CompletionRequest, CompletionResponse, DetokenizeRequest,
                                      ModelCard, ModelList, TokenizeRequest, TopLogprob, Usage)
from ling_jax.server.requests import (ModelInfo, chat_plans, check_ids, check_model, completion_plans,
                                      tokenize_ids)

DEFAULT_MAX_BODY_BYTES = 4 * 2 ** 20
DRAIN_BYTES = 64 * 2 ** 20  # an oversize body up to this is read and dropped before its 413
DEFAULT_BODY_TIMEOUT_S = 60.0
TOKENIZE_WORKERS = 4  # threads that tokenise / template large inputs (off the event loop)
OFF_LOOP_CHARS = 16 * 1024  # inputs with more text than this are tokenised on those threads
_OPEN_PATHS = ("/health", "/metrics")


class APIKeyMiddleware:
    """ASGI middleware: 401 (OpenAI error JSON) unless `Authorization: Bearer <key>` matches."""

    def __init__(self, app, api_key: str):
        self.app, self.key = app, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in _OPEN_PATHS:
            auth = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), self.key.encode()):
                response = error_response(401, "missing or wrong API key (send Authorization: Bearer <key>)",
                                          code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """ASGI middleware bounding a request body in size and in time.

    Size: a body over `max_body_bytes` gets a 413 in OpenAI's error JSON that the client can read:
    the body is read and discarded first (up to `drain_bytes`; a client such as urllib sends the
    whole body before it reads an answer, and closing on unread bytes would reset its connection
    mid-send), then the 413 goes out with `Connection: close`. A Content-Length over `drain_bytes`
    is answered at once. A chunked body is counted as it is read; once past the limit the rest is
    drained the same way and the receive wrapper raises an HTTPException(413), which the app's
    handlers turn into the JSON.
    Time: the whole body must arrive within `body_timeout_s` of the first read (a client dripping
    a byte at a time cannot hold a connection open): else a 408, also with `Connection: close`.
    """

    def __init__(self, app, max_body_bytes: int, body_timeout_s: Optional[float] = None,
                 drain_bytes: int = DRAIN_BYTES):
        self.app, self.limit, self.timeout, self.drain_limit = app, max_body_bytes, body_timeout_s, drain_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        deadline = None
        done = False

        async def timed():
            nonlocal deadline, done
            if done:
                return await receive()
            if self.timeout is None:
                message = await receive()
            else:
                if deadline is None:
                    deadline = time.monotonic() + self.timeout
                try:
                    message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
                except asyncio.TimeoutError:
                    done = True
                    raise StarletteHTTPException(
                        408, f"the request body did not arrive within {self.timeout:g} s") from None
            if message.get("type") != "http.request" or not message.get("more_body", False):
                done = True
            return message

        async def drain(already: int) -> None:
            """Read and drop the rest of the body (up to drain_limit bytes in all)."""
            while not done and already <= self.drain_limit:
                message = await timed()
                already += len(message.get("body", b""))

        def too_large(n: int) -> JSONResponse:
            return error_response(413, f"request body of {n} bytes exceeds the limit of {self.limit} bytes",
                                  code="request_too_large", headers={"Connection": "close"})

        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            if int(length) <= self.drain_limit:
                try:
                    await drain(0)
                except StarletteHTTPException as e:
                    return await error_response(408, str(e.detail), code="request_timeout",
                                                headers={"Connection": "close"})(scope, receive, send)
            return await too_large(int(length))(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await timed()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                await drain(seen)
                raise StarletteHTTPException(413)
            return message

        await self.app(scope, counted, send)


class _Formatter:
    """Token strings and logprob objects in the two endpoints' formats."""

    def __init__(self, tokenizer):
        self.tok = tokenizer

    def token(self, tid: int) -> str:
        return self.tok.decode([int(tid)], skip_special_tokens=False)

    def completion_logprobs(self, ids, lps, top: int, offset: int) -> Optional[CompletionLogprobs]:
        out = CompletionLogprobs(top_logprobs=[] if top else None)
        for tid, lp in zip(ids, lps):
            s = self.token(tid)
            out.tokens.append(s)
            out.token_logprobs.append(None if lp is None else float(lp.logprob))
            out.text_offset.append(offset)
            offset += len(s)
            if top:
                out.top_logprobs.append(None if lp is None else {self.token(t): float(v) for t, v in lp.top})
        return out

    def chat_logprobs(self, ids, lps) -> ChatLogprobs:
        content = []
        for tid, lp in zip(ids, lps):
            if lp is None:
                continue
            s = self.token(tid)
            tops = [TopLogprob(token=self.token(t), logprob=float(v), bytes=list(self.token(t).encode()))
                    for t, v in lp.top]
            content.append(ChatTokenLogprob(token=s, logprob=float(lp.logprob), bytes=list(s.encode()),
                                            top_logprobs=tops))
        return ChatLogprobs(content=content)


def _sse(payload) -> bytes:
    return format_sse_event(data_str=payload if isinstance(payload, str) else payload.model_dump_json())


async def _collect(run: ChoiceRun, n: int, request: Request) -> list[Delta]:
    """Every choice's deltas joined (the non-streamed response is built from the same pieces)."""
    merged = [Delta(i) for i in range(n)]
    try:
        async for d in run.deltas(request.is_disconnected):
            m = merged[d.index]
            m.text += d.text
            m.token_ids += d.token_ids
            m.logprobs += d.logprobs
            m.finish_reason = d.finish_reason or m.finish_reason
    finally:
        run.close()
    return merged


def _usage(prompt_tokens: int, run: ChoiceRun) -> Usage:
    c = run.completion_tokens
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=c, total_tokens=prompt_tokens + c)


async def _respond(request: Request, plans: list, n_prompt: int, *, stream: bool, include_usage: bool,
                   details: bool, chunk: Callable, usage_chunk: Callable, response: Callable, head: tuple = ()):
    """Run one request's choices on the engine and answer, streamed or whole (completions and chat alike).

    Streamed: server-sent events: the `head` chunks, then `chunk(delta)` for every delta with text, a
    finish reason, or (`details`: logprobs or token ids were asked for) token ids; `usage_chunk(usage)`
    when `include_usage`; an error after the stream has begun as an error event (as OpenAI sends it);
    then `[DONE]`. Whole: `response(merged deltas, usage)`. Either way every unfinished choice is
    cancelled when the response ends (done, error, disconnect)."""
    s = request.app.state
    run = ChoiceRun(s.driver, s.info.tokenizer, s.metrics, plans)
    run.start()
    if not stream:
        merged = await _collect(run, len(plans), request)
        return response(merged, _usage(n_prompt, run))

    async def events():
        try:
            for c in head:
                yield _sse(c)
            async for d in run.deltas(request.is_disconnected):
                if d.text or d.finish_reason or (d.token_ids and details):
                    yield _sse(chunk(d))
            if include_usage:
                yield _sse(usage_chunk(_usage(n_prompt, run)))
        except APIError as e:
            yield _sse(json.dumps(e.body()))
        finally:
            run.close()
        yield _sse("[DONE]")
    return StreamingResponse(events(), media_type="text/event-stream")


def _text_chars(request: Request, *texts) -> int:
    """How much work a request carries for the tokenizer / chat template / request checks: its text
    fields' text (a cheap upper bound) or, when larger, its body size (many prompts, long id lists)."""
    length = request.headers.get("content-length", "")
    n = int(length) if length.isdigit() else 0
    for v in texts:
        if isinstance(v, str):
            n += len(v)
        elif isinstance(v, list):
            for x in v:
                n += len(x) if isinstance(x, str) else len(x.text()) if isinstance(x, ChatMessage) else 0
    return n


async def _off_loop(request: Request, fn, *args, size: int = OFF_LOOP_CHARS + 1):
    """fn(*args), on the app's tokenizer pool when the input is large (inline when small: no hop)."""
    if size <= OFF_LOOP_CHARS:
        return fn(*args)
    pool = request.app.state.tokenize_pool
    return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))


# ---- the routes: module level, the shared objects on `request.app.state` (set by `create_app`) ----
router = APIRouter()


@router.get("/health")
async def health(request: Request):
    driver = request.app.state.driver
    if driver.failed is not None:
        return error_response(503, f"engine failed: {driver.failed} (the server is exiting)",
                              code="engine_failed")
    if not driver.alive:
        return error_response(503, f"engine not running: {driver.failed or 'stopped'}", code="engine_unavailable")
    warming = driver.warming
    if warming is not None:  # `--warmup lazy`: requests are served meanwhile
        return {"status": "starting", "warmup": {"done": warming[0], "total": warming[1]}}
    return {"status": "ok"}


@router.get("/metrics")
async def metrics_route(request: Request):
    body, content_type = request.app.state.metrics.render()
    return Response(body, media_type=content_type)


def _card(state) -> ModelCard:
    return ModelCard(id=state.info.name, created=state.started, max_model_len=state.info.max_seq_len)


@router.get("/v1/models")
async def models(request: Request):
    return ModelList(data=[_card(request.app.state)])


@router.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request):
    check_model(request.app.state.info, model_id)
    return _card(request.app.state)


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, request: Request):
    info = request.app.state.info
    check_model(info, req.model)
    ids = await _off_loop(request, tokenize_ids, info, req.prompt, req.messages, req.add_special_tokens,
                          size=_text_chars(request, req.prompt, req.messages))
    return {"tokens": ids, "count": len(ids), "max_model_len": info.max_seq_len}


def _decode_ids(info: ModelInfo, ids: list) -> str:
    check_ids(info, ids, "tokens")
    return info.tokenizer.decode(ids)


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, request: Request):
    info = request.app.state.info
    check_model(info, req.model)
    return {"prompt": await _off_loop(request, _decode_ids, info, req.tokens, size=len(req.tokens) * 4)}


@router.post("/v1/completions")
async def completions(req: CompletionRequest, request: Request):
    s = request.app.state
    check_model(s.info, req.model)
    plans, n_prompt = await _off_loop(request, completion_plans, s.info, req, size=_text_chars(request, req.prompt))
    rid, top, created = f"cmpl-{uuid.uuid4().hex}", req.logprobs or 0, int(time.time())
    offsets = [0] * len(plans)

    def choice(d: Delta) -> CompletionChoice:
        lp = None
        if req.logprobs is not None:
            lp = s.formatter.completion_logprobs(d.token_ids, d.logprobs, top, offsets[d.index])
            offsets[d.index] += sum(len(t) for t in lp.tokens)
        return CompletionChoice(index=d.index, text=d.text, logprobs=lp, finish_reason=d.finish_reason,
                                token_ids=d.token_ids if req.return_token_ids else None)

    def chunk(choices, usage=None) -> CompletionChunk:
        return CompletionChunk(id=rid, created=created, model=s.info.name, choices=choices, usage=usage)

    return await _respond(
        request, plans, n_prompt, stream=req.stream, include_usage=_include_usage(req),
        details=req.logprobs is not None or req.return_token_ids,
        chunk=lambda d: chunk([choice(d)]), usage_chunk=lambda usage: chunk([], usage),
        response=lambda merged, usage: CompletionResponse(id=rid, created=created, model=s.info.name,
                                                          choices=[choice(m) for m in merged], usage=usage))


@router.post("/v1/chat/completions")
async def chat(req: ChatCompletionRequest, request: Request):
    s = request.app.state
    check_model(s.info, req.model)
    plans, n_prompt = await _off_loop(request, chat_plans, s.info, req, size=_text_chars(request, req.messages))
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def lps(d: Delta) -> Optional[ChatLogprobs]:
        return s.formatter.chat_logprobs(d.token_ids, d.logprobs) if req.logprobs else None

    def ids(d: Delta):
        return d.token_ids if req.return_token_ids else None

    def chunk(choices, usage=None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=rid, created=created, model=s.info.name, choices=choices, usage=usage)

    def delta_chunk(d: Delta) -> ChatCompletionChunk:
        return chunk([ChatChunkChoice(index=d.index, delta=ChatDelta(content=d.text or None), logprobs=lps(d),
                                      finish_reason=d.finish_reason, token_ids=ids(d))])

    def response(merged, usage) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=rid, created=created, model=s.info.name, usage=usage,
            choices=[ChatChoice(index=m.index, message=AssistantMessage(content=m.text), logprobs=lps(m),
                                finish_reason=m.finish_reason, token_ids=ids(m)) for m in merged])

    head = tuple(chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
                 for i in range(len(plans)))  # every choice's role first
    return await _respond(request, plans, n_prompt, stream=req.stream, include_usage=_include_usage(req),
                          details=bool(req.logprobs or req.return_token_ids), chunk=delta_chunk,
                          usage_chunk=lambda usage: chunk([], usage), response=response, head=head)


def _include_usage(req) -> bool:
    return bool(req.stream_options and req.stream_options.include_usage)


# ---- the app --------------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    s = app.state
    s.driver.start()
    yield
    s.tokenize_pool.shutdown(wait=False, cancel_futures=True)
    if s.owns_driver:
        s.driver.stop()


def create_app(driver: EngineDriver, info: ModelInfo, *, api_key: Optional[str] = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, owns_driver: bool = True,
               body_timeout_s: Optional[float] = DEFAULT_BODY_TIMEOUT_S,
               tokenize_workers: int = TOKENIZE_WORKERS) -> FastAPI:
    """The server's ASGI app: `router`'s routes over the objects it keeps on `app.state` (driver,
    info, metrics, formatter, started, tokenize_pool, owns_driver, abort). The driver is started (if
    not yet) at start-up and, when the app owns it, stopped at shutdown (requests still running then
    finish with "abort"). Tokenisation, chat templating and the request checks of inputs with more
    than OFF_LOOP_CHARS characters of text (or bytes of body) run on a bounded pool of
    `tokenize_workers` threads, so a 4 MiB prompt never stalls other clients' streams."""
    app = FastAPI(title="ling-jax", lifespan=_lifespan, docs_url=None, redoc_url=None)
    s = app.state
    s.driver, s.info, s.owns_driver = driver, info, owns_driver
    s.metrics = ServerMetrics(lambda: driver.stats, lambda: driver.in_flight)
    s.formatter = _Formatter(info.tokenizer)
    s.started = int(time.time())  # /v1/models' `created`; every response has its own (the time it began)
    s.tokenize_pool = concurrent.futures.ThreadPoolExecutor(max_workers=tokenize_workers,
                                                            thread_name_prefix="ling-jax-tokenize")
    s.abort = driver.stop if owns_driver else None  # runner.GracefulServer's abort on shutdown
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
    if api_key:  # added last = runs first: no key, no reading of the body
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.include_router(router)
    return app
