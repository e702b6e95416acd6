"""A request's settings (`RequestParams`) and the refusal that names one of them (host-only: no jax).

The scheduler types its requests' parameters with `RequestParams`, so it lives here, apart from
the engine's device side; `ling_jax.serve` exports it.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from ling_jax.checks import FieldError, check_int
from ling_jax.sampling_params import INT32_MAX, SamplingParams, check_logprobs, check_penalties


class RequestFieldError(FieldError):
    """A request the engine refuses, with `field`: the RequestParams field it is about (a server maps
    it to its own request field). Every refusal of `RequestParams` itself is a FieldError too."""


@dataclasses.dataclass(frozen=True)
class RequestParams:
    """Per-request settings. temperature 0 = greedy; top_k 0 = off; top_p 1 = off; seed: the
    request's own random stream (token n draws with fold_in(key(seed), n)); stop_ids: None = the
    config's EOS ids, () = none; max_tokens: new tokens at most (the stop token counts).
    presence_penalty / frequency_penalty in [-2, 2] (OpenAI semantics, over the generated tokens),
    repetition_penalty > 0 (HF semantics, over prompt + generated tokens; 1 = off): see
    `ling_jax.sampling`. logprobs: None = off, 0 = each token's logprob, N <= 20 = plus the top N,
    under the model's raw distribution (before penalties / temperature / top-k / top-p); the
    handle's `logprobs` list is aligned with `generated`."""
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_ids: Optional[tuple] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: Optional[int] = None

    def __post_init__(self):
        SamplingParams(self.temperature, self.top_k, self.top_p, self.seed)  # same checks, same messages
        check_penalties(self.presence_penalty, self.frequency_penalty, self.repetition_penalty, "RequestParams.")
        check_logprobs(self.logprobs, "RequestParams.")
        if self.logprobs is not None:
            object.__setattr__(self, "logprobs", int(self.logprobs))
        check_int(self.max_tokens, "RequestParams.max_tokens", field="max_tokens", low=1, high=INT32_MAX,
                  expected="an int >= 1 and <= 2**31-1")
        if self.stop_ids is not None:
            ids = tuple(self.stop_ids)
            for s in ids:
                check_int(s, "RequestParams.stop_ids: each", field="stop_ids", low=0, high=INT32_MAX,
                          expected="an int in [0, 2**31-1]")
            object.__setattr__(self, "stop_ids", tuple(int(s) for s in ids))

    @property
    def penalized(self) -> bool:
        """Whether any sampling penalty is on (the request's sampling then reads its slot's token statistics)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)
