"""`ling-jax serve`: an OpenAI-compatible HTTP server (ling_jax/server, README "Serve").

Process 0 serves HTTP on --host/--port (127.0.0.1 unless told otherwise); in a multi-host run
every other process builds the same engine and follows process 0's steps (`engine.follow()`).
SIGTERM or Ctrl-C: stop accepting connections, let running requests finish for up to
--graceful-timeout seconds, abort the rest (each still gets its final "abort" chunk and [DONE], or
its whole JSON body: `runner.GracefulServer`), exit 0. `--warmup lazy`: serve at once while the
step programs compile between steps (/health: "starting"). `--checkpoint demo` serves the shipped
demo model (as `demo_model`); `--checkpoint ORG/NAME[@REV]` a Hugging Face Hub checkpoint.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys

from ling_jax.commands.common import (ArgumentValueError, add_kernel_flags, add_value_check_flag,
                                      apply_value_check_flag, checkpoint_config, finite_float, non_negative_int)
from ling_jax.commands.engine_args import add_engine_flags, engine_from_args, warmup_reporter


def positive_seconds(text: str) -> float:
    v = finite_float(text)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return v


def add_parser(sub):
    p = sub.add_parser("serve", help="serve a checkpoint over an OpenAI-compatible HTTP API")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (with tokenizer.json), `demo` (the "
                   "shipped demo model) or a Hugging Face Hub id ORG/NAME[@REVISION]")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=non_negative_int, default=8000, help="port (0: any free port, printed)")
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: the "
                   "checkpoint directory's name; a Hub id without @REVISION; demo_model for `demo`)")
    p.add_argument("--api-key", default=os.environ.get("LING_JAX_API_KEY"),
                   help="require `Authorization: Bearer KEY` (default: env LING_JAX_API_KEY; none = open)")
    p.add_argument("--max-queue", type=non_negative_int, default=256,
                   help="requests that may wait for a slot; beyond that the server answers 429")
    p.add_argument("--max-body-bytes", type=non_negative_int, default=4 * 2 ** 20)
    p.add_argument("--header-timeout", type=positive_seconds, default=10.0, metavar="S",
                   help="seconds a request's head (request line and headers) may take to arrive (default 10)")
    p.add_argument("--body-timeout", type=positive_seconds, default=60.0, metavar="S",
                   help="seconds a request's body may take to arrive (default 60); past either: 408, closed")
    p.add_argument("--max-connections", type=non_negative_int, default=1024, metavar="N",
                   help="open connections (or running requests) at most; past it: 503 with Retry-After")
    p.add_argument("--graceful-timeout", type=positive_seconds, default=30.0, metavar="S",
                   help="on SIGTERM, seconds running requests may take to finish before they are aborted")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--mesh", default=None, help="device mesh, e.g. expert=4,model=2")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    add_kernel_flags(p)
    add_engine_flags(p)
    add_value_check_flag(p)
    from sharding import add_distributed_args
    add_distributed_args(p)
    return p


def run(args) -> int:
    import jax

    from ling_jax.checkpoint.locate import model_name
    from ling_jax.commands.common import load_for_args
    from ling_jax.server.app import create_app
    from ling_jax.server.driver import EngineDriver
    from ling_jax.server.runner import bind, model_info, uvicorn_server
    from ling_jax.tokenizer import Tokenizer, eos_token_ids, load_generation_config

    cfg = checkpoint_config(args.checkpoint)
    tok = Tokenizer.from_dir(args.checkpoint)
    if tok is None:
        raise ValueError(f"--checkpoint: {args.checkpoint} has no tokenizer.json (the server needs one)")
    name = args.served_model_name or model_name(getattr(args, "checkpoint_spec", args.checkpoint))
    apply_value_check_flag(args)
    try:
        sock = bind(args.host, args.port)  # before loading: a taken port fails fast
    except OSError as e:
        raise ArgumentValueError(f"--host/--port: cannot listen on {args.host}:{args.port}: {e.strerror or e} "
                                 "(another server there? choose another --port, or --port 0 for a free one; "
                                 "--host sets the address)") from None
    nproc = getattr(args, "num_processes", None) or os.environ.get("JAX_NUM_PROCESSES") or 1
    if args.warmup == "lazy" and str(nproc) != "1":
        raise ArgumentValueError("--warmup lazy: single-process only (multi-host: --warmup full or off)")
    model, _, ex = load_for_args(args, with_mtp=args.speculative > 0)
    engine = engine_from_args(args, model, exec=ex)
    if jax.process_index() > 0:  # multi-host: follow process 0's steps until it shuts the engine down
        sock.close()
        engine.follow()
        return 0
    eos = eos_token_ids(load_generation_config(args.checkpoint), tok) or list(cfg.eos_token_id)
    on_exit = engine.shutdown if jax.process_count() > 1 else None
    server = None

    def on_failure(reason: str) -> None:  # the engine died: stop serving, exit non-zero (below)
        if server is not None:
            server.should_exit = True

    lazy = engine.warmup_items() if args.warmup == "lazy" else None
    driver = EngineDriver(engine, max_queue=args.max_queue, on_exit=on_exit, on_failure=on_failure, warmup_items=lazy,
                          warmup_progress=warmup_reporter(sys.stderr, "warm-up (lazy)"))
    app = create_app(driver, model_info(engine, tok, name, eos), api_key=args.api_key,
                     max_body_bytes=args.max_body_bytes, body_timeout_s=args.body_timeout)
    server = uvicorn_server(app, args.graceful_timeout, args.log_level, header_timeout_s=args.header_timeout,
                            max_connections=args.max_connections or None)
    host, port = sock.getsockname()[:2]
    if lazy:
        print(f"warm-up (lazy): {len(lazy)} programs compile in the background; /health answers \"starting\" "
              "until they are done", file=sys.stderr, flush=True)
    print(f"serving {name!r} on http://{host}:{port}/v1", file=sys.stderr, flush=True)
    # uvicorn re-raises the signal that stopped it once it has shut down; a handler that only notes
    # it makes that an ordinary return (exit 0) instead of death by the default action
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run(sockets=[sock])
    if driver.failed is not None:  # a supervisor watching the process restarts it
        print(f"error: the engine failed ({driver.failed}); the server stopped", file=sys.stderr, flush=True)
        return 1
    print("server stopped", file=sys.stderr, flush=True)
    return 0
