"""JAX's persistent compilation cache in `ling-jax`: where it lives (flags > env > XDG > home), and a
second process that loads every program the first one compiled (counted from jax.monitoring
events by `ling-jax batch`'s summary, and the cache files), giving the same tokens.

The tests never write the user's cache: conftest sets LING_JAX_COMPILATION_CACHE=off for every
process, and the subprocesses here get their own tmp_path folder (and XDG_CACHE_HOME/HOME)."""
import json
import os
import re
import subprocess
import sys

import pytest

from ling_jax.cli import build_parser
from ling_jax.commands.compilation_cache import ENV, default_cache_dir, resolve_cache_dir
from test_sharding import write_small

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cache_dir_precedence(tmp_path):
    home = os.path.expanduser("~")
    assert default_cache_dir({}) == os.path.join(home, ".cache", "ling-jax", "jax-cache")
    assert default_cache_dir({"XDG_CACHE_HOME": "/x"}) == "/x/ling-jax/jax-cache"
    assert resolve_cache_dir(None, False, {"XDG_CACHE_HOME": "/x"}) == "/x/ling-jax/jax-cache"
    assert resolve_cache_dir(None, False, {ENV: "/env/dir", "XDG_CACHE_HOME": "/x"}) == "/env/dir"
    for off in ("", "0", "OFF", "none", "False"):
        assert resolve_cache_dir(None, False, {ENV: off}) is None
    assert resolve_cache_dir("/flag", False, {ENV: "/env/dir"}) == "/flag"
    assert resolve_cache_dir(None, True, {ENV: "/env/dir"}) is None
    with pytest.raises(ValueError, match="--compilation-cache: empty"):
        resolve_cache_dir(" ", False, {})


def test_every_command_has_the_flags(capsys):
    p = build_parser()
    for cmd in ("demo", "generate", "batch", "logits"):
        sub = p._subparsers._group_actions[0].choices[cmd]
        flags = {s for a in sub._actions for s in a.option_strings}
        assert {"--compilation-cache", "--no-compilation-cache"} <= flags, cmd
    with pytest.raises(SystemExit):  # one or the other
        p.parse_args(["plan", "--compilation-cache", "d", "--no-compilation-cache"])
    assert "not allowed with argument --compilation-cache" in capsys.readouterr().err


SUMMARY = re.compile(r"start-up compiles: (\d+) \(\+(\d+) from the persistent compilation cache\); "
                     r"compiles while serving: (\d+)")


def _batch(ckpt, reqs, out, env_cache, extra=(), home=None):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS="", HOME=str(home),
               XDG_CACHE_HOME=str(home / "xdg"))
    env[ENV] = env_cache
    p = subprocess.run([sys.executable, "-m", "ling_jax.cli", "batch", "--checkpoint", str(ckpt), "--requests",
                        str(reqs), "--out", str(out), "--max-slots", "2", "--page-size", "8", "--prefill-chunk", "8",
                        "--max-seq-len", "32", "--dtype", "float32", *extra],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    m = SUMMARY.search(p.stderr)
    assert m, p.stderr[-2000:]
    return [int(g) for g in m.groups()], [json.loads(l) for l in out.read_text().splitlines()]


def test_second_process_loads_every_program_from_the_cache(tmp_path):
    ckpt = tmp_path / "ckpt"
    write_small(ckpt, seed=3)
    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text("\n".join(json.dumps(r) for r in (
        {"input_ids": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15], "max_tokens": 4},
        {"input_ids": [3], "max_tokens": 6, "temperature": 0.9, "seed": 4})) + "\n")
    cache, home = tmp_path / "jax-cache", tmp_path / "home"
    # first run: the cache folder from the flag (the environment says off)
    (built1, hits1, serving1), out1 = _batch(ckpt, reqs, tmp_path / "o1.jsonl", "off",
                                             ["--compilation-cache", str(cache)], home=home)
    files = sorted(os.listdir(cache))
    assert built1 > 0 and hits1 == 0 and serving1 == 0
    assert len(files) == built1  # every program was written (no compile-time or size threshold)
    # second run: the same folder from the environment; nothing is compiled again
    (built2, hits2, serving2), out2 = _batch(ckpt, reqs, tmp_path / "o2.jsonl", str(cache), home=home)
    assert (built2, hits2, serving2) == (0, built1, 0)
    assert sorted(os.listdir(cache)) == files
    assert out2 == out1 and all(len(r["token_ids"]) > 0 for r in out1)
    assert not (home / "xdg").exists() and not (home / ".cache").exists()  # the default folder was never made
