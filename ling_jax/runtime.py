"""What is left of the old runtime module: `check_ids` (moving to ling_jax/commands/common.py).

Loading is `ling_jax.loader.load_model`, the cache-free forward `ling_jax.forward.forward`,
`default_dtype` lives in `ling_jax.ops`, and `load_for_args` in `ling_jax.commands.common`.
"""
from __future__ import annotations

from ling_jax.config import LingConfig


def check_ids(ids, cfg: LingConfig, what: str = "--input-ids") -> None:
    if len(ids) == 0:
        raise ValueError(f"{what}: empty prompt (need at least one token id)")
    bad = [i for i in ids if not 0 <= int(i) < cfg.vocab_size]
    if bad:
        raise ValueError(f"{what}: token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
