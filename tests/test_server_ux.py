"""`ling-jax serve` as a user meets it (issue 23): SIGTERM while requests run past
--graceful-timeout (each still ends properly: a final "abort" chunk and [DONE], or a whole JSON
body; no traceback; exit 0), start-up progress lines, the lazy warm-up (/health "starting"),
`--checkpoint demo`, a taken port named with its flags, the README's chat example as written.

Real subprocess servers on 127.0.0.1 (a free port), bounded waits, killed in `finally`."""
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

import np_reference as R

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EOS = 295


def _env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT] + sys.path), "JAX_PLATFORMS": "cpu"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from ling_jax.checkpoint.writer import write_checkpoint
    n = 4
    cfg = R.tiny_config(vocab_size=300, eos_token_id=EOS, pad_token_id=296, num_hidden_layers=n,
                        num_nextn_predict_layers=0, expert_swiglu_limit_list=[0.0] * (n - 1) + [0.6],
                        share_expert_swiglu_limit_list=[0.0] * (n - 1) + [0.8])
    d = str(tmp_path_factory.mktemp("serve_ux") / "tiny")
    write_checkpoint(cfg, d, dtype="bf16", seed=3, progress=False)
    return d


class Served:
    """A `ling-jax serve` subprocess whose stderr is kept (a reader thread) for the test to read."""

    def __init__(self, args, timeout=400, until="serving "):
        self.cmd = [sys.executable, "-m", "ling_jax.cli", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(self.cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env=_env(), cwd=ROOT)
        self.lines, self.url = [], None
        self._seen = threading.Event()
        self._reader = threading.Thread(target=self._read, args=(until,), daemon=True)
        self._reader.start()
        if not self._seen.wait(timeout):
            self.kill()
            raise AssertionError("ling-jax serve did not start in time:\n" + self.stderr[-3000:])
        if self.url is None:
            self.kill()
            raise AssertionError("ling-jax serve exited before serving:\n" + self.stderr[-3000:])

    def _read(self, until):
        for line in self.proc.stderr:
            self.lines.append(line)
            if line.startswith(until) and self.url is None:
                m = re.search(r"(http://\S+?)(/v1)?\s*$", line)
                self.url = m.group(1) if m else None
                self._seen.set()
        self._seen.set()

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def wait(self, timeout):
        rc = self.proc.wait(timeout)
        self._reader.join(30)
        return rc

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


def _engine_flags(max_seq=1024):
    return ["--dtype", "float32", "--max-slots", "4", "--page-size", "8", "--cache-memory", "0.02",
            "--prefill-chunk", "8", "--max-seq-len", str(max_seq)]


@pytest.mark.slow
def test_sigterm_aborts_requests_that_outlive_the_graceful_timeout(tiny_dir):
    """Two requests of ~1000 tokens (streamed and not) run when SIGTERM arrives with a 0.5 s
    --graceful-timeout: the stream gets a final chunk with finish_reason "abort" and `data: [DONE]`,
    the other a complete 200 JSON body with finish_reason "abort"; no traceback, no cancelled
    task; exit 0."""
    srv = Served(["--checkpoint", tiny_dir, "--served-model-name", "tiny", "--no-warmup", "--graceful-timeout",
                  "0.5", *_engine_flags()])
    try:
        body = {"model": "tiny", "prompt": "The river ran quietly", "max_tokens": 1000, "temperature": 0,
                "ignore_eos": True}
        plain = {}

        def non_streamed():
            r = httpx.post(srv.url + "/v1/completions", json=body, timeout=300)
            plain["status"], plain["body"] = r.status_code, r.text
        t = threading.Thread(target=non_streamed, daemon=True)
        t.start()
        events = []
        with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=300) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:  # wait for the first tokens, then SIGTERM
                if line.startswith("data: "):
                    events.append(line[6:])
                    break
            srv.proc.send_signal(signal.SIGTERM)
            for line in lines:
                if line.startswith("data: "):
                    events.append(line[6:])
        t.join(120)
        assert events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])
        assert last["choices"][0]["finish_reason"] == "abort"
        n_streamed = sum(1 for e in events[:-1] if json.loads(e)["choices"])
        assert 1 <= n_streamed < 1000  # cut short by the abort, not finished
        assert plain["status"] == 200, plain
        full = json.loads(plain["body"])
        assert full["choices"][0]["finish_reason"] == "abort" and full["usage"]["completion_tokens"] < 1000
        assert srv.wait(120) == 0
        err = srv.stderr
        assert "Traceback" not in err and "CancelledError" not in err and "Cancel " not in err, err[-3000:]
        assert "server stopped" in err
    finally:
        srv.kill()


def _readme_block(marker: str) -> str:
    """The README's fenced python block that contains `marker`."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"{len(found)} README python blocks contain {marker!r}"
    return found[0]


@pytest.mark.slow
def test_readme_chat_example_against_serve_checkpoint_demo_lazy(tmp_path):
    """`ling-jax serve --checkpoint demo --warmup lazy`: it answers at once, /health says "starting"
    with the warm-up's progress while programs compile, the README's streamed `openai` chat example
    runs as written (only the port differs) and prints the demo model's text; a request without
    `model` is served (the documented choice) with its own `created`; progress lines name each
    program; then "ok"."""
    srv = Served(["--checkpoint", "demo", "--warmup", "lazy", "--max-slots", "2", "--max-seq-len", "256",
                  "--prefill-chunk", "32", "--cache-memory", "0.05"])
    try:
        assert "warm-up (lazy): " in srv.stderr and "'demo_model'" in srv.stderr
        h = httpx.get(srv.url + "/health", timeout=30).json()
        assert h["status"] == "starting" and h["warmup"]["done"] < h["warmup"]["total"], h
        code = _readme_block("client.chat.completions.create(").replace("http://127.0.0.1:8000", srv.url)
        script = tmp_path / "readme_chat.py"
        script.write_text(code)
        p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600, env=_env())
        assert p.returncode == 0, p.stderr[-3000:]
        assert p.stdout.strip(), "the chat example printed nothing"
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "def parse", "max_tokens": 4}, timeout=300)
        assert r.status_code == 200 and r.json()["model"] == "demo_model"
        # `created` is each response's own time (it was the server's start time in every response)
        started = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"][0]["created"]
        assert started < r.json()["created"] <= time.time()
        deadline = time.monotonic() + 600
        while httpx.get(srv.url + "/health", timeout=30).json()["status"] != "ok":
            assert time.monotonic() < deadline, "the lazy warm-up did not finish:\n" + srv.stderr[-3000:]
            time.sleep(1)
        lines = [l for l in srv.lines if l.startswith("warm-up (lazy) ")]
        n = h["warmup"]["total"]
        assert len(lines) == n and lines[-1].startswith(f"warm-up (lazy) {n}/{n}: ") and "(0 left)" in lines[-1]
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.wait(120) == 0
    finally:
        srv.kill()
