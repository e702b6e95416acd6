"""Issue 24: no request takes the server down.

Each finding of the outside probe is a test here that failed before the fix:
- a request field the engine cannot represent (`top_k: 2**31`, `2**63`) is a 400 naming it, the
  engine keeps serving; every numeric field of both routes is driven with edge values by a
  hypothesis property test through the real server (200 or a 4xx naming the field, never 5xx, the
  greedy reference exact afterwards);
- an engine that dies anyway gives running streams a final error chunk, /health says so, new
  requests a 503 (not a 429), and the CLI server exits non-zero;
- text that is not Unicode scalar values (a lone surrogate, escaped or as raw bytes ED A0 80) is a
  400 naming the field, on a connection that stays usable;
- large prompts are tokenised off the event loop: a running stream keeps receiving chunks;
- slow and abusive clients: header and body read timeouts (408), a connection cap (503 JSON),
  Retry-After on 429, protocol-level 400s in OpenAI's JSON, the chat context error naming
  `messages`, GET /v1/models/{id}, cancellations counted, an oversize body a 413 urllib can read.

One in-process server (module scope) on the tiny 4-layer model of test_server.py, with short
timeouts and a small queue so the limits are reachable quickly.
"""
import json
import math
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from types import SimpleNamespace

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from ling_jax.serve import Engine, RequestParams
from ling_jax.server import start_server
from ling_jax.tokenizer import Tokenizer
from test_server import ENGINE, MAX_SEQ, _cfg  # one tiny served model for both files
MAX_QUEUE = 4
TIMEOUT_S = 2.0
MAX_CONNECTIONS = 24
PROMPT = "The river ran quietly"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from ling_jax.checkpoint.writer import write_checkpoint
    from ling_jax.loader import load_model
    d = str(tmp_path_factory.mktemp("robust") / "tiny")
    write_checkpoint(_cfg(), d, dtype="bf16", seed=3, progress=False)
    model = load_model(d, "float32", progress=False)
    eng = Engine(model, **ENGINE)
    eng.warmup()
    tok = Tokenizer.from_dir(d)
    srv = start_server(eng, tok, model_name="tiny", max_queue=MAX_QUEUE, header_timeout_s=TIMEOUT_S,
                       body_timeout_s=TIMEOUT_S, max_connections=MAX_CONNECTIONS)
    http = httpx.Client(base_url=srv.url, timeout=60)
    ref = http.post("/v1/completions", json=dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                                  return_token_ids=True)).json()["choices"][0]
    yield SimpleNamespace(dir=d, tok=tok, srv=srv, url=srv.url, http=http, engine=eng, model=model,
                          driver=srv.app.state.driver, ref=(ref["text"], ref["token_ids"]))
    http.close()
    srv.stop()


def _metrics(url):
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def _idle(served, timeout=30.0):
    """Wait (bounded) until no slot, page or request is in use (the engine's own stats)."""
    deadline = time.monotonic() + timeout
    while True:
        s = served.driver.stats
        if s["slots_in_use"] == s["pages_in_use"] == served.driver.in_flight == s["queue_depth"] == 0:
            return s
        assert time.monotonic() < deadline, f"still busy after {timeout} s: {s} in flight {served.driver.in_flight}"
        time.sleep(0.05)


def _reference_exact(served):
    r = served.http.post("/v1/completions", json=dict(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0,
                                                       return_token_ids=True))
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert (c["text"], c["token_ids"]) == served.ref
    assert served.http.get("/health").status_code == 200


def _error(r, status, param=None):
    assert r.status_code == status, (r.status_code, r.text)
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    if param is not None:
        assert err["param"] == param, err
    return err


# ---- 1. engine supervision -------------------------------------------------------------------------
@pytest.mark.parametrize("value", [2 ** 31, 2 ** 63, 2 ** 64 + 5])
def test_top_k_beyond_int32_is_400_and_the_engine_keeps_serving(served, value):
    body = dict(model="tiny", prompt="def f(x):", max_tokens=4, temperature=1.0, top_k=value)
    err = _error(served.http.post("/v1/completions", json=body), 400, "top_k")
    assert "top_k" in err["message"] and "2147483647" in err["message"]
    _reference_exact(served)


def test_request_and_sampling_params_refuse_what_int32_cannot_hold():
    from ling_jax.sampling import SamplingParams
    for kw, field in ((dict(top_k=2 ** 31), "top_k"), (dict(max_tokens=2 ** 31), "max_tokens"),
                      (dict(stop_ids=(2 ** 31,)), "stop_ids"), (dict(temperature=math.inf), "temperature"),
                      (dict(seed=2 ** 32), "seed"), (dict(top_p=math.nan), "top_p")):
        with pytest.raises(ValueError, match=field):
            RequestParams(**kw)
    for kw, field in ((dict(top_k=2 ** 31), "top_k"), (dict(temperature=math.inf), "temperature"),
                      (dict(seed=2 ** 63), "seed"), (dict(seed=-1), "seed")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)
    RequestParams(top_k=2 ** 31 - 1, max_tokens=2 ** 31 - 1, stop_ids=(2 ** 31 - 1,), seed=2 ** 32 - 1)


def test_engine_refusing_any_exception_answers_400_and_goes_on(served, monkeypatch):
    """An exception of any type from Engine.submit (the request's own data) is that request's 400."""
    real = Engine.submit

    def submit(self, prompt_ids, params=RequestParams(), on_tokens=None):
        if params.max_tokens == 7:
            raise OverflowError("Python integer out of bounds for int32")
        return real(self, prompt_ids, params, on_tokens)
    monkeypatch.setattr(Engine, "submit", submit)
    r = served.http.post("/v1/completions", json=dict(model="tiny", prompt=PROMPT, max_tokens=7))
    err = _error(r, 400)
    assert "out of bounds" in err["message"]
    assert served.driver.alive
    monkeypatch.undo()
    _reference_exact(served)


def test_engine_failure_fails_streams_health_says_so_and_no_429(served):
    """A dead engine thread: the running stream ends with an error chunk, /health names the failure,
    a new request is a 503 (not a 429 'queue full'); with exit_on_engine_failure the server stops."""
    eng = Engine(served.model, **ENGINE)
    srv = start_server(eng, served.tok, model_name="tiny", exit_on_engine_failure=False)
    try:
        steps = {"n": 0}
        real = eng.step

        def step():
            steps["n"] += 1
            if steps["n"] > 3:
                raise RuntimeError("injected device failure")
            return real()
        eng.step = step
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            with c.stream("POST", "/v1/completions", json=dict(model="tiny", prompt=PROMPT, max_tokens=40,
                                                                temperature=0, ignore_eos=True, stream=True)) as r:
                assert r.status_code == 200
                lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
            assert lines[-1] == "data: [DONE]"
            last = json.loads(lines[-2][len("data: "):])
            assert "error" in last and "engine" in last["error"]["message"], lines[-3:]
            h = c.get("/health")
            assert h.status_code == 503 and "injected device failure" in h.json()["error"]["message"]
            r2 = c.post("/v1/completions", json=dict(model="tiny", prompt=PROMPT, max_tokens=2))
            assert r2.status_code == 503, r2.text
        assert srv.failed and "injected" in srv.failed
    finally:
        srv.stop()


@pytest.mark.slow
def test_cli_server_exits_nonzero_when_the_engine_dies(served, tmp_path):
    """`ling-jax serve` whose engine step raises: the stream gets its error chunk and the process
    exits 1 on its own (a supervisor restarts it), never a live process answering only 503."""
    code = (
        "import sys\n"
        "from ling_jax.serve.engine import Engine\n"
        "real = Engine.step\n"
        "def step(self):\n"
        "    if self.stats()['steps'] >= 2:\n"
        "        raise RuntimeError('injected device failure')\n"
        "    return real(self)\n"
        "Engine.step = step\n"
        "from ling_jax.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))] + sys.path))
    p = subprocess.Popen([sys.executable, "-c", code, "serve", "--checkpoint", served.dir, "--port", "0",
                          "--served-model-name", "tiny", "--dtype", "float32", "--max-slots", "2", "--page-size", "8",
                          "--cache-memory", "0.001", "--max-seq-len", str(MAX_SEQ), "--prefill-chunk", "8",
                          "--no-warmup", "--graceful-timeout", "5"],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    err_lines = []
    try:
        url = None
        deadline = time.monotonic() + 300
        while url is None:
            line = p.stderr.readline()
            err_lines.append(line)
            assert line or p.poll() is None, "server exited early: " + "".join(err_lines)
            if line.startswith("serving "):
                url = line.split(" on ")[1].strip().removesuffix("/v1")
            assert time.monotonic() < deadline
        drain = threading.Thread(target=lambda: err_lines.extend(p.stderr), daemon=True)
        drain.start()
        with httpx.Client(base_url=url, timeout=120) as c:
            with c.stream("POST", "/v1/completions", json=dict(prompt=PROMPT, max_tokens=30, temperature=0,
                                                                ignore_eos=True, stream=True)) as r:
                lines = [ln for ln in r.iter_lines() if ln.startswith("data: ")]
        assert lines[-1] == "data: [DONE]" and "error" in json.loads(lines[-2][6:])
        rc = p.wait(timeout=90)
        drain.join(10)
        err = "".join(err_lines)
        assert rc == 1, err
        assert "injected device failure" in err.strip().splitlines()[-1], err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


# ---- 2. every numeric field bounded: a property test through the real server -----------------------
HUGE = "x" * 200_000
EDGE = [0, -1, 1, 2 ** 31 - 1, 2 ** 31, 2 ** 63, -2 ** 63, 2 ** 64, math.nan, math.inf, -math.inf, 0.5, -2.5, 1e308,
        HUGE, "", True, None, [], {}]
COMMON = ["max_tokens", "temperature", "top_p", "top_k", "n", "seed", "stop", "stop_token_ids", "presence_penalty",
          "frequency_penalty", "repetition_penalty", "ignore_eos", "return_token_ids", "user", "model", "stream",
          "stream_options"]
COMPLETION_FIELDS = COMMON + ["logprobs", "echo", "prompt", "prompt_ids", "prompt_strings"]
CHAT_FIELDS = COMMON + ["max_completion_tokens", "logprobs", "top_logprobs", "messages_content", "messages_name"]


def _body(route: str, field: str, value):
    if route == "completions":
        body = dict(model="tiny", prompt=PROMPT, max_tokens=2)
    else:
        body = dict(model="tiny", messages=[{"role": "user", "content": "Hello"}], max_tokens=2)
    param = field
    if field == "prompt_ids":
        body["prompt"], param = [1, value], "prompt"
    elif field == "prompt_strings":
        body["prompt"], param = ["ok", value], "prompt"
    elif field == "messages_content":
        body["messages"][0]["content"], param = value, "messages"
    elif field == "messages_name":
        body["messages"][0]["name"], param = value, "messages"
    elif field == "stop_token_ids":
        body[field] = [value]
    elif field == "max_completion_tokens":
        body.pop("max_tokens")
        body[field] = value
    elif field == "top_logprobs":
        body["logprobs"] = True
        body[field] = value
    else:
        body[field] = value
    return body, param


def test_edge_values_of_every_field_give_200_or_4xx_naming_it(served):
    """Hypothesis draws (route, field, edge value) through the real server: 200 or a 4xx in OpenAI's
    JSON naming the field, never a 5xx; the engine alive throughout and, afterwards, idle and exact."""
    seen = []

    @settings(max_examples=400, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def prop(data):
        route = data.draw(st.sampled_from(["completions", "chat"]))
        field = data.draw(st.sampled_from(COMPLETION_FIELDS if route == "completions" else CHAT_FIELDS))
        value = data.draw(st.sampled_from(EDGE))
        body, param = _body(route, field, value)
        path = "/v1/completions" if route == "completions" else "/v1/chat/completions"
        r = served.http.post(path, content=json.dumps(body, allow_nan=True),
                             headers={"content-type": "application/json"})
        seen.append(r.status_code)
        assert r.status_code < 500, (field, repr(value)[:40], r.status_code, r.text[:300])
        if r.status_code >= 400:
            err = _error(r, r.status_code)
            # "n" may be named when a valid value makes the request larger than this server holds
            assert err["param"] in (param, "n"), (field, repr(value)[:40], err)
            assert param in err["message"] or err["param"] == "n", err
        assert served.driver.alive

    t = time.monotonic()
    prop()
    print(f"{len(seen)} requests in {time.monotonic() - t:.1f} s: {sorted(set(seen))}")
    assert 200 in seen and 400 in seen
    _idle(served)
    _reference_exact(served)


# ---- 3. text in, safely -------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", b'{"prompt": "abc\\ud800def", "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": ["ok", "abc\\udfffdef"], "max_tokens": 2}', "prompt"),
    ("/v1/completions", b'{"prompt": "abc\xed\xa0\x80def", "max_tokens": 2}', "prompt"),  # raw ED A0 80
    ("/v1/completions", b'{"prompt": "abc", "stop": ["\\ud800"], "max_tokens": 2}', "stop"),
    ("/v1/completions", b'{"prompt": "abc", "stop": "x\xed\xb0\x80", "max_tokens": 2}', "stop"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}',
     "messages"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": '
                             b'"\xed\xa0\x80"}]}], "max_tokens": 2}', "messages"),
    ("/tokenize", b'{"prompt": "abc\\ud800def"}', "prompt"),
    ("/tokenize", b'{"messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', "messages"),
])
def test_lone_surrogates_are_400_naming_the_field_and_the_connection_stays(served, path, body, param):
    with httpx.Client(base_url=served.url, timeout=30) as c:
        r = c.send(c.build_request("POST", path, content=body, headers={"content-type": "application/json"}))
        err = _error(r, 400, param)
        assert "surrogate" in err["message"] and "Unicode" in err["message"]
        assert r.headers.get("connection", "").lower() != "close"
        # the same pooled connection answers the next request
        ok = c.post("/v1/completions", json=dict(model="tiny", prompt=PROMPT, max_tokens=2))
        assert ok.status_code == 200


def test_stop_strings_are_bounded(served):
    """A stop string is matched on the event loop against every piece of text: at most 1024
    characters (a 4 MiB one made each token's match quadratic in it)."""
    err = _error(served.http.post("/v1/completions", json=dict(prompt=PROMPT, max_tokens=2, stop=["y" * 1025])),
                 400, "stop")
    assert "1024" in err["message"]
    r = served.http.post("/v1/completions", json=dict(prompt=PROMPT, max_tokens=2, stop=["y" * 1024]))
    assert r.status_code == 200, r.text


def test_prompt_lists_are_bounded(served):
    """At most 2048 prompts in one request (a 4 MiB body of [[1],[1],...] was 800k request plans)."""
    err = _error(served.http.post("/v1/completions", json=dict(prompt=[[1]] * 2049, max_tokens=1)), 400, "prompt")
    assert "2048" in err["message"]
    _error(served.http.post("/v1/completions", json=dict(prompt=["a"] * 2049, max_tokens=1)), 400, "prompt")
    # within the bound, but more choices than the server holds: refused naming n's budget, at once
    _error(served.http.post("/v1/completions", json=dict(prompt=[[1]] * 2048, max_tokens=1)), 400, "n")
    assert served.http.post("/detokenize", json=dict(tokens=[1, 2, 3])).status_code == 200
    _error(served.http.post("/detokenize", json=dict(tokens=[1, 10 ** 6])), 400, "tokens")


def test_large_prompts_do_not_stall_running_streams(served):
    """While three ~1.5 MB prompts are tokenised (each takes seconds; refused afterwards for the
    context), streams keep receiving chunks: the longest gap stays far below a tokenisation."""
    gaps, stop = [], threading.Event()

    def streamer():
        with httpx.Client(base_url=served.url, timeout=60) as c:
            last = time.monotonic()
            while not stop.is_set():
                with c.stream("POST", "/v1/completions", json=dict(model="tiny", prompt=PROMPT, max_tokens=40,
                                                                    temperature=0, ignore_eos=True,
                                                                    stream=True)) as r:
                    assert r.status_code == 200, r.read()
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            now = time.monotonic()
                            gaps.append(now - last)
                            last = now
    big = "The river ran quietly, numbers matter. " * 40_000  # 1.56 MB
    done = []

    def poster():
        t = time.monotonic()
        with httpx.Client(base_url=served.url, timeout=120) as c:
            r = c.post("/v1/completions", json=dict(model="tiny", prompt=big, max_tokens=2))
        done.append((r.status_code, r.json()["error"]["param"], time.monotonic() - t))

    th = threading.Thread(target=streamer)
    th.start()
    time.sleep(1.0)  # the stream is running
    gaps.clear()
    posters = [threading.Thread(target=poster) for _ in range(3)]
    t0 = time.monotonic()
    for p in posters:
        p.start()
    for p in posters:
        p.join(300)
    busy = time.monotonic() - t0
    stop.set()
    th.join(120)
    assert [d[:2] for d in done] == [(400, "prompt")] * 3, done
    assert len(gaps) > 10, (gaps, done, busy)
    print(f"tokenising 3 x {len(big) / 1e6:.2f} MB took {busy:.1f} s; longest gap between stream chunks "
          f"{max(gaps):.2f} s over {len(gaps)} chunks")
    # before the fix the loop stood still for each whole tokenisation (seconds: busy / 3 at least)
    assert max(gaps) < min(2.5, busy / 3), (max(gaps), busy)
    _idle(served)


# ---- 4. slow and abusive clients ---------------------------------------------------------------------
def _connect(served) -> socket.socket:
    host, port = served.url[len("http://"):].rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=30)
    return s


def _read_all(s: socket.socket, limit_s: float = 30.0) -> bytes:
    s.settimeout(limit_s)
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except (ConnectionResetError, socket.timeout):
            break
        if not chunk:
            break
        out += chunk
    return out


def _json_of(raw: bytes) -> tuple[int, dict, dict]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    return status, headers, json.loads(body)


def test_half_sent_request_head_gets_408_and_is_closed(served):
    s = _connect(served)
    t = time.monotonic()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
    raw = _read_all(s)
    took = time.monotonic() - t
    status, headers, body = _json_of(raw)
    assert status == 408 and body["error"]["code"] == "request_timeout" and headers["connection"] == "close"
    assert TIMEOUT_S * 0.8 < took < TIMEOUT_S + 5
    s.close()
    s = _connect(served)  # a connection that sends nothing is closed too
    t = time.monotonic()
    assert _read_all(s) == b"" and time.monotonic() - t < TIMEOUT_S + 5
    s.close()


def test_half_sent_body_gets_408(served):
    s = _connect(served)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 100\r\n\r\n{\"prompt\": ")
    t = time.monotonic()
    status, headers, body = _json_of(_read_all(s))
    assert status == 408 and "body" in body["error"]["message"] and time.monotonic() - t < TIMEOUT_S + 5
    s.close()
    _reference_exact(served)


def test_malformed_http_is_openai_json(served):
    s = _connect(served)
    s.sendall(b"GARBAGE\x00 / NOPE\r\n\r\n")
    status, headers, body = _json_of(_read_all(s))
    assert status == 400 and body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    s.close()


def test_connection_cap_answers_503_json_with_retry_after(served):
    idle = [_connect(served) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)
        s = _connect(served)
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers, body = _json_of(_read_all(s, 10))
        s.close()
        assert status == 503 and headers.get("retry-after") and body["error"]["code"] == "server_busy"
    finally:
        for s in idle:
            s.close()
    time.sleep(0.2)
    assert served.http.get("/v1/models").status_code == 200


def test_queue_full_429_has_retry_after(served):
    cap = ENGINE["max_slots"] + MAX_QUEUE
    with httpx.Client(base_url=served.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=dict(model="tiny", prompt=PROMPT, max_tokens=40, n=cap,
                                                            ignore_eos=True, stream=True)) as r:
            assert r.status_code == 200
            r2 = httpx.post(served.url + "/v1/completions", json=dict(model="tiny", prompt=PROMPT, max_tokens=2))
            err = _error(r2, 429)
            assert err["code"] == "queue_full" and int(r2.headers["retry-after"]) >= 1
    _idle(served)


def test_chat_past_the_context_names_messages(served):
    long = " ".join(["river"] * 100)
    for extra in ({}, {"max_tokens": 1}, {"max_completion_tokens": 1}):
        r = served.http.post("/v1/chat/completions", json=dict(messages=[{"role": "user", "content": long}], **extra))
        err = _error(r, 400, "messages")
        assert err["code"] == "context_length_exceeded"
    r = served.http.post("/v1/completions", json=dict(prompt=long, max_tokens=1))
    _error(r, 400, "prompt")


def test_models_by_id(served):
    r = served.http.get("/v1/models/tiny")
    assert r.status_code == 200 and r.json()["id"] == "tiny" and r.json()["object"] == "model"
    err = _error(served.http.get("/v1/models/gpt-4"), 404, "model")
    assert err["code"] == "model_not_found"


def test_cancellations_counted_under_their_own_label(served):
    key = ("ling_jax_requests_total", (("finish_reason", "cancelled"),))
    before = _metrics(served.url).get(key, 0.0)
    with httpx.Client(base_url=served.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=dict(model="tiny", prompt=PROMPT, max_tokens=40, n=2,
                                                            ignore_eos=True, stream=True)) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # and hang up
    deadline = time.monotonic() + 30
    while _metrics(served.url).get(key, 0.0) < before + 2:
        assert time.monotonic() < deadline, _metrics(served.url)
        time.sleep(0.1)
    _idle(served)


def test_oversize_body_is_a_413_urllib_can_read(served):
    body = json.dumps(dict(model="tiny", prompt="x" * (6 * 2 ** 20), max_tokens=1)).encode()
    req = urllib.request.Request(served.url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(req, timeout=60)
    assert ei.value.code == 413
    err = json.loads(ei.value.read())["error"]
    assert err["code"] == "request_too_large" and str(4 * 2 ** 20) in err["message"]
    _reference_exact(served)
