"""Sampling settings and their checks, on the host (standard library only: no jax).

`SamplingParams` (what `generate` and `ling_jax.sampling` take), the penalty and logprob checks
(also `serve.request.RequestParams`'), `TokenLogprob` (one generated token's logprob) and the
bounds every field is checked against. The sampling functions themselves are `ling_jax.sampling`.
Every refusal is a `checks.FieldError` (a ValueError) naming its field.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import NamedTuple, Tuple

from ling_jax.checks import FieldError, check_int

MAX_LOGPROBS = 20  # the most top alternatives a caller may ask for per token (the OpenAI API's limit)
INT32_MAX = 2 ** 31 - 1
SEED_LIMIT = 2 ** 32
MAX_TEMPERATURE = 1e4  # far beyond any use (100 already flattens any logit gap); finite in float32


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Decoding settings; frozen and hashable so it can be a static jit argument.

    temperature: 0 means greedy (argmax); > 0 divides the logits.
    top_k: keep the k highest logits (0 = off).
    top_p: nucleus threshold in (0, 1]; 1.0 = off.
    seed: row b of a `generate` call draws with seed + b (`sampling.RowSampling.broadcast`).
    presence_penalty, frequency_penalty: in [-2, 2], 0 = off (OpenAI semantics, generated tokens).
    repetition_penalty: > 0, 1.0 = off (HF semantics, prompt + generated tokens).
    Penalties are applied by the caller that holds the token history (`token_stats.penalize_rows`).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self):
        # bounded to what the sampling programs hold (float32 temperature/top_p, int32 top_k, a
        # uint32 seed), so no value that passes here can fail later inside a jitted step
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real) or not (0.0 <= t <= MAX_TEMPERATURE):
            raise FieldError("temperature", f"temperature must be a finite number in [0, {MAX_TEMPERATURE:g}], "
                                            f"got {t!r}")
        k = self.top_k  # a whole number, not only an int: a JSON request file may spell 5 as 5.0
        if isinstance(k, bool) or not isinstance(k, numbers.Real) or int(k) != k or not 0 <= k <= INT32_MAX:
            raise FieldError("top_k", f"top_k must be an int in [0, 2**31-1] (0 = off), got {k!r}")
        p = self.top_p
        if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 < p <= 1.0:
            raise FieldError("top_p", f"top_p must be in (0, 1], got {p!r}")
        check_int(self.seed, "seed", low=0, expected="an int in [0, 2**32)", high=SEED_LIMIT - 1)
        check_penalties(self.presence_penalty, self.frequency_penalty, self.repetition_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether any penalty is on (then the caller must keep token statistics)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def check_penalties(presence_penalty, frequency_penalty, repetition_penalty, owner: str = "") -> None:
    """FieldError (a ValueError) naming the field unless presence/frequency are finite numbers in
    [-2, 2] (the OpenAI API's range) and repetition is a finite number > 0."""
    for name, v in (("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty)):
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not -2.0 <= v <= 2.0:
            raise FieldError(name, f"{owner}{name} must be a number in [-2, 2], got {v!r}")
    v = repetition_penalty
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (v > 0.0 and math.isfinite(v)):
        raise FieldError("repetition_penalty",
                         f"{owner}repetition_penalty must be a finite number > 0 (1.0 = off), got {v!r}")


def check_logprobs(n, owner: str = "") -> None:
    """FieldError (a ValueError) naming the field unless n is None (off) or an int in [0, MAX_LOGPROBS]."""
    if n is not None:
        check_int(n, f"{owner}logprobs", field="logprobs", low=0, high=MAX_LOGPROBS,
                  expected=f"None (off) or an int in [0, {MAX_LOGPROBS}] "
                           f"(0: the sampled token only; N: plus the top N)")


class TokenLogprob(NamedTuple):
    """One generated token's log-probability under the model's raw distribution
    (log_softmax of the logits, before penalties / temperature / top-k / top-p), and the top
    alternatives `top` = ((token id, logprob), ...) best first (ties: lower id first); `top` is
    empty when only the sampled token's logprob was asked for."""
    logprob: float
    top: Tuple[Tuple[int, float], ...]
