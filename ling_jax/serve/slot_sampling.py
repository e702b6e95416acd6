"""Each slot's sampling parameters in persistent host arrays (host-only: no jax).

Why: a request's temperature, top-k, top-p, seed, penalties, prompt length and logprobs flag do not
change while it holds its slot, so they are written once into row `slot` when it is admitted (or
re-admitted after a preemption), and a step gathers its rows' entries with one NumPy index per
field instead of rebuilding `sampling.RowSampling` from every row's `RequestParams`. Row
`max_slots` is the padding row: neutral values (greedy, no penalties, no logprobs).
"""
from __future__ import annotations

import numpy as np

from ling_jax.serve.request import RequestParams

#: (field, dtype, neutral value) of the static per-slot parameters, in `sampling.RowSampling` order
FIELDS = (("temperature", np.float32, 0.0), ("top_k", np.int32, 0), ("top_p", np.float32, 1.0),
          ("seed", np.uint32, 0), ("presence", np.float32, 0.0), ("frequency", np.float32, 0.0),
          ("repetition", np.float32, 1.0), ("prompt_len", np.int32, 0), ("logprobs", np.bool_, False))


class SlotSampling:
    """Arrays [max_slots + 1] per field of `FIELDS`; `owner[slot]`: the request id whose parameters
    row `slot` holds (-1: none)."""

    def __init__(self, max_slots: int):
        self.pad = max_slots
        self.arrays = {name: np.full(max_slots + 1, neutral, dtype) for name, dtype, neutral in FIELDS}
        self.owner = np.full(max_slots + 1, -1, np.int64)

    def admit(self, slot: int, request_id: int, params: RequestParams, prompt_len: int) -> None:
        """Row `slot` <- the request's parameters (once per admission)."""
        values = dict(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed,
                      presence=params.presence_penalty, frequency=params.frequency_penalty,
                      repetition=params.repetition_penalty, prompt_len=prompt_len,
                      logprobs=params.logprobs is not None)
        for name, _, _ in FIELDS:  # by name: a field without a value is a KeyError, not a shifted row
            self.arrays[name][slot] = values[name]
        self.owner[slot] = request_id

    def rows(self, requests) -> dict:
        """{field: [R] array} for a step's rows (`requests[i]` None = the padding row), admitting any
        request whose slot does not hold its parameters yet."""
        slots = np.empty(len(requests), np.int64)
        for i, r in enumerate(requests):
            if r is None:
                slots[i] = self.pad
                continue
            slots[i] = r.slot
            if self.owner[r.slot] != r.id:
                self.admit(r.slot, r.id, r.params, len(r.prompt))
        return {name: arr[slots] for name, arr in self.arrays.items()}
