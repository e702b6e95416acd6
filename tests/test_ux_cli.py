"""The command line as a newcomer meets it (issue 23): a second streaming `ling-jax demo` process
compiles nothing (the decode program has no host callback, so the persistent compilation cache
keeps it) and prints the `--json` run's text; the demo's own errors; `plan`'s default reserve;
a taken port named with its flags."""
import json
import os
import re
import socket
import subprocess
import sys

import pytest

from ling_jax.cli import main
from ling_jax.commands.compilation_cache import ENV

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REAL = "/work/shared/spec/config.ling-3.1-flash.json"  # as tests/test_accounting.py

COUNTED = """
import sys
from ling_jax.cli import main
from ling_jax.commands.batch import _CompileCounter
with _CompileCounter() as c:
    rc = main(sys.argv[1:])
print(f"COMPILES built={c.built} loaded={c.cache_hits}", file=sys.stderr)
sys.exit(rc)
"""


def _demo(cache, home, *args):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu", XLA_FLAGS="", HOME=str(home),
               XDG_CACHE_HOME=str(home / "xdg"), JAX_EXPLAIN_CACHE_MISSES="1")
    env[ENV] = str(cache)
    p = subprocess.run([sys.executable, "-c", COUNTED, "demo", "--max-new-tokens", "20", *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    m = re.search(r"COMPILES built=(\d+) loaded=(\d+)", p.stderr)
    return int(m.group(1)), int(m.group(2)), p.stdout, p.stderr


@pytest.mark.slow
def test_second_streaming_demo_compiles_nothing(tmp_path):
    cache, home = tmp_path / "jax-cache", tmp_path / "home"
    built1, loaded1, out1, err1 = _demo(cache, home)
    assert built1 > 0 and "Not writing persistent cache entry" not in err1, err1[-3000:]
    assert "host callback" not in err1
    files = sorted(os.listdir(cache))
    built2, loaded2, out2, err2 = _demo(cache, home)
    assert (built2, loaded2) == (0, built1 + loaded1), err2[-3000:]
    assert sorted(os.listdir(cache)) == files
    # the streamed text is the --json run's (the same tokens), after the prompt
    _, _, js, _ = _demo(cache, home, "--json")
    assert out1 == out2 == "def parse" + json.loads(js)["text"] + "\n"
    assert not out1.startswith("def (")


def test_demo_errors_are_its_own(capsys):
    assert main(["demo", "--max-new-tokens", "0"]) == 2
    err = capsys.readouterr().err
    assert "usage: ling-jax demo" in err and "ling-jax generate" not in err
    assert err.strip().splitlines()[-1] == ("error: ling-jax demo: argument --max-new-tokens: expected a positive "
                                            "integer, got '0'")
    assert main(["demo", "--max-new-tokens", "5000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "demo model's context of 4096 positions" in err and "--allow-long-context" not in err, err


def test_plan_reserves_6_gib_by_default(capsys):
    """The seed's verdict for 4xH100 (~1 GiB free, ~96K tokens even split) holds back 6 GiB; `plan`
    now does so unless told (`--reserve 0` gives the old figure)."""
    base = ["plan", "--config", REAL, "--weights", "mxfp4", "--mesh", "model=4", "--device-memory", "80", "--json"]
    assert main(base) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["reserve_bytes"] == 6 * 2 ** 30 and 65_000 < r["tokens_fit"] < 75_000
    assert main(base + ["--reserve", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens_fit"] > 600_000


def test_a_taken_port_is_named_with_its_flags(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        assert main(["serve", "--checkpoint", "demo", "--port", str(port)]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"error: --host/--port: cannot listen on 127.0.0.1:{port}: ") and "--port 0" in err, err
