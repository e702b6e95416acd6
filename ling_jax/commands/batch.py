"""`ling-jax batch`: a file of requests through the serving engine (continuous batching), offline.

    ling-jax batch --checkpoint CKPT --requests reqs.jsonl [--out out.jsonl] [engine flags]

One JSON object per input line: `input_ids` (a list of ids) or `prompt` (text; needs the
checkpoint's tokenizer), and optionally `max_tokens` (default --max-new-tokens), `temperature`,
`top_k`, `top_p`, `seed`, `stop_ids` (default: the EOS ids). Every request is submitted at once;
the engine admits them as slots free up. Output: one JSON object per request, in input order:
`{"index", "token_ids", "finish_reason"[, "text"]}`; a summary line on stderr (tokens, steps,
throughput, and how many programs were compiled after warm-up: 0 is the engine's promise).

Multi-host (`--coordinator` / `--num-processes` / `--process-id` or the JAX_* variables): every
process runs this same command; process 0 reads the requests, schedules and writes, the others
follow its steps (`Engine.follow`).
"""
from __future__ import annotations

import json
import sys
import time

import jax

import sharding as S
from ling_jax.checks import is_int
from ling_jax.commands.common import (ArgumentValueError, add_kernel_flags, add_value_check_flag,
                                      apply_value_check_flag, check_ids, check_output_path, checkpoint_config,
                                      load_for_args, positive_int)
from ling_jax.commands.engine_args import add_engine_flags, check_engine_flags, engine_from_args
from ling_jax.serve import RequestParams
from ling_jax.tokenizer import Tokenizer

REQUEST_KEYS = ("input_ids", "prompt", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop_ids")
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "seed")
BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


def add_parser(sub):
    p = sub.add_parser("batch", help="run a JSON-lines file of requests through the serving engine")
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (HF or converted)")
    p.add_argument("--requests", required=True, metavar="FILE", help="JSON lines, one request each ('-' = stdin)")
    p.add_argument("--out", default=None, metavar="FILE", help="JSON lines output (default: stdout)")
    p.add_argument("--max-new-tokens", type=positive_int, default=16,
                   help="max_tokens of requests that do not give one")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--mesh", default=None, help="device mesh, e.g. expert=4,model=2 (multi-host: all processes')")
    add_kernel_flags(p)
    add_engine_flags(p)
    add_value_check_flag(p)
    S.add_distributed_args(p)
    return p


def parse_requests(lines, cfg, tokenizer, default_max_tokens: int) -> list:
    """[(prompt ids, RequestParams)] from JSON lines; refusals name the line and the field."""
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--requests line {n}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ArgumentValueError(f"{where}: not JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ArgumentValueError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        unknown = sorted(set(obj) - set(REQUEST_KEYS))
        if unknown:
            raise ArgumentValueError(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(REQUEST_KEYS)})")
        if ("input_ids" in obj) == ("prompt" in obj):
            raise ArgumentValueError(f"{where}: give exactly one of input_ids or prompt")
        if "prompt" in obj:
            if tokenizer is None:
                raise ArgumentValueError(f"{where}: prompt needs the checkpoint's tokenizer.json (give input_ids)")
            if not isinstance(obj["prompt"], str):
                raise ArgumentValueError(f"{where}: prompt must be a string")
            ids = tokenizer.encode(obj["prompt"], add_special_tokens=True)
        else:
            ids = obj["input_ids"]
            if not isinstance(ids, list) or not all(is_int(t) for t in ids):
                raise ArgumentValueError(f"{where}: input_ids must be a list of integers")
        check_ids(ids, cfg, f"{where}: {'prompt' if 'prompt' in obj else 'input_ids'}")
        stop = obj.get("stop_ids")
        if stop is not None:
            if not isinstance(stop, list) or not all(is_int(t) for t in stop):
                raise ArgumentValueError(f"{where}: stop_ids must be a list of integers")
            stop = tuple(stop)
        try:
            params = RequestParams(max_tokens=obj.get("max_tokens", default_max_tokens), stop_ids=stop,
                                   **{k: obj[k] for k in SAMPLING_KEYS if k in obj})
        except (TypeError, ValueError) as e:
            raise ArgumentValueError(f"{where}: {e}") from None
        out.append((list(ids), params))
    if not out:
        raise ArgumentValueError("--requests: no requests (the file has no non-empty line)")
    return out


class _CompileCounter:
    """Counts XLA compilations (and persistent-cache loads among them) while active."""

    def __init__(self):
        self.compiles = self.cache_hits = 0

    def _duration(self, name, *a, **k):
        self.compiles += name == BACKEND_COMPILE_EVENT

    def _event(self, name, *a, **k):
        self.cache_hits += name == CACHE_HIT_EVENT

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._duration)
        jax.monitoring.unregister_event_listener(self._event)

    @property
    def built(self) -> int:
        """Programs compiled here (not loaded from the persistent cache)."""
        return self.compiles - self.cache_hits


def _read_lines(path: str) -> list:
    if path == "-":
        return sys.stdin.read().splitlines()
    with open(path, encoding="utf-8") as f:
        return f.read().splitlines()


def run(args) -> int:
    check_engine_flags(args)
    if args.warmup == "lazy":
        raise ArgumentValueError("--warmup lazy: only `ling-jax serve` warms up lazily (batch: full or off)")
    cfg = checkpoint_config(args.checkpoint)
    S.init_from_args(args)  # multi-host: before anything touches the devices
    tok = requests = None
    refused = None
    if S.is_primary():  # only process 0 needs (and may have) the requests file; checked before loading
        tok = Tokenizer.from_dir(args.checkpoint)
        try:
            if args.out:
                check_output_path(args.out, [args.checkpoint, None if args.requests == "-" else args.requests])
            requests = parse_requests(_read_lines(args.requests), cfg, tok, args.max_new_tokens)
        except (ValueError, OSError) as e:
            refused = e
    if S.process0_verdict(refused is not None, "batch_requests"):  # the others stop too instead of waiting
        if refused is not None:
            raise refused
        raise ArgumentValueError("--requests: process 0 refused the request file (its error says why)")
    apply_value_check_flag(args)
    with _CompileCounter() as start:
        model, _, ex = load_for_args(args, with_mtp=args.speculative > 0)
        engine = engine_from_args(args, model, exec=ex)
    if engine.is_follower:
        engine.follow()
        S.barrier("batch_done")
        return 0
    try:  # whatever happens here, the followers are released and everyone meets at the barrier
        handles = []
        for n, (ids, params) in enumerate(requests, 1):
            try:
                handles.append(engine.submit(ids, params))
            except ValueError as e:
                raise ArgumentValueError(f"--requests request {n}: {e}") from None
        t = time.perf_counter()
        with _CompileCounter() as serving:
            engine.run_until_done()
        elapsed = time.perf_counter() - t
    finally:
        engine.shutdown()
        S.barrier("batch_done")
    rows = []
    for i, h in enumerate(handles):
        row = {"index": i, "token_ids": h.generated, "finish_reason": h.finish_reason}
        if tok is not None:
            row["text"] = tok.decode(h.generated)
        rows.append(json.dumps(row))
    text = "\n".join(rows) + "\n"
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    st = engine.stats()
    print(f"batch: {len(handles)} requests, {st['tokens_generated']} tokens in {st['steps']} engine steps, "
          f"{elapsed:.2f} s ({st['tokens_generated'] / max(elapsed, 1e-9):.1f} tokens/s), "
          f"{st['preemptions']} preemptions; processes={jax.process_count()} devices={jax.device_count()}; "
          f"start-up compiles: {start.built} (+{start.cache_hits} from the persistent compilation cache); "
          f"compiles while serving: {serving.built}", file=sys.stderr, flush=True)
    return 0

