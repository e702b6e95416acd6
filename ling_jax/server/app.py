"""The FastAPI application: OpenAI's routes over an `EngineDriver`.

    app = create_app(driver, info, api_key=None)   # then serve it with uvicorn (`runner`)

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
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.sse import format_sse_event
from starlette.exceptions import HTTPException as StarletteHTTPException

from ling_jax.server.driver import EngineDriver
from ling_jax.server.errors import APIError, error_response, install_error_handlers
from ling_jax.server.generation import ChoiceRun, Delta
from ling_jax.server.metrics import ServerMetrics
from ling_jax.server.protocol import (AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk,
                                      ChatCompletionRequest, ChatCompletionResponse, ChatDelta, ChatLogprobs,
                                      ChatTokenLogprob, CompletionChoice, CompletionChunk, CompletionLogprobs,
                                      CompletionRequest, CompletionResponse, DetokenizeRequest, ModelCard,
                                      ModelList, TokenizeRequest, TopLogprob, Usage)
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


def _text_chars(req, request: Optional[Request] = None) -> int:
    """How much work a request carries for the tokenizer / chat template / request checks: its text
    (a cheap upper bound) or, when larger, its body size (many prompts, long id lists)."""
    n = 0
    if request is not None:
        length = request.headers.get("content-length", "")
        n = int(length) if length.isdigit() else 0
    for v in (getattr(req, "prompt", None), getattr(req, "messages", None)):
        if isinstance(v, str):
            n += len(v)
        elif isinstance(v, list):
            for x in v:
                n += len(x) if isinstance(x, str) else len(x.text()) if hasattr(x, "text") else 0
    return n


def create_app(driver: EngineDriver, info: ModelInfo, *, api_key: Optional[str] = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, owns_driver: bool = True,
               body_timeout_s: Optional[float] = DEFAULT_BODY_TIMEOUT_S,
               tokenize_workers: int = TOKENIZE_WORKERS) -> FastAPI:
    """The server's ASGI app. The driver is started (if not yet) at start-up and, when the app owns
    it, stopped at shutdown (requests still running then finish with "abort"). Tokenisation, chat
    templating and the request checks of inputs with more than OFF_LOOP_CHARS characters of text
    (or bytes of body) run on a bounded pool of `tokenize_workers` threads, so a 4 MiB prompt never
    stalls other clients' streams."""
    metrics = ServerMetrics(lambda: driver.stats, lambda: driver.in_flight)
    fmt = _Formatter(info.tokenizer)
    started = int(time.time())  # /v1/models' `created`; every response has its own (the time it began)
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=tokenize_workers, thread_name_prefix="ling-jax-tokenize")

    async def off_loop(fn, *args, size: int = OFF_LOOP_CHARS + 1):
        """fn(*args), on the tokenizer pool when the input is large (inline when small: no hop)."""
        if size <= OFF_LOOP_CHARS:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(pool, functools.partial(fn, *args))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        driver.start()
        yield
        pool.shutdown(wait=False, cancel_futures=True)
        if owns_driver:
            driver.stop()

    app = FastAPI(title="ling-jax", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.driver, app.state.info, app.state.metrics = driver, info, metrics
    app.state.abort = driver.stop if owns_driver else None  # runner.GracefulServer's abort on shutdown
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
    if api_key:  # added last = runs first: no key, no reading of the body
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    def usage(prompt_tokens: int, run: ChoiceRun) -> Usage:
        c = run.completion_tokens
        return Usage(prompt_tokens=prompt_tokens, completion_tokens=c, total_tokens=prompt_tokens + c)

    @app.get("/health")
    async def health():
        if driver.failed is not None:
            return error_response(503, f"engine failed: {driver.failed} (the server is exiting)",
                                  code="engine_failed")
        if not driver.alive:
            return error_response(503, f"engine not running: {driver.failed or 'stopped'}", code="engine_unavailable")
        warming = getattr(driver, "warming", None)
        if warming is not None:  # `--warmup lazy`: requests are served meanwhile
            return {"status": "starting", "warmup": {"done": warming[0], "total": warming[1]}}
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_route():
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    def card() -> ModelCard:
        return ModelCard(id=info.name, created=started, max_model_len=info.max_seq_len)

    @app.get("/v1/models")
    async def models():
        return ModelList(data=[card()])

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        check_model(info, model_id)
        return card()

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest, request: Request):
        check_model(info, req.model)
        ids = await off_loop(tokenize_ids, info, req.prompt, req.messages, req.add_special_tokens,
                             size=_text_chars(req, request))
        return {"tokens": ids, "count": len(ids), "max_model_len": info.max_seq_len}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(info, req.model)

        def decode(ids):
            check_ids(info, ids, "tokens")
            return info.tokenizer.decode(ids)
        return {"prompt": await off_loop(decode, req.tokens, size=len(req.tokens) * 4)}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(info, req.model)
        plans, n_prompt = await off_loop(completion_plans, info, req, size=_text_chars(req, request))
        run = ChoiceRun(driver, info.tokenizer, metrics, plans)
        rid, top, created = f"cmpl-{uuid.uuid4().hex}", req.logprobs or 0, int(time.time())
        offsets = [0] * len(plans)

        def choice(d: Delta, final: bool = False) -> CompletionChoice:
            lp = None
            if req.logprobs is not None:
                lp = fmt.completion_logprobs(d.token_ids, d.logprobs, top, offsets[d.index])
                offsets[d.index] += sum(len(t) for t in lp.tokens)
            return CompletionChoice(index=d.index, text=d.text, logprobs=lp, finish_reason=d.finish_reason,
                                    token_ids=d.token_ids if req.return_token_ids else None)

        run.start()
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def events():
                try:
                    async for d in run.deltas(request.is_disconnected):
                        if d.text or d.finish_reason or (d.token_ids and (req.logprobs is not None or
                                                                          req.return_token_ids)):
                            yield _sse(CompletionChunk(id=rid, created=created, model=info.name, choices=[choice(d)]))
                    if include_usage:
                        yield _sse(CompletionChunk(id=rid, created=created, model=info.name, choices=[],
                                                   usage=usage(n_prompt, run)))
                except APIError as e:  # after the stream has begun: an error event, as OpenAI sends
                    yield _sse(json.dumps(e.body()))
                finally:
                    run.close()
                yield _sse("[DONE]")
            return StreamingResponse(events(), media_type="text/event-stream")
        merged = await _collect(run, len(plans), request)
        return CompletionResponse(id=rid, created=created, model=info.name, choices=[choice(m) for m in merged],
                                  usage=usage(n_prompt, run))

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        check_model(info, req.model)
        plans, n_prompt = await off_loop(chat_plans, info, req, size=_text_chars(req, request))
        run = ChoiceRun(driver, info.tokenizer, metrics, plans)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        want_lp = req.logprobs

        def lps(d: Delta) -> Optional[ChatLogprobs]:
            return fmt.chat_logprobs(d.token_ids, d.logprobs) if want_lp else None

        def ids(d: Delta):
            return d.token_ids if req.return_token_ids else None

        run.start()
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            def chunk(choices, use=None):
                return _sse(ChatCompletionChunk(id=rid, created=created, model=info.name, choices=choices,
                                                usage=use))

            async def events():
                try:
                    for i in range(len(plans)):
                        yield chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant", content=""))])
                    async for d in run.deltas(request.is_disconnected):
                        if d.text or d.finish_reason or (d.token_ids and (want_lp or req.return_token_ids)):
                            yield chunk([ChatChunkChoice(index=d.index, delta=ChatDelta(content=d.text or None),
                                                         logprobs=lps(d), finish_reason=d.finish_reason,
                                                         token_ids=ids(d))])
                    if include_usage:
                        yield chunk([], usage(n_prompt, run))
                except APIError as e:  # after the stream has begun: an error event, as OpenAI sends
                    yield _sse(json.dumps(e.body()))
                finally:
                    run.close()
                yield _sse("[DONE]")
            return StreamingResponse(events(), media_type="text/event-stream")
        merged = await _collect(run, len(plans), request)
        return ChatCompletionResponse(
            id=rid, created=created, model=info.name, usage=usage(n_prompt, run),
            choices=[ChatChoice(index=m.index, message=AssistantMessage(content=m.text), logprobs=lps(m),
                                finish_reason=m.finish_reason, token_ids=ids(m)) for m in merged])

    return app
