"""Argument checks shared by the whole package (standard library only, so host-only modules use them).

    n = check_int(n, "max_queue", low=0)        # FieldError "max_queue must be an int >= 0, got -1"
    check_int(k, "Engine speculative", field="speculative", low=0, high=3)
                                                # "Engine speculative must be an int in [0, 3], got 9"

An int is any integral number (a Python int or a numpy integer) except a bool. A refusal is a
`FieldError`: a ValueError whose message names the argument and what was expected, and whose
`field` attribute is the argument's bare name (a server maps it to its own request field).
"""
from __future__ import annotations

import numbers
from typing import Optional


class FieldError(ValueError):
    """A ValueError about one named argument or field; `field` is its bare name (e.g. "max_tokens")."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def is_int(value) -> bool:
    """True for an integral number (int, numpy integer), False for a bool or anything else."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def expected_int(low: Optional[int] = None, high: Optional[int] = None) -> str:
    """How `check_int` says what it expected: "a positive int", "an int >= 0", "an int in [0, 3]"."""
    if low is not None and high is not None:
        return f"an int in [{low}, {high}]"
    if low == 1:
        return "a positive int"
    if low is not None:
        return f"an int >= {low}"
    if high is not None:
        return f"an int <= {high}"
    return "an int"


def check_int(value, name: str, *, low: Optional[int] = None, high: Optional[int] = None,
              multiple_of: Optional[int] = None, expected: Optional[str] = None, field: Optional[str] = None,
              error: type = FieldError) -> int:
    """`value` as a Python int when it is an int in [low, high] (a bound of None: no bound) and, with
    `multiple_of`, a multiple of it; otherwise `error(f"{name} must be {expected}, got {value!r}")`.
    name: the argument as the message names it ("max_queue", "Engine prefill_chunk",
    "RequestParams.max_tokens", "--sequences"); expected: what the message says was expected
    (default `expected_int(low, high)`); field: the bare field name a FieldError carries (default
    name). error: FieldError (default) or a subclass, given (field, message); any other exception
    class is given the message alone."""
    ok = is_int(value) and (low is None or value >= low) and (high is None or value <= high) \
        and (multiple_of is None or value % multiple_of == 0)
    if not ok:
        message = f"{name} must be {expected or expected_int(low, high)}, got {value!r}"
        raise error(field or name, message) if issubclass(error, FieldError) else error(message)
    return int(value)
