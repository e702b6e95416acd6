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
import logging
import socket
import threading
import time
from typing import Optional

import uvicorn

from ling_jax.serve import Engine
from ling_jax.server.app import DEFAULT_MAX_BODY_BYTES, create_app
from ling_jax.server.driver import EngineDriver
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


def uvicorn_server(app, graceful_timeout_s: float = 30.0, log_level: str = "warning",
                   abort=None) -> uvicorn.Server:
    """The server for `app`; on shutdown `abort` (default: the app's driver's stop) ends the
    requests still running after `graceful_timeout_s` (GracefulServer)."""
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=graceful_timeout_s,
                            access_log=False)
    if abort is None:  # create_app's: the driver's stop when the app owns its driver
        abort = getattr(getattr(app, "state", None), "abort", None)
    return GracefulServer(config, abort)


class ServerThread:
    """A uvicorn server on a background thread (no signal handlers: those belong to the main thread)."""

    def __init__(self, app, sock: socket.socket, graceful_timeout_s: float = 5.0):
        self.app, self.sock = app, sock
        self.server = uvicorn_server(app, graceful_timeout_s)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]},
                                       name="ling-jax-http", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://{host}:{port}"

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
                 max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> ServerThread:
    """Serve `engine` on a background thread; returns once it accepts connections (`.url`)."""
    driver = EngineDriver(engine, max_queue=max_queue)
    app = create_app(driver, model_info(engine, tokenizer, model_name, eos_ids), api_key=api_key,
                     max_body_bytes=max_body_bytes)
    return ServerThread(app, bind(host, port)).start()
