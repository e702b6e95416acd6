import contextlib
import os
import sys
import tempfile

# Tests run on CPU; 8 host devices let the sharding tests build meshes in-process. The suite's time
# is XLA:CPU compile time (~80% of an engine test): LLVM at -O0 and the classic (non-MLIR) fusion
# emitters cut it 2.5x (measured, the backend compiles of a K=2 speculative engine's warm-up: 46.8 s
# default, 31.5 s at -O0, 18.6 s with both; its 20 decode steps 0.30 -> 0.66 s; an engine test
# 154 -> 105 s with -O0 alone; a 16K-token forward 62 -> 55 s).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
                                   "--xla_cpu_use_fusion_emitters=false")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache for the whole run, never the user's: a program compiled by one
# test (or xdist worker, or `ling-jax` subprocess, which inherit this) is loaded by the next test
# that builds the same program. The controller makes the folder and removes it at the end; the
# workers inherit the variable. Tests of the cache itself point it at their own tmp_path.
_RUN_CACHE_VAR = "LING_JAX_TEST_RUN_CACHE"
_OWN_RUN_CACHE = _RUN_CACHE_VAR not in os.environ
if _OWN_RUN_CACHE:
    os.environ[_RUN_CACHE_VAR] = tempfile.mkdtemp(prefix="ling-jax-test-jax-cache-")
os.environ["LING_JAX_COMPILATION_CACHE"] = os.environ[_RUN_CACHE_VAR]
# libtpu (the compile-only TPU compiler of tests/test_aot.py and test_pallas_compile.py) takes a lockfile
# for one process per host: both xdist workers may load it; and quiet its warnings about the TPU_*
# variables of a real TPU host
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
for _k, _v in {"TPU_STDERR_LOG_LEVEL": "3", "TPU_MIN_LOG_LEVEL": "3", "TPU_WORKER_HOSTNAMES": "localhost",
               "TPU_WORKER_ID": "0", "TPU_SKIP_MDS_QUERY": "1"}.items():
    os.environ.setdefault(_k, _v)
# the native CPU experts kernel is built once for the whole run (workers and subprocesses), not in ~/.cache
os.environ.setdefault("LING_JAX_KERNEL_CACHE", os.path.join(tempfile.gettempdir(), "ling-jax-test-kernels"))
sys.path.insert(0, os.path.dirname(__file__))

import numpy as np  # noqa: E402
import pytest  # noqa: E402

# The events of one program built for a call: compiled, or loaded from the run's persistent cache.
COMPILE_EVENTS = ("backend_compile_duration", "cache_retrieval_time_sec")


def is_compile_event(name: str) -> bool:
    return name.endswith(COMPILE_EVENTS)


def pytest_configure(config):
    """Every test process (controller, each worker) reads and writes the run's compilation cache."""
    from ling_jax.commands.compilation_cache import enable_compilation_cache
    enable_compilation_cache(os.environ[_RUN_CACHE_VAR])


def pytest_unconfigure(config):
    if _OWN_RUN_CACHE and not hasattr(config, "workerinput"):
        import shutil
        shutil.rmtree(os.environ[_RUN_CACHE_VAR], ignore_errors=True)


class DictReader:
    """Reader over an in-memory {checkpoint name: array} dict (same `get` as CheckpointReader)."""

    def __init__(self, params):
        self.params = params

    def get(self, name, dtype=np.float32, index=None):
        a = np.asarray(self.params[name], dtype=dtype)
        return a if index is None else a[index]


def load_from_dict(cfg, params, dtype="float32", with_mtp=True):
    import jax.numpy as jnp

    from ling_jax.loader import load_from_reader
    return load_from_reader(DictReader(params), cfg, dtype=jnp.dtype(dtype), with_mtp=with_mtp, progress=False)


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="session")
def tiny_cfg():
    import np_reference as R
    return R.tiny_config()


@pytest.fixture(scope="session")
def tiny_params(tiny_cfg):
    import np_reference as R
    return R.random_params(tiny_cfg, seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_cfg, tiny_params):
    return load_from_dict(tiny_cfg, tiny_params)


def mla_layer_pages(pools, cfg):
    """(layer index, c_pages, kpe_pages) of every main MLA layer of the engine's stacked pools (the
    paged twin of `model.layer_cache`)."""
    from ling_jax.config import KDA
    from ling_jax.layer_stack import layer_plan
    for b_i, block in enumerate(layer_plan(cfg)):
        for r, run in enumerate(block.runs):
            if run.attn == KDA:
                continue
            pc = pools.layers[b_i][r]
            for g, row in enumerate(block.layer_grid(r)):
                for i, layer in enumerate(row):
                    yield layer, pc.c_pages[g, i], pc.kpe_pages[g, i]


@contextlib.contextmanager
def xla_compiles():
    """Collects the names of the programs built inside the block, compiled or loaded from the run's
    persistent cache (a jax.monitoring listener): the compile-bound tests assert it stays empty."""
    import jax  # as elsewhere in this file: jax is imported only after the XLA flags above are set

    events = []
    listener = lambda name, *a, **k: events.append(name) if is_compile_event(name) else None
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
