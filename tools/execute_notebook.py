#!/usr/bin/env python3
"""Execute notebooks/explore_ling.ipynb in place and save it with its outputs (plots included).

    python tools/execute_notebook.py [NOTEBOOK] [--timeout SECONDS_PER_CELL]

The notebook is committed executed, so its plots show (on GitHub, in an editor) without running
it; rerun this after a change that alters its outputs and commit the result (under a minute of CPU here).
`tests/test_notebook.py` still executes it afresh in CI and checks the stored copy is executed.

It runs as the test does: a fresh kernel with the notebook's folder as working directory, on the
CPU with one device (the 8 simulated devices of the test suite's XLA_FLAGS are dropped), this
checkout first on the kernel's PYTHONPATH, and the demo checkpoint cache in a temporary directory
(the shipped trained model is used when present). No timing metadata is recorded, so a rerun
changes only what the computation itself prints (timings included).
Consecutive stream outputs of a cell are joined into one.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

import nbclient
import nbformat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(ROOT, "notebooks", "explore_ling.ipynb")


def kernel_env(cache_dir: str) -> dict:
    """The environment the notebook's kernel starts with: this process's, adjusted."""
    env = dict(os.environ)
    env["LING_JAX_CACHE"] = cache_dir
    env.pop("LING_JAX_CHECKPOINT", None)
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "").replace("--xla_force_host_platform_device_count=8", "").strip()
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def coalesce_streams(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """Join consecutive stdout (stderr) outputs of a cell into one: streamed generation prints one
    output per token, which would store as hundreds of tiny entries."""
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        merged = []
        for o in cell.outputs:
            if (o.output_type == "stream" and merged and merged[-1].output_type == "stream"
                    and merged[-1].name == o.name):
                merged[-1].text += o.text
            else:
                merged.append(o)
        cell.outputs = merged
    return nb


def execute(path: str, timeout: int = 300) -> nbformat.NotebookNode:
    """The notebook at `path`, executed top to bottom; raises CellExecutionError on a failing cell."""
    nb = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="ling-jax-nb-") as cache:
        client = nbclient.NotebookClient(nb, timeout=timeout, startup_timeout=120, kernel_name="python3",
                                         record_timing=False, resources={"metadata": {"path": os.path.dirname(path)}})
        client.execute(env=kernel_env(os.path.join(cache, "cache")))  # env: the kernel process's environment
    return nb


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("notebook", nargs="?", default=DEFAULT)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per cell (default 300)")
    a = ap.parse_args(argv)
    path = os.path.abspath(a.notebook)
    nb = coalesce_streams(execute(path, a.timeout))
    nbformat.validate(nb)
    tmp = path + ".tmp"
    nbformat.write(nb, tmp)
    os.replace(tmp, path)
    print(f"wrote {path} ({os.path.getsize(path) / 1e6:.2f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
