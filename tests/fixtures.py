"""Helpers shared by the checkpoint tests (plain functions; pytest fixtures live in conftest.py)."""
import numpy as np

from ling_jax.checkpoint import layout as L
from ling_jax.checkpoint.writer import generate_chunks


def generate_tensor(cfg, name: str, seed: int = 0) -> np.ndarray:
    """The full float32 values `write_checkpoint(cfg, ..., seed=seed)` generates for `name`
    (before storage rounding): the writer's chunks joined, so tests can compare what was stored."""
    spec = L.expected_tensors(cfg).get(name)
    if spec is None:
        raise KeyError(f"{name!r} is not a tensor of this config")
    return np.concatenate(list(generate_chunks(name, spec, seed)), axis=0) if spec.shape else \
        next(generate_chunks(name, spec, seed))
