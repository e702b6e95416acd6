"""Serving: a continuous-batching engine over paged MLA latents and KDA state slots (README.md)."""
from ling_jax.sampling import TokenLogprob  # noqa: F401  (the entries of `RequestHandle.logprobs`)
from ling_jax.serve.engine import Engine, RequestHandle, RequestParams  # noqa: F401

__all__ = ["Engine", "RequestHandle", "RequestParams", "TokenLogprob"]
