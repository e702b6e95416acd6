"""`ling-jax serve` driven by the real `openai` client: completions and chat, streamed and not, n,
stop strings, seeds, logprobs, usage; greedy = `ling-jax generate`; every bad request a 4xx in
OpenAI's error JSON while good streams carry on; 64 concurrent streams; a killed client frees its
slot; the bounded queue answers 429; the CLI server exits 0 on SIGTERM.

One in-process server (module scope, loopback, a free port) serves most tests; a tiny 4-layer
model keeps the compiles few (3 programs) on CPU.
"""
import asyncio
import json
import math
import os
import random
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import np_reference as R
from ling_jax.cli import main as cli_main
from ling_jax.serve import Engine
from ling_jax.server import ServerThread, start_server
from ling_jax.server.app import create_app
from ling_jax.server.runner import bind, model_info
from ling_jax.tokenizer import Tokenizer

MAX_SEQ, EOS = 64, 295
ENGINE = dict(max_slots=4, page_size=8, num_pages=40, prefill_chunk=8, max_seq_len=MAX_SEQ)


def _cfg():
    n = 4
    return R.tiny_config(vocab_size=300, eos_token_id=EOS, pad_token_id=296, num_hidden_layers=n,
                         num_nextn_predict_layers=0, expert_swiglu_limit_list=[0.0] * (n - 1) + [0.6],
                         share_expert_swiglu_limit_list=[0.0] * (n - 1) + [0.8])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from ling_jax.checkpoint.writer import write_checkpoint
    from ling_jax.loader import load_model
    d = str(tmp_path_factory.mktemp("serve") / "tiny")
    write_checkpoint(_cfg(), d, dtype="bf16", seed=3, progress=False)
    model = load_model(d, "float32", progress=False)
    eng = Engine(model, **ENGINE)
    eng.warmup()
    tok = Tokenizer.from_dir(d)
    srv = start_server(eng, tok, model_name="tiny", max_queue=64)
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield SimpleNamespace(dir=d, tok=tok, srv=srv, client=client, engine=eng,
                          driver=srv.app.state.driver)
    srv.stop()


def _metrics(url):
    text = httpx.get(url + "/metrics", timeout=10).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def _idle(served, timeout=30.0):
    """Wait (bounded) until no slot, page or request is in use; return the metrics."""
    deadline = time.monotonic() + timeout
    while True:
        m = _metrics(served.srv.url)
        if m["ling_jax_slots_running"] == m["ling_jax_pages_in_use"] == m["ling_jax_requests_in_flight"] == 0:
            return m
        assert time.monotonic() < deadline, f"still busy after {timeout} s: {m}"
        time.sleep(0.05)


def _stream_text(stream):
    text, finish, usage, ids = "", None, None, []
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            text += getattr(c, "text", None) or (c.delta.content if hasattr(c, "delta") and c.delta.content else "")
            finish = c.finish_reason or finish
            ids += (c.model_extra or {}).get("token_ids") or []
    return text, finish, usage, ids


def test_completion_usage_stream_and_generate_cli(served, capsys):
    c, tok = served.client, served.tok
    prompt = "The river ran quietly"
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                             extra_body={"return_token_ids": True})
    ch = r.choices[0]
    ids = ch.model_extra["token_ids"]
    assert r.object == "text_completion" and r.model == "tiny" and ch.index == 0
    assert r.usage.prompt_tokens == len(tok.encode(prompt, add_special_tokens=True))
    assert r.usage.completion_tokens == len(ids) and r.usage.total_tokens == r.usage.prompt_tokens + len(ids)
    assert ch.text == tok.decode(ids)
    assert ch.finish_reason == ("stop" if ids[-1] == EOS else "length") and (len(ids) == 10 or ids[-1] == EOS)
    # streamed: the same text, ids and usage
    text, finish, usage, sids = _stream_text(c.completions.create(
        model="tiny", prompt=prompt, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"return_token_ids": True}))
    assert (text, finish, sids) == (ch.text, ch.finish_reason, ids) and usage == r.usage
    # greedy = `ling-jax generate` on the same checkpoint and prompt
    assert cli_main(["generate", "--checkpoint", served.dir, "--prompt", prompt, "--max-new-tokens", "10",
                     "--dtype", "float32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == ids
    # token-id prompts, several prompts, echo
    two = [tok.encode(prompt), tok.encode("Numbers matter")]
    r2 = c.completions.create(model="tiny", prompt=two, max_tokens=4, temperature=0, echo=True)
    assert [x.index for x in r2.choices] == [0, 1]
    assert r2.choices[0].text == prompt + tok.decode(ids[:4])
    assert r2.choices[1].text.startswith("Numbers matter")
    assert r2.usage.prompt_tokens == len(two[0]) + len(two[1])
    r3 = c.completions.create(model="tiny", prompt=[prompt, "Numbers matter"], max_tokens=4, temperature=0)
    assert [x.text for x in r3.choices] == [tok.decode(ids[:4]), r2.choices[1].text[len("Numbers matter"):]]


def test_chat_n_seeds_and_streaming(served):
    c, tok = served.client, served.tok
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    want_prompt = tok.encode(tok.apply_chat_template([{"role": "system", "content": "be brief"},
                                                      {"role": "user", "content": "hi"}]))
    g = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0)
    assert g.object == "chat.completion" and g.choices[0].message.role == "assistant"
    assert g.usage.prompt_tokens == len(want_prompt)
    s = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert s[0].choices[0].delta.role == "assistant" and s[-1].choices == [] and s[-1].usage == g.usage
    assert _stream_text(s)[:2] == (g.choices[0].message.content, g.choices[0].finish_reason)
    # sampled: the same seed gives the same texts; n=2 gives two choices of their own streams
    kw = dict(model="tiny", messages=msgs, max_tokens=8, temperature=1.0, top_p=0.9, seed=7, n=2,
              extra_body={"return_token_ids": True, "ignore_eos": True})
    a, b = c.chat.completions.create(**kw), c.chat.completions.create(**kw)
    assert [x.index for x in a.choices] == [0, 1]
    assert [x.message.content for x in a.choices] == [x.message.content for x in b.choices]
    ids = [x.model_extra["token_ids"] for x in a.choices]
    assert ids[0] != ids[1] and a.usage.completion_tokens == 16
    other = c.chat.completions.create(**{**kw, "seed": 8, "n": 1})
    assert other.choices[0].model_extra["token_ids"] != ids[0]
    # streamed sampled n=2 = non-streamed, choice by choice
    per = {0: "", 1: ""}
    for ch in c.chat.completions.create(**kw, stream=True):
        for x in ch.choices:
            per[x.index] += x.delta.content or ""
    assert [per[0], per[1]] == [x.message.content for x in a.choices]


def test_stop_strings_and_stop_token_ids(served):
    c, tok = served.client, served.tok
    base = c.completions.create(model="tiny", prompt="Questions and answers:", max_tokens=24, temperature=0,
                                extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    text, ids = base.text, base.model_extra["token_ids"]
    # a stop string from the middle of the text, two characters long (so it may span tokens)
    i = next(k for k in range(4, len(text) - 2) if "\ufffd" not in text[k:k + 2])
    stop = text[i:i + 2]
    cut = text[:text.find(stop)]
    for stream in (False, True):
        kw = dict(model="tiny", prompt="Questions and answers:", max_tokens=24, temperature=0,
                  stop=[stop, "never-there"], extra_body={"ignore_eos": True, "return_token_ids": True})
        if stream:
            got, finish, _, sids = _stream_text(c.completions.create(**kw, stream=True))
        else:
            r = c.completions.create(**kw)
            got, finish, sids = r.choices[0].text, r.choices[0].finish_reason, r.choices[0].model_extra["token_ids"]
        assert (got, finish) == (cut, "stop")
        assert sids == ids[:len(sids)] and stop in tok.decode(sids) and stop not in tok.decode(sids[:-1])
    # stop_token_ids: ends at the first occurrence, the stop token counted but its text left out
    k = 5
    r = c.completions.create(model="tiny", prompt="Questions and answers:", max_tokens=24, temperature=0,
                             extra_body={"ignore_eos": True, "stop_token_ids": [ids[k]], "return_token_ids": True})
    first = ids.index(ids[k])
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == first + 1
    assert r.choices[0].text == tok.decode(ids[:first])


def test_logprobs(served):
    c, tok = served.client, served.tok
    r = c.completions.create(model="tiny", prompt="Numbers matter", max_tokens=5, temperature=0, logprobs=3,
                             extra_body={"ignore_eos": True, "return_token_ids": True})
    lp, ids = r.choices[0].logprobs, r.choices[0].model_extra["token_ids"]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) == 5
    for tid, s, v, top in zip(ids, lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert s == tok.decode([tid], skip_special_tokens=False) and v <= 0 and len(top) == 3
        assert math.isclose(max(top.values()), v, rel_tol=1e-5, abs_tol=1e-6)  # greedy: the top token
    assert lp.text_offset == list(np.cumsum([0] + [len(s) for s in lp.tokens[:-1]]))
    ch = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                   temperature=0, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = ch.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert "".join(t.token for t in content) == ch.choices[0].message.content
    # streamed logprobs = non-streamed
    s = c.completions.create(model="tiny", prompt="Numbers matter", max_tokens=5, temperature=0, logprobs=3,
                             stream=True, extra_body={"ignore_eos": True})
    vals = [v for chunk in s for x in chunk.choices if x.logprobs for v in x.logprobs.token_logprobs]
    assert np.allclose(vals, lp.token_logprobs)


def _bad_requests(long_ids):
    """(path, body (dict or raw bytes), status, param) for every refusal of issue 13 item 4."""
    ok = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    C, CH = "/v1/completions", "/v1/chat/completions"
    return [
        (C, {**ok, "max_tokens": -1}, 400, "max_tokens"),
        (C, {**ok, "max_tokens": 1000}, 400, "max_tokens"),
        (C, {**ok, "max_tokens": "5"}, 400, "max_tokens"),
        (C, {**ok, "max_tokens": 2.5}, 400, "max_tokens"),
        (C, b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400, "temperature"),
        (C, {**ok, "temperature": -0.5}, 400, "temperature"),
        (C, {**ok, "top_p": 0}, 400, "top_p"),
        (C, {**ok, "top_p": 1.5}, 400, "top_p"),
        (C, {**ok, "n": 0}, 400, "n"),
        (C, {**ok, "n": 100}, 400, "n"),  # more choices than the queue holds
        (C, {**ok, "seed": -1}, 400, "seed"),
        (C, {**ok, "logprobs": 21}, 400, "logprobs"),
        (C, {**ok, "stop": [""]}, 400, "stop"),
        (C, {**ok, "prompt": long_ids}, 400, "prompt"),
        (C, {**ok, "prompt": ""}, 400, "prompt"),
        (C, {**ok, "prompt": []}, 400, "prompt"),
        (C, {**ok, "prompt": [1, 5000]}, 400, "prompt"),
        (C, {**ok, "prompt": 42}, 400, "prompt"),
        (C, {**ok, "frobnicate": 1}, 400, "frobnicate"),
        (C, {"model": "tiny"}, 400, "prompt"),
        (C, b'{"model": "tiny", "prompt": ', 400, None),
        (C, b'[1, 2]', 400, None),
        (C, b'{"model": "tiny", "prompt": "' + b"x" * (10 * 2 ** 20) + b'"}', 413, None),
        (C, {**ok, "model": "gpt-17"}, 404, "model"),
        (CH, {**chat, "messages": []}, 400, "messages"),
        (CH, {**chat, "messages": [{"role": "user", "content": ""}]}, 400, "messages"),
        (CH, {**chat, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages"),
        (CH, {**chat, "top_logprobs": 2}, 400, "top_logprobs"),
        (CH, {**chat, "temperature": "hot"}, 400, "temperature"),
        ("/v1/nothing", ok, 404, None),
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "prompt"),
        ("/detokenize", {"tokens": [99999]}, 400, "tokens"),
    ]


async def _send_bad(client: httpx.AsyncClient, url, cases):
    for path, body, status, param in cases:
        kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
            else {"json": body}
        r = await client.post(url + path, **kw)
        assert r.status_code == status, (path, str(body)[:80], r.status_code, r.text[:200])
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"] and err["param"] == param, \
            (path, str(body)[:80], err)
        assert "Traceback" not in r.text


def test_bad_requests_get_4xx_while_64_streams_run(served):
    """64 concurrent streaming clients (random prompts, lengths, greedy and seeded) all complete, each
    equals its non-streamed result; meanwhile every bad request gets its 4xx; afterwards nothing is held."""
    rng = random.Random(0)
    words = "the river mill water wheel children bank boats market bread apples honey numbers".split()
    jobs = []
    for i in range(64):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12))) if i % 2 else \
            [rng.randrange(0, 290) for _ in range(rng.randint(1, 40))]
        jobs.append(dict(model="tiny", prompt=prompt, max_tokens=rng.randint(1, 8),
                         temperature=0.0 if i % 3 else 0.8, seed=i))
    long_ids = [1] * (MAX_SEQ + 1)

    async def main():
        aclient = openai.AsyncOpenAI(base_url=served.srv.url + "/v1", api_key="unused", max_retries=0, timeout=300)
        sem = asyncio.Semaphore(64)

        async def one(job, stream):
            async with sem:
                if not stream:
                    r = await aclient.completions.create(**job)
                    return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
                text, finish, n = "", None, None
                async for ch in await aclient.completions.create(**job, stream=True,
                                                                 stream_options={"include_usage": True}):
                    if ch.usage is not None:
                        n = ch.usage.completion_tokens
                    for c in ch.choices:
                        text += c.text
                        finish = c.finish_reason or finish
                return text, finish, n

        async with httpx.AsyncClient(timeout=120) as hc:
            streams = asyncio.gather(*(one(j, True) for j in jobs))
            bad = asyncio.create_task(_send_bad(hc, served.srv.url, _bad_requests(long_ids)))
            got = await asyncio.wait_for(streams, 600)
            await asyncio.wait_for(bad, 120)
        want = await asyncio.wait_for(asyncio.gather(*(one(j, False) for j in jobs)), 600)
        await aclient.close()
        return got, want

    got, want = asyncio.run(main())
    assert all(g[1] in ("stop", "length") for g in got)
    for j, g, w in zip(jobs, got, want):
        assert g[2] <= j["max_tokens"]
        assert g == w  # greedy: the same text; seeded sampled: the same stream too
    m = _idle(served)
    assert m["ling_jax_slots_free"] == ENGINE["max_slots"] and m["ling_jax_queue_depth"] == 0
    assert m["ling_jax_generation_tokens_total"] >= sum(g[2] for g in got)
    assert m["ling_jax_time_to_first_token_seconds_count"] >= 128
    for name in ("ling_jax_prefix_cache_hit_rate", "ling_jax_spec_acceptance_length", "ling_jax_pages_total",
                 "ling_jax_prompt_tokens_total", "ling_jax_time_per_output_token_seconds_count"):
        assert name in m


def test_killed_client_frees_its_slot(served):
    before = _metrics(served.srv.url)["ling_jax_generation_tokens_total"]
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 60, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=60) as hc:
        with hc.stream("POST", served.srv.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line.startswith("data: ")).startswith("data: {")
        # leaving the block closes the connection mid-stream
    m = _idle(served)
    assert m["ling_jax_generation_tokens_total"] - before < 60  # cancelled, not run to the end


def test_refusals_do_not_wait_for_a_running_step(served):
    """While the engine is inside a step (held here until released), a request that finds the
    bounded queue full gets its 429 at once, a bad request its 400, and /health answers: the event
    loop never waits for the engine thread. The held request then completes."""
    eng, d = served.engine, served.driver
    gate, entered = threading.Event(), threading.Event()
    step = eng.step

    def held():
        entered.set()
        assert gate.wait(60), "the test never released the step"
        return step()

    cap = d.capacity
    eng.step = held
    try:
        d.capacity = 1
        raw = openai.OpenAI(base_url=served.srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        done = {}
        t = threading.Thread(target=lambda: done.update(r=raw.completions.create(model="tiny", prompt="hi", max_tokens=3)))
        t.start()
        assert entered.wait(30)
        for body, status in (({"model": "tiny", "prompt": "hi", "max_tokens": 2}, 429),
                             ({"model": "tiny", "prompt": "hi", "max_tokens": -1}, 400)):
            t0 = time.monotonic()
            r = httpx.post(served.srv.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == status and time.monotonic() - t0 < 5, (r.status_code, time.monotonic() - t0)
        assert httpx.get(served.srv.url + "/health", timeout=5).status_code == 200
    finally:
        d.capacity = cap
        gate.set()
        eng.step = step
    t.join(60)
    assert done["r"].choices[0].finish_reason in ("stop", "length")
    _idle(served)


def test_queue_full_429_auth_models_tokenize_health(served):
    c, url = served.client, served.srv.url
    d = served.driver
    cap = d.capacity
    d.capacity = 1  # a queue of one whose place is taken: the next request finds it full
    assert d.try_reserve(1)  # the place a running request would hold (deterministic however fast the engine)
    try:
        with pytest.raises(openai.RateLimitError) as e:
            openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30).with_options(
                max_retries=0).completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert e.value.status_code == 429 and e.value.body["code"] == "queue_full"
        assert not d.try_reserve(1)
    finally:
        with d._lock:
            d._in_flight -= 1  # give the place back
        d.capacity = cap
    _idle(served)
    assert c.completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].finish_reason
    # a second app over the same driver, with an API key
    info = model_info(served.engine, served.tok, "tiny")
    keyed = ServerThread(create_app(d, info, api_key="s3cret", owns_driver=False), bind()).start()
    try:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = httpx.post(keyed.url + "/v1/completions", content=b"{bad json", headers=headers, timeout=30)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(keyed.url + "/health", timeout=30).status_code == 200
        kc = openai.OpenAI(base_url=keyed.url + "/v1", api_key="s3cret", max_retries=0, timeout=60)
        assert kc.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0).choices[0].text \
            == c.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0).choices[0].text
    finally:
        keyed.stop()
    models = c.models.list()
    assert [m.id for m in models.data] == ["tiny"] and models.data[0].model_extra["max_model_len"] == MAX_SEQ
    assert httpx.get(url + "/health", timeout=30).json() == {"status": "ok"}
    t = httpx.post(url + "/tokenize", json={"prompt": "Hello world"}, timeout=30).json()
    assert t["tokens"] == served.tok.encode("Hello world", add_special_tokens=True) and t["count"] == len(t["tokens"])
    tm = httpx.post(url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}, timeout=30).json()
    assert tm["tokens"] == served.tok.encode(served.tok.apply_chat_template([{"role": "user", "content": "hi"}]))
    assert httpx.post(url + "/detokenize", json={"tokens": t["tokens"]}, timeout=30).json() == {"prompt": "Hello world"}
    r = httpx.get(url + "/v1/completions", timeout=30)
    assert r.status_code == 405 and r.json()["error"]["message"]


def _start_serve(cmd, env, timeout=400):
    """Popen `ling-jax serve ...`; returns (proc, url) once it prints its address (bounded wait)."""
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    deadline = time.monotonic() + timeout
    try:
        while True:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "ling-jax serve exited before serving"
            assert time.monotonic() < deadline, "ling-jax serve did not start in time"
            if line.startswith("serving "):
                # keep draining stderr so the server never blocks on a full pipe
                threading.Thread(target=lambda: (proc.stderr.read(), proc.stderr.close()), daemon=True).start()
                return proc, line.split(" on ")[1].strip().removesuffix("/v1")
    except BaseException:
        proc.kill()
        proc.wait(30)
        proc.stderr.close()
        raise


@pytest.mark.slow
def test_cli_serve_subprocess_answers_like_in_process_and_exits_0_on_sigterm(served):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd()] + sys.path), "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "ling_jax.cli", "serve", "--checkpoint", served.dir, "--port", "0",
           "--served-model-name", "tiny", "--dtype", "float32", "--max-slots", "4", "--page-size", "8",
           "--cache-memory", "0.001", "--prefill-chunk", "8", "--max-seq-len", str(MAX_SEQ),
           "--graceful-timeout", "20"]
    proc, url = _start_serve(cmd, env)
    try:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        kw = dict(model="tiny", prompt="The river ran quietly", max_tokens=10, temperature=0)
        assert c.completions.create(**kw).choices[0].text == served.client.completions.create(**kw).choices[0].text
        # SIGTERM mid-stream: the stream still finishes, then the process exits 0
        stream = c.completions.create(**{**kw, "max_tokens": 40}, stream=True, extra_body={"ignore_eos": True})
        first = next(iter(stream))
        proc.send_signal(signal.SIGTERM)
        rest = [ch for ch in stream]
        assert first.choices and rest[-1].choices[0].finish_reason == "length"
        assert proc.wait(timeout=120) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


@pytest.mark.slow
def test_multihost_server_answers_like_one_process(served):
    """2 processes x 4 CPU devices (`--mesh expert=4,model=2`): process 0 serves HTTP, process 1
    follows; greedy and seeded completions equal the one-process, one-device server's; SIGTERM to
    process 0 releases the follower and both exit 0."""
    from test_multihost import free_port
    port = free_port()
    cmd = [sys.executable, "-m", "ling_jax.cli", "serve", "--checkpoint", served.dir, "--port", "0",
           "--served-model-name", "tiny", "--dtype", "float32", "--mesh", "expert=4,model=2",
           "--max-slots", "4", "--page-size", "8", "--cache-memory", "0.001", "--prefill-chunk", "8",
           "--max-seq-len", str(MAX_SEQ)]
    env = {**os.environ, "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([os.getcwd()] + sys.path)}
    procs = [subprocess.Popen(cmd, stderr=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              env={**env, "JAX_PROCESS_ID": "1"})]
    try:
        lead, url = _start_serve(cmd, {**env, "JAX_PROCESS_ID": "0"})
        procs.insert(0, lead)
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        for kw in (dict(prompt="The river ran quietly", max_tokens=8, temperature=0),
                   dict(prompt=[5, 6, 7, 8, 9, 10, 11, 12, 13, 14], max_tokens=6, temperature=0.9, seed=4, n=2)):
            got = c.completions.create(model="tiny", **kw)
            want = served.client.completions.create(model="tiny", **kw)
            assert [x.text for x in got.choices] == [x.text for x in want.choices]
        lead.send_signal(signal.SIGTERM)
        assert [p.wait(timeout=120) for p in procs] == [0, 0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(30)


def test_bound_socket_queues_a_client_before_the_server_starts():
    """`ling-jax serve` prints its address before uvicorn's start-up (engine warm-up) has run: a
    client that connects then must wait in the backlog, not be refused (the race a loaded CI hit)."""
    import socket
    sock = bind("127.0.0.1", 0)
    try:
        with socket.create_connection(sock.getsockname()[:2], timeout=5):
            pass  # accepted by the kernel into the backlog: nothing is serving yet
    finally:
        sock.close()


def test_engine_refusal_names_its_request_field(served, monkeypatch):
    """A refusal the engine raises at submit with the field it is about (`RequestFieldError`, e.g.
    penalties under speculative decoding) reaches the client as a 400 naming that field; the server
    then serves the next request as usual."""
    from ling_jax.serve.engine import RequestFieldError
    real = served.engine.submit

    def refuse(prompt_ids, params, on_tokens=None):
        if params.frequency_penalty:
            raise RequestFieldError("frequency_penalty", "RequestParams.frequency_penalty=0.5 is not supported "
                                                         "with speculative decoding")
        return real(prompt_ids, params, on_tokens=on_tokens)

    monkeypatch.setattr(served.engine, "submit", refuse)
    r = httpx.post(served.srv.url + "/v1/completions", timeout=60,
                   json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "frequency_penalty": 0.5})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "frequency_penalty" and "speculative" in err["message"]
    ok = served.client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2
