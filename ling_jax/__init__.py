"""ling-jax: Ling-3.1-flash (BailingMoeV3 / bailing_hybrid) in JAX and Flax NNX."""
from ling_jax.config import LingConfig, ConfigError  # noqa: F401

__version__ = "0.1.0"
