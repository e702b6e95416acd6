"""Serving: a continuous-batching engine over paged MLA latents and KDA state slots (README.md).

`Engine` and `RequestHandle` (the device side: jax) are imported when first named, so the host-only
modules of this package (`allocator`, `scheduler`, `prefix_cache`, `request`) import no jax.
"""
from ling_jax.sampling_params import TokenLogprob  # noqa: F401  (the entries of `RequestHandle.logprobs`)
from ling_jax.serve.request import RequestFieldError, RequestParams  # noqa: F401

__all__ = ["Engine", "RequestFieldError", "RequestHandle", "RequestParams", "TokenLogprob"]


def __getattr__(name):
    if name in ("Engine", "RequestHandle"):
        from ling_jax.serve import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'ling_jax.serve' has no attribute {name!r}")
