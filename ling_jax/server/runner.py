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

import socket
import threading
import time
from typing import Optional

import uvicorn

from ling_jax.serve import Engine
from ling_jax.server.app import DEFAULT_MAX_BODY_BYTES, create_app
from ling_jax.server.driver import EngineDriver
from ling_jax.server.requests import ModelInfo


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


def uvicorn_server(app, graceful_timeout_s: float = 30.0, log_level: str = "warning") -> uvicorn.Server:
    config = uvicorn.Config(app, log_level=log_level, lifespan="on", timeout_graceful_shutdown=graceful_timeout_s,
                            access_log=False)
    return uvicorn.Server(config)


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
