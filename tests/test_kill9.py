"""kill -9 at several moments of `convert`, `export` and `logits --out` (issue 15 item 7).

After each kill: nothing under the final name unless it is complete (loads / validates), and every
temporary is hidden (`.ling-tmp-*`, or convert's `.NAME.converting`). The next run (in-process)
succeeds and leaves no stale temporary behind.
"""
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from ling_jax.checkpoint.orbax_validate import validate_converted
from ling_jax.checkpoint.reader import CheckpointReader
from ling_jax.checkpoint.writer import tiny_config, write_checkpoint
from ling_jax.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MOMENTS = ("temp", 1.0, 3.0)  # as soon as a temporary appears; fixed delays after the start


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    d = tmp_path_factory.mktemp("kill9") / "ck"
    write_checkpoint(tiny_config(num_hidden_layers=2, layer_group_size=2), str(d), num_shards=2, progress=False,
                     tokenizer=False)
    return d


def _temps(parent, final):
    base = os.path.basename(final)
    return [n for n in os.listdir(parent) if n.startswith(".ling-tmp-") or n == f".{base}.converting"]


def _kill_at(argv, parent, final, moment):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen([sys.executable, "-m", "ling_jax.cli", *argv], cwd=ROOT, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t0 = time.monotonic()
    while p.poll() is None and time.monotonic() - t0 < 60:
        if moment == "temp" and _temps(parent, final):
            break
        if moment != "temp" and time.monotonic() - t0 >= moment:
            break
        time.sleep(0.005)
    if p.poll() is None:
        os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=30)


def _complete_npz(path):
    with np.load(path) as z:
        assert np.isfinite(z["logits"]).all()


def _complete_export(path):
    CheckpointReader(path).validate()


def _complete_convert(path):
    validate_converted(path)


COMMANDS = {
    "logits": (lambda ck, out: ["logits", "--checkpoint", str(ck), "--input-ids", "1,2,3", "--out", out],
               "x.npz", _complete_npz),
    "export": (lambda ck, out: ["export", "--params", str(ck), "--out", out, "--dtype", "bf16", "--json"],
               "exp", _complete_export),
    "convert": (lambda ck, out: ["convert", "--checkpoint", str(ck), "--out", out, "--quiet"],
                "conv", _complete_convert),
}


@pytest.mark.parametrize("cmd", sorted(COMMANDS))
def test_kill9_leaves_no_partial_output(cmd, ck, tmp_path, capsys):
    argv_of, name, complete = COMMANDS[cmd]
    for i, moment in enumerate(MOMENTS):
        parent = tmp_path / f"run{i}"
        parent.mkdir()
        final = str(parent / name)
        _kill_at(argv_of(ck, final), str(parent), final, moment)
        if os.path.exists(final):  # finished before the kill: must then be complete
            complete(final)
        elif moment == "temp":  # killed while writing: the temporary is there, hidden, named as ours
            assert _temps(str(parent), final), os.listdir(parent)
        assert all(n.startswith(".") for n in os.listdir(parent) if n != name)
        # the next run cleans up after the killed one and writes a complete output
        extra = ["--force"] if cmd == "convert" else (["--overwrite"] if cmd == "export" else [])
        assert main(argv_of(ck, final) + extra) == 0, capsys.readouterr().err
        capsys.readouterr()
        complete(final)
        assert _temps(str(parent), final) == [], os.listdir(parent)
