"""Soak test of `ling-jax serve`: mixed valid, invalid and cancelled traffic against one server, then
no leak (slots, pages, requests in flight back to 0), the greedy reference exact, bounded RSS growth.

    python tools/soak_server.py --duration 600                 # a tiny synthetic model, in-process
    python tools/soak_server.py --checkpoint DIR --duration 3600 --workers 16
    python tools/soak_server.py --url http://127.0.0.1:8000 --duration 600   # a running server
                                                               # (no RSS / engine-stat check then)

`tests/test_server_soak.py` runs `soak()` for about a minute (marked slow). Every response must be a
200 or a 4xx in OpenAI's error JSON; a 5xx, a transport error on a request that was not cancelled
on purpose, or a broken stream is counted under `failures` (and fails the run).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from collections import Counter

import httpx

PROMPT = "The river ran quietly"
# (kind, route, body changes, expected status): invalid requests the server must refuse by name
_INVALID = [
    ("/v1/completions", {"top_k": 2 ** 31}, "top_k"),
    ("/v1/completions", {"top_k": 2 ** 63}, "top_k"),
    ("/v1/completions", {"max_tokens": 2 ** 31}, "max_tokens"),
    ("/v1/completions", {"temperature": float("nan")}, "temperature"),
    ("/v1/completions", {"top_p": float("inf")}, "top_p"),
    ("/v1/completions", {"seed": -1}, "seed"),
    ("/v1/completions", {"n": 10 ** 6}, "n"),
    ("/v1/completions", {"prompt": "abc\ud800def"}, "prompt"),
    ("/v1/completions", {"stop": ["\udfff"]}, "stop"),
    ("/v1/completions", {"stop_token_ids": [2 ** 40]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": [1, -5]}, "prompt"),
    ("/v1/completions", {"bogus_field": 1}, "bogus_field"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi \ud800"}]}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"top_logprobs": 2 ** 31, "logprobs": True}, "top_logprobs"),
]


def _body(path: str, max_tokens: int, change: dict | None = None) -> dict:
    if path == "/v1/completions":
        b = dict(prompt=PROMPT, max_tokens=max_tokens)
    else:
        b = dict(messages=[{"role": "user", "content": "Tell me about rivers"}], max_tokens=max_tokens)
    b.update(change or {})
    return b


class Soak:
    """Worker threads sending a random mix until the deadline; counts by kind and outcome."""

    def __init__(self, url: str, duration_s: float, workers: int = 8, seed: int = 0, max_tokens: int = 12,
                 model: str | None = None):
        self.url, self.duration, self.workers, self.seed, self.max_tokens = url, duration_s, workers, seed, max_tokens
        self.model = model
        self.counts: Counter = Counter()
        self.failures: list[str] = []
        self._lock = threading.Lock()

    def _note(self, key: str, failure: str | None = None) -> None:
        with self._lock:
            self.counts[key] += 1
            if failure is not None and len(self.failures) < 50:
                self.failures.append(failure)

    def _post(self, c: httpx.Client, path: str, body: dict, raw: bytes | None = None) -> httpx.Response:
        if self.model is not None and raw is None:
            body = {"model": self.model, **body}
        content = raw if raw is not None else json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")
        return c.post(path, content=content, headers={"content-type": "application/json"})

    def _valid(self, c, rng) -> None:
        path = rng.choice(["/v1/completions", "/v1/chat/completions"])
        body = _body(path, rng.randint(1, self.max_tokens), dict(
            temperature=rng.choice([0, 0.7, 1.0]), seed=rng.randrange(2 ** 32), top_k=rng.choice([0, 5, 2 ** 31 - 1]),
            n=rng.choice([1, 1, 2])))
        r = self._post(c, path, body)
        ok = r.status_code == 200 or r.status_code == 429
        self._note(f"valid {r.status_code}", None if ok else f"valid {path} -> {r.status_code} {r.text[:200]}")

    def _stream(self, c, rng, cancel: bool) -> None:
        path = rng.choice(["/v1/completions", "/v1/chat/completions"])
        body = _body(path, self.max_tokens, dict(stream=True, ignore_eos=True, temperature=0.8,
                                                 seed=rng.randrange(99)))
        if self.model is not None:
            body["model"] = self.model
        with c.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                ok = r.status_code == 429
                r.read()
                self._note(f"stream {r.status_code}", None if ok else f"stream -> {r.status_code} {r.text[:200]}")
                return
            lines = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    if cancel and len(lines) >= rng.randint(1, 3):
                        self._note("cancelled")
                        return  # hang up mid-stream
        good = lines and lines[-1] == "data: [DONE]" and all('"error"' not in ln for ln in lines)
        self._note("stream 200", None if good else f"stream broken: {lines[-2:]}")

    def _invalid(self, c, rng) -> None:
        path, change, field = rng.choice(_INVALID)
        r = self._post(c, path, _body(path, 2, change))
        try:
            err = r.json()["error"]
        except Exception:
            err = {}
        ok = 400 <= r.status_code < 500 and err.get("param") == field
        self._note(f"invalid {r.status_code}", None if ok else f"invalid {change} -> {r.status_code} {r.text[:200]}")

    def _malformed(self, c, rng) -> None:
        raw = rng.choice([b"{nope", b"[]", b'{"prompt": "abc\xed\xa0\x80"}', b"\xff\xfe", b""])
        r = self._post(c, "/v1/completions", {}, raw=raw)
        self._note(f"malformed {r.status_code}", None if 400 <= r.status_code < 500 else
                   f"malformed {raw!r} -> {r.status_code} {r.text[:200]}")

    def _worker(self, k: int, deadline: float) -> None:
        rng = random.Random(self.seed * 1000 + k)
        with httpx.Client(base_url=self.url, timeout=120) as c:
            while time.monotonic() < deadline:
                kind = rng.choices(["valid", "stream", "cancel", "invalid", "malformed", "tokenize"],
                                   [4, 2, 2, 3, 1, 1])[0]
                try:
                    if kind == "valid":
                        self._valid(c, rng)
                    elif kind in ("stream", "cancel"):
                        self._stream(c, rng, cancel=kind == "cancel")
                    elif kind == "invalid":
                        self._invalid(c, rng)
                    elif kind == "malformed":
                        self._malformed(c, rng)
                    else:
                        r = c.post("/tokenize", json={"prompt": PROMPT * rng.randint(1, 50)})
                        self._note(f"tokenize {r.status_code}", None if r.status_code == 200 else r.text[:200])
                except httpx.HTTPError as e:
                    self._note("transport error", f"{kind}: {type(e).__name__}: {e}")
                except Exception as e:  # a bug of this client (or an answer it cannot read): a failure too
                    self._note("client error", f"{kind}: {type(e).__name__}: {e}")

    def run(self) -> dict:
        deadline = time.monotonic() + self.duration
        threads = [threading.Thread(target=self._worker, args=(k, deadline), daemon=True) for k in range(self.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(self.duration + 300)
        return {"counts": dict(self.counts), "failures": list(self.failures),
                "requests": sum(self.counts.values())}


def rss_bytes() -> int:
    """This process's resident set size (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def wait_idle(driver, timeout_s: float = 60.0) -> dict:
    """Engine stats once no slot, page, queued or in-flight request is left (bounded wait)."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = dict(driver.stats)
        s["in_flight"] = driver.in_flight
        if s["slots_in_use"] == s["pages_in_use"] == s["queue_depth"] == s["in_flight"] == 0:
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle {timeout_s} s after the soak: {s}")
        time.sleep(0.05)


def greedy(url: str, model: str | None = None) -> tuple:
    body = dict(prompt=PROMPT, max_tokens=8, temperature=0, return_token_ids=True)
    if model:
        body["model"] = model
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    c = r.json()["choices"][0]
    return c["text"], tuple(c["token_ids"])


def tiny_server(workdir: str, checkpoint: str | None = None, **server_kw):
    """An in-process server on `checkpoint` (default: a tiny synthetic 4-layer model written to
    workdir), engine sized for CPU."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from ling_jax.loader import load_model
    from ling_jax.serve import Engine
    from ling_jax.server import start_server
    from ling_jax.tokenizer import Tokenizer
    if checkpoint is None:
        import np_reference as R
        from ling_jax.checkpoint.writer import write_checkpoint
        checkpoint = os.path.join(workdir, "tiny")
        if not os.path.isdir(checkpoint):
            n = 4
            cfg = R.tiny_config(vocab_size=300, eos_token_id=295, pad_token_id=296, num_hidden_layers=n,
                                num_nextn_predict_layers=0, expert_swiglu_limit_list=[0.0] * (n - 1) + [0.6],
                                share_expert_swiglu_limit_list=[0.0] * (n - 1) + [0.8])
            write_checkpoint(cfg, checkpoint, dtype="bf16", seed=3, progress=False)
    model = load_model(checkpoint, "float32", progress=False)
    eng = Engine(model, max_slots=4, page_size=8, num_pages=40, prefill_chunk=8, max_seq_len=64)
    eng.warmup()
    return start_server(eng, Tokenizer.from_dir(checkpoint), model_name="tiny", **server_kw)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=600.0, help="seconds of traffic (default 600)")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--url", default=None, help="soak a running server (no RSS / engine-stat checks)")
    p.add_argument("--model", default=None, help="the model name to send (with --url)")
    p.add_argument("--checkpoint", default=None, help="in-process: this checkpoint (default: a tiny synthetic one)")
    p.add_argument("--workdir", default="/tmp/ling-jax-soak")
    p.add_argument("--max-rss-growth-mib", type=float, default=256.0)
    args = p.parse_args(argv)
    srv = None
    url = args.url
    if url is None:
        os.makedirs(args.workdir, exist_ok=True)
        srv = tiny_server(args.workdir, args.checkpoint, max_queue=16)
        url = srv.url
    try:
        ref = greedy(url, args.model)
        Soak(url, min(30.0, args.duration / 10), args.workers, args.seed + 1, model=args.model).run()  # warm-up
        rss0 = rss_bytes()
        t = time.monotonic()
        res = Soak(url, args.duration, args.workers, args.seed, model=args.model).run()
        res["seconds"] = round(time.monotonic() - t, 1)
        if srv is not None:
            res["idle_stats"] = {k: v for k, v in wait_idle(srv.app.state.driver).items()
                                 if k in ("slots_in_use", "pages_in_use", "queue_depth", "in_flight")}
            res["rss_growth_mib"] = round((rss_bytes() - rss0) / 2 ** 20, 1)
        res["reference_exact"] = greedy(url, args.model) == ref
        print(json.dumps(res, indent=1))
        ok = (not res["failures"] and res["reference_exact"]
              and res.get("rss_growth_mib", 0) < args.max_rss_growth_mib)
        return 0 if ok else 1
    finally:
        if srv is not None:
            srv.stop()


if __name__ == "__main__":
    sys.exit(main())
