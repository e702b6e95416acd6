"""Multi-host: 2 processes x 4 CPU devices on localhost (coordinator on a loopback port) load a
written checkpoint into an (expert=4, model=2) mesh spanning both processes — each reading only its
own devices' blocks — and compute logits equal to the single-process result. The same run converts
the checkpoint cooperatively and loads the converted copy."""
import os
import re
import socket
import subprocess
import sys

import numpy as np
import pytest

from conftest import rel_err
from ling_jax.forward import forward
from ling_jax.loader import load_model
from test_sharding import IDS, write_small

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# the Gloo transport's connection message, printed by each process to its stdout from several threads:
# its pieces (words, numbers) may arrive interleaved and split across lines
GLOO_PIECES = re.compile(r"\[Gloo\]|\b(?:Rank|is|connected|to|peer|ranks|Expected|number|of|\d+)\b|[.:]")


def not_gloo(stdout: str) -> str:
    """stdout without the Gloo transport's connection messages, however they were split: what is left
    (other than whitespace) was printed by something else."""
    return GLOO_PIECES.sub("", stdout).strip()


def run_two_processes(args, timeout=300, meanwhile=None, command=None):
    """`command + args` (default: tools/multihost_demo.py) as processes 0 and 1 of a 2 x 4-CPU-device
    run on a loopback coordinator; returns (procs, [(stdout, stderr)], meanwhile()'s result)."""
    command = command or [os.path.join(ROOT, "tools", "multihost_demo.py")]
    port = free_port()
    procs = []
    for pid in range(2):
        env = dict(os.environ, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES="2",
                   JAX_PROCESS_ID=str(pid), XLA_FLAGS="--xla_force_host_platform_device_count=4",
                   JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
        procs.append(subprocess.Popen([sys.executable, *command, *args],
                                      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        extra = meanwhile() if meanwhile is not None else None
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return procs, outs, extra


def test_two_processes_match_single_process(tmp_path):
    ckpt = tmp_path / "ckpt"
    write_small(ckpt, seed=21)
    out = tmp_path / "logits.npz"
    ids = ";".join(",".join(map(str, row)) for row in IDS)
    def reference():  # computed while the two processes run
        return np.asarray(forward(load_model(str(ckpt), "float32", with_mtp=False, progress=False), IDS)["logits"])

    procs, outs, ref = run_two_processes(["--checkpoint", str(ckpt), "--mesh", "expert=4,model=2", "--ids", ids,
                                          "--out", str(out), "--convert", str(tmp_path / "converted")],
                                         meanwhile=reference)
    for p, (o, e) in zip(procs, outs):
        assert p.returncode == 0, e[-4000:]
    assert "processes=2" in outs[0][0] and "devices=8 local=4" in outs[0][0]
    # only process 0 prints: process 1's stdout holds none of our report (the Gloo transport's own
    # connection messages also go there, interleaved and sometimes split across lines, so they are
    # not asserted on)
    assert "processes=" not in outs[1][0] and "devices=" not in outs[1][0], outs[1][0][-2000:]
    assert (tmp_path / "converted" / "ling_jax_orbax.json").is_file()
    got = np.load(out)
    assert rel_err(got["logits"], ref) < 1e-5


def test_distributed_init_args_and_env(monkeypatch):
    import sharding as S

    for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(k, raising=False)
    assert S.distributed_init_from_args_or_env() is False  # nothing given: single process
    assert S.distributed_init_from_args_or_env(num_processes=1) is False
    with pytest.raises(ValueError, match="missing process id"):
        S.distributed_init_from_args_or_env("127.0.0.1:1", 2)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "5")
    with pytest.raises(ValueError, match=r"not in \[0, 2\)"):
        S.distributed_init_from_args_or_env("127.0.0.1:1")
    monkeypatch.setenv("JAX_PROCESS_ID", "x")
    with pytest.raises(ValueError, match="integer"):
        S.distributed_init_from_args_or_env()
