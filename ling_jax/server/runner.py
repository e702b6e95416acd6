"""Serving the app with uvicorn: in the foreground (the CLI) or on a background thread (tests,
benchmarks, notebooks).

    from ling_jax.server import start_server
    srv = start_server(engine, tokenizer, model_name="tiny")   # 127.0.0.1, a free port
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none")
    ...
    srv.stop()                                                  # aborts what is still running

Why a socket of our own: binding it here (port 0 = a free port chosen by the OS) tells the
caller the real port before uvicorn starts, with no race between finding a port and using it; it
listens at once, so `ling-jax serve` can print its address before uvicorn's start-up has run and
a client that connects in between is queued, not refused.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from typing import Optional

import h11
import uvicorn
from uvicorn.protocols.http import h11_impl
from uvicorn.protocols.http.h11_impl import H11Protocol

from ling_jax.serve import Engine
from ling_jax.server.app import DEFAULT_BODY_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES, create_app
from ling_jax.server.driver import EngineDriver
from ling_jax.server.errors import error_body, error_response
from ling_jax.server.requests import ModelInfo

log = logging.getLogger("ling_jax.server")


def bind(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # listening from here on: a client that connects before uvicorn has started waits
    sock.set_inheritable(True)  # in the backlog instead of being refused
    return sock


def model_info(engine: Engine, tokenizer, model_name: str, eos_ids=None) -> ModelInfo:
    """What the request checks need: the engine's vocabulary and context, the stop ids (default the
    config's EOS ids)."""
    eos = tuple(int(e) for e in (eos_ids if eos_ids is not None else engine.cfg.eos_token_id))
    return ModelInfo(model_name, tokenizer, engine.cfg.vocab_size, engine.sizes.max_seq_len, eos)


DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 1024


def _raw_json_response(status: int, reason: str, body: dict) -> bytes:
    """A whole HTTP/1.1 response (written to the transport directly: no request cycle exists yet)."""
    data = json.dumps(body).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(data)}\r\n\r\n").encode() + data


async def _over_capacity(scope, receive, send):
    """uvicorn's answer past `limit_concurrency`, in OpenAI's error JSON."""
    response = error_response(503, "the server is at its connection limit; retry later", code="server_busy",
                              headers={"Connection": "close", "Retry-After": "1"})
    await response(scope, receive, send)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a header read timeout and OpenAI-shaped protocol errors.

    uvicorn starts no timer until a first response is complete, so a client that connects and
    sends half a request line (or nothing) holds its connection for ever; here each request's head
    must arrive within `header_timeout_s` of the connection (or of the previous response): else the
    connection is closed, with a 408 when some bytes came. Malformed HTTP (uvicorn: a plain-text
    "Invalid HTTP request received.") and the `limit_concurrency` refusal (plain-text 503) are
    answered in OpenAI's error JSON. Subclassed per server by `guarded_protocol` (the timeout)."""

    header_timeout_s: Optional[float] = DEFAULT_HEADER_TIMEOUT_S

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_bytes = 0
        self._head_timer = None
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        self._disarm_head_timer()
        if self.header_timeout_s is not None:
            self._head_timer = self.loop.call_later(self.header_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if getattr(self, "_head_timer", None) is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self._head_bytes:
            self.transport.write(_raw_json_response(408, "Request Timeout", error_body(
                408, f"the request head did not arrive within {self.header_timeout_s:g} s",
                code="request_timeout")))
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        self._head_bytes += len(data)
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:  # a whole request head has arrived
            self._disarm_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():  # keep-alive: the next head gets the same time
            self._head_bytes = 0
            self._arm_head_timer()

    def connection_lost(self, exc) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def send_400_response(self, msg: str) -> None:
        self._disarm_head_timer()
        self.transport.write(_raw_json_response(400, "Bad Request", error_body(
            400, f"malformed HTTP request: {msg}", code="invalid_http_request")))
        self.transport.close()

    def handle_events(self) -> None:
        # uvicorn picks its plain-text `service_unavailable` app past limit_concurrency; ours is JSON
        with _patched_service_unavailable():
            super().handle_events()


_PATCH_LOCK = threading.RLock()  # servers on several threads (tests) patch the same module global


@contextlib.contextmanager
def _patched_service_unavailable():
    with _PATCH_LOCK:
        saved = h11_impl.service_unavailable
        h11_impl.service_unavailable = _over_capacity
        try:
            yield
        finally:
            h11_impl.service_unavailable = saved


def guarded_protocol(header_timeout_s: Optional[float]) -> type:
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"header_timeout_s": header_timeout_s})


ABORT_GRACE_S = 10.0  # after the abort: how long the handlers get to write their final chunk / body


class GracefulServer(uvicorn.Server):
    """uvicorn's server with a shutdown that aborts instead of cancelling.

    uvicorn's own shutdown, once `timeout_graceful_shutdown` has passed, cancels the request
    handlers (a stream cut without its last chunk, a non-streamed request answered by a bare 500,
    a CancelledError traceback) and only then runs the lifespan shutdown that stops the engine
    driver. Here the order is: stop accepting; let running requests finish for up to the graceful
    timeout; then `abort()` (the driver's stop: every request still in flight gets
    finish_reason "abort", so each handler writes its final chunk and `[DONE]`, or its complete
    JSON body); wait up to ABORT_GRACE_S for those responses; only what is still running then is
    cancelled (uvicorn's behaviour); then the lifespan shutdown."""

    def __init__(self, config: uvicorn.Config, abort=None):
        super().__init__(config)
        self.abort = abort

    async def shutdown(self, sockets=None) -> None:
        for server in self.servers:  # stop accepting
            server.close()
        for sock in sockets or []:
            sock.close()
        for connection in list(self.server_state.connections):  # no keep-alive after this response
            connection.shutdown()
        await asyncio.sleep(0.1)
        if not await self._drain(self.config.timeout_graceful_shutdown) and self.abort is not None:
            if self.server_state.tasks or self.server_state.connections:
                log.warning("graceful timeout of %s s passed: aborting the requests still running",
                            self.config.timeout_graceful_shutdown)
            await asyncio.get_running_loop().run_in_executor(None, self.abort)
            await self._drain(ABORT_GRACE_S)
        if self.server_state.tasks:
            log.error("cancelling %d request(s) that did not end after the abort", len(self.server_state.tasks))
            for t in self.server_state.tasks:
                t.cancel(msg="Task cancelled, timeout graceful shutdown exceeded")
        if not self.force_exit:
            await self.lifespan.shutdown()

    async def _drain(self, timeout_s: float) -> bool:
        """Wait until no connection or request task is left (True), at most timeout_s (False)."""
        try:
            await asyncio.wait_for(self._wait_tasks_to_complete(), timeout=timeout_s)
            return True
        except asyncio.TimeoutError:
            return False


def uvicorn_server(app, graceful_timeout_s: float = 30.0, log_level: str = "warning", abort=None, *,
                   header_timeout_s: Optional[float] = DEFAULT_HEADER_TIMEOUT_S,
                   max_connections: Optional[int] = DEFAULT_MAX_CONNECTIONS) -> uvicorn.Server:
    """The server for `app` on the guarded h11 protocol (`GuardedH11Protocol`: header read timeout,
    OpenAI-shaped protocol errors); `max_connections` is uvicorn's limit_concurrency (connections or
    running requests past it get a 503 with Retry-After). On shutdown `abort` (default: the app's
    driver's stop) ends the requests still running after `graceful_timeout_s` (GracefulServer)."""
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=graceful_timeout_s,
                            access_log=False, http=guarded_protocol(header_timeout_s),
                            limit_concurrency=max_connections)
    if abort is None:  # create_app's: the driver's stop when the app owns its driver
        abort = getattr(getattr(app, "state", None), "abort", None)
    return GracefulServer(config, abort)


class ServerThread:
    """A uvicorn server on a background thread (no signal handlers: those belong to the main thread).
    `exit_on_engine_failure`: the server stops itself when its engine fails (what the CLI does
    before exiting non-zero); `failed` then says why."""

    def __init__(self, app, sock: socket.socket, graceful_timeout_s: float = 5.0, **server_kw):
        self.app, self.sock = app, sock
        self.server = uvicorn_server(app, graceful_timeout_s, **server_kw)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       name="ling-jax-http", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://{host}:{port}"

    @property
    def failed(self) -> Optional[str]:
        return self.app.state.driver.failed

    def start(self, timeout_s: float = 60.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)
        self.sock.close()


def start_server(engine: Engine, tokenizer, *, model_name: str = "ling-jax", host: str = "127.0.0.1",
                 port: int = 0, api_key: Optional[str] = None, max_queue: int = 64, eos_ids=None,
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, body_timeout_s: Optional[float] = DEFAULT_BODY_TIMEOUT_S,
                 header_timeout_s: Optional[float] = DEFAULT_HEADER_TIMEOUT_S,
                 max_connections: Optional[int] = DEFAULT_MAX_CONNECTIONS,
                 exit_on_engine_failure: bool = True) -> ServerThread:
    """Serve `engine` on a background thread; returns once it accepts connections (`.url`)."""
    holder = {}

    def on_failure(reason: str) -> None:
        if exit_on_engine_failure and "srv" in holder:
            holder["srv"].server.should_exit = True

    driver = EngineDriver(engine, max_queue=max_queue, on_failure=on_failure)
    app = create_app(driver, model_info(engine, tokenizer, model_name, eos_ids), api_key=api_key,
                     max_body_bytes=max_body_bytes, body_timeout_s=body_timeout_s)
    srv = ServerThread(app, bind(host, port), header_timeout_s=header_timeout_s, max_connections=max_connections)
    holder["srv"] = srv
    return srv.start()
