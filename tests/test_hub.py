"""`--checkpoint ORG/NAME[@REVISION]` and `load_model("ORG/NAME")` through huggingface_hub
(`ling_jax/checkpoint/locate.py`), against a stand-in of the Hub on 127.0.0.1 (HF_ENDPOINT) that
serves a checkpoint written by `ling-jax make-checkpoint`: the model-info API
(/api/models/{repo}/revision/{rev}), the file listing huggingface_hub 2.x asks for
(/api/models/{repo}/tree/{rev}) and file downloads (/{repo}/resolve/{rev}/{file}). Never the
real network. Also `--checkpoint demo` and the order of the resolution (a local directory of the
same spelling wins)."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

import pytest

from ling_jax.checkpoint.locate import SHIPPED, model_name, parse_hub_id, resolve_checkpoint
from ling_jax.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO, SHA = "ling-test/tiny", "0123456789abcdef0123456789abcdef01234567"


class StandInHub:
    """A thread serving `files` ({name: bytes}) as the Hub repository REPO at revisions main, v1
    and SHA; every request path is recorded in `.seen`."""

    def __init__(self, files: dict):
        self.files, self.seen = files, []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, body=b"", headers=()):
                self.send_response(code)
                for k, v in headers:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_HEAD(self):
                self.do_GET()

            def do_GET(self):
                path = unquote(self.path.split("?")[0])
                hub.seen.append(path)
                info = f"/api/models/{REPO}/revision/"
                if path.startswith(info):
                    if path[len(info):] not in ("main", "v1", SHA):
                        return self._send(404, b'{"error": "Revision Not Found"}',
                                          [("X-Error-Code", "RevisionNotFound"), ("Content-Type", "application/json")])
                    body = json.dumps({"id": REPO, "modelId": REPO, "sha": SHA, "private": False,
                                       "siblings": [{"rfilename": f} for f in sorted(hub.files)]}).encode()
                    return self._send(200, body, [("Content-Type", "application/json")])
                tree = f"/api/models/{REPO}/tree/"
                if path.startswith(tree) and path[len(tree):] in ("main", "v1", SHA):
                    body = json.dumps([{"type": "file", "path": f, "size": len(d), "oid": hashlib.sha1(d).hexdigest()}
                                       for f, d in sorted(hub.files.items())]).encode()
                    return self._send(200, body, [("Content-Type", "application/json")])
                for rev in ("main", "v1", SHA):
                    prefix = f"/{REPO}/resolve/{rev}/"
                    if path.startswith(prefix) and path[len(prefix):] in hub.files:
                        data = hub.files[path[len(prefix):]]
                        etag = '"' + hashlib.sha1(data).hexdigest() + '"'
                        return self._send(200, data, [("X-Repo-Commit", SHA), ("ETag", etag),
                                                      ("Content-Type", "application/octet-stream")])
                self._send(404, b'{"error": "Repository Not Found"}',
                           [("X-Error-Code", "RepositoryNotFound"), ("Content-Type", "application/json")])

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    d = tmp_path_factory.mktemp("hub") / "src"
    assert main(["make-checkpoint", "--config", os.path.join(SHIPPED, "config.json"), "--out", str(d),
                 "--layers", "2", "--experts", "4", "--shards", "2", "--seed", "1"]) == 0
    return d


def _run(args, hf_home, endpoint, cwd=ROOT, offline=False, code=None):
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu", "HF_HOME": str(hf_home),
           "HF_ENDPOINT": endpoint, "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1",
           "HF_HUB_ETAG_TIMEOUT": "5", "HF_HUB_DOWNLOAD_TIMEOUT": "10"}
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("HF_TOKEN", None)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    cmd = [sys.executable, "-c", code, *args] if code else [sys.executable, "-m", "ling_jax.cli", *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


LOAD = """
import sys, numpy as np, jax
from flax import nnx
from ling_jax.loader import load_model
from ling_jax.tokenizer import Tokenizer
a, b = load_model(sys.argv[1], "float32", progress=False), load_model(sys.argv[2], "float32", progress=False)
la, lb = jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))
assert len(la) == len(lb) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(la, lb))
ta, tb = Tokenizer.from_dir(sys.argv[1]), Tokenizer.from_dir(sys.argv[2])
assert ta.encode("def parse(x):") == tb.encode("def parse(x):")
print("same", len(la))
"""


def test_hub_ids_resolve_through_a_stand_in_hub(src, tmp_path):
    files = {f: (src / f).read_bytes() for f in os.listdir(src) if (src / f).is_file()}
    files["README.md"] = b"# not needed\n"
    hub = StandInHub(files)
    hf_home = tmp_path / "hf"
    try:
        local = _run(["inspect", str(src), "--json"], hf_home, hub.url)
        assert local.returncode == 0, local.stderr[-2000:]
        # 1. online: an id and an id@revision, through the CLI; the shards the index names are fetched
        r = _run(["inspect", REPO, "--json"], hf_home, hub.url)
        assert r.returncode == 0, r.stderr[-3000:]
        assert json.loads(r.stdout)["params"] == json.loads(local.stdout)["params"]
        assert any(p.startswith(f"/api/models/{REPO}/revision/main") for p in hub.seen), hub.seen
        got = {p.rsplit("/", 1)[-1] for p in hub.seen if "/resolve/" in p}
        shards = {f for f in files if f.endswith(".safetensors")}
        assert len(shards) == 2 and shards <= got and "README.md" not in got, got
        snap = hf_home / "hub" / "models--ling-test--tiny" / "snapshots" / SHA
        assert {"config.json", "tokenizer.json", "model.safetensors.index.json"} <= set(os.listdir(snap))
        r = _run(["inspect", f"{REPO}@v1", "--json"], hf_home, hub.url)
        assert r.returncode == 0 and json.loads(r.stdout)["params"] == json.loads(local.stdout)["params"]
        # 2. load_model and Tokenizer.from_dir take the id too: the same parameters as the local directory
        r = _run([REPO, str(src)], hf_home, hub.url, code=LOAD)
        assert r.returncode == 0 and "same" in r.stdout, r.stderr[-3000:]
        # 3. offline: from the cache alone, without a request; an id the cache lacks is one clear line
        before = len(hub.seen)
        r = _run(["inspect", REPO, "--json"], hf_home, hub.url, offline=True)
        assert r.returncode == 0, r.stderr[-3000:]
        assert len(hub.seen) == before
        r = _run(["inspect", "ling-test/absent"], hf_home, hub.url, offline=True)
        err = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and err.startswith("error: DIR: ling-test/absent is not a local directory") \
            and "HF_HUB_OFFLINE=1" in err and str(hf_home) in err, err
        # 4. online, an id the Hub does not have: one line naming it and the endpoint
        r = _run(["generate", "--checkpoint", "ling-test/absent@main", "--input-ids", "1", "--max-new-tokens", "1"],
                 hf_home, hub.url)
        err = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 2 and "--checkpoint: ling-test/absent@main is not a local directory" in err \
            and hub.url in err, err
    finally:
        hub.close()
    # 5. a local directory spelled like an id wins (the Hub is gone: nothing is fetched)
    shutil.copytree(src, tmp_path / "cwd" / "ling-test" / "tiny")
    r = _run(["inspect", REPO, "--json"], tmp_path / "hf-empty", hub.url, cwd=tmp_path / "cwd")
    assert r.returncode == 0 and json.loads(r.stdout)["params"] == json.loads(local.stdout)["params"], r.stderr


def test_checkpoint_demo_and_the_order_of_resolution(tmp_path, monkeypatch, capsys):
    assert resolve_checkpoint("demo") == SHIPPED and model_name("demo") == "demo_model"
    assert parse_hub_id("inclusionAI/Ling-3.1-flash") == ("inclusionAI/Ling-3.1-flash", None)
    assert parse_hub_id("org/name@v1.0") == ("org/name", "v1.0")
    for not_id in ("demo", "./a/b", "/abs/path", "a/b/c", "../x/y", "~/x", "a/", "/b"):
        assert parse_hub_id(not_id) is None, not_id
    assert model_name("org/name@rev") == "org/name"
    assert resolve_checkpoint("no-such-dir") == "no-such-dir"  # the command's own check reports it
    # every command: `--checkpoint demo` (and `inspect demo`) is the shipped model
    assert main(["inspect", "demo", "--json"]) == 0
    shipped = json.loads(capsys.readouterr().out)
    assert main(["inspect", SHIPPED, "--json"]) == 0 and json.loads(capsys.readouterr().out) == shipped
    assert main(["generate", "--checkpoint", "demo", "--prompt", "def parse", "--max-new-tokens", "3",
                 "--greedy", "--json"]) == 0
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 3
    # ... unless a local directory of that name exists
    (tmp_path / "demo").mkdir()
    monkeypatch.chdir(tmp_path)
    assert resolve_checkpoint("demo") == "demo"
    assert main(["inspect", "demo"]) == 2
    assert "demo" in capsys.readouterr().err
