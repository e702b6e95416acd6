"""How many prompt tokens a serving step feeds, over how many rows: the prefill policy and its
default per platform (host only: no jax). The scheduler splits at most `chunk` prompt tokens over at
most `rows` waiting prompts, no prompt more than `row_tokens`; the step runs the smallest compiled
row count in `row_buckets` that holds them.

Why the defaults differ: on CPU `8 rows x 64 tokens` (row buckets 1, 2, 4, 8): a backlog is fed in
large batched steps (every weight streamed once for 512 tokens: on the mid config 3.1 ms a prompt
token against 4.1 for `[2, 64]`), a lone prompt in `[1, <= 64]` steps beside the running decodes;
on the serving benchmark +9% / +26% output tokens/s at concurrency 8 / 32 over `128 over 2 rows`,
for ~2.6x the warm-up's compile time (BENCHMARKS.md, twenty-seventh session). TPU and GPU: `64
over 2 rows`, the programs the compile-only checks of the real config size a pod's memory with (an
`[8, 64]` program holds 4x their activations and compiles for minutes at full scale).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ling_jax.serve.buckets import row_buckets

#: The Engine's own keyword defaults, and every accelerator's: 64 prompt tokens over 2 rows.
STEADY_CHUNK, STEADY_ROWS = 64, 2
#: CPU: prompts fed side by side at most, and each prompt's tokens a step at most.
CPU_ROWS, CPU_ROW_TOKENS = 8, 64


@dataclass(frozen=True)
class PrefillPolicy:
    """chunk: prompt tokens a step at most; rows: prompts a step at most; row_tokens: one prompt's
    tokens a step at most (None = chunk); row_buckets: prefill row counts compiled (None = just
    `rows`). Field for field the Engine's prefill_chunk / prefill_rows / prefill_row_tokens /
    prefill_row_buckets."""
    chunk: int
    rows: int
    row_tokens: Optional[int] = None
    row_buckets: Optional[tuple[int, ...]] = None

    def engine_kwargs(self) -> dict:
        return {"prefill_chunk": self.chunk, "prefill_rows": self.rows, "prefill_row_tokens": self.row_tokens,
                "prefill_row_buckets": self.row_buckets}

    def describe(self) -> str:
        per_row = f", at most {self.row_tokens} a prompt" if self.row_tokens else ""
        rb = f", row buckets {','.join(map(str, self.row_buckets))}" if self.row_buckets else ""
        return f"prefill {self.chunk} tokens over {self.rows} row(s) a step{per_row}{rb}"


def default_prefill_policy(platform: str, max_slots: int) -> PrefillPolicy:
    """The platform's policy (module docstring) for an engine of `max_slots` slots: on CPU
    min(8, max_slots) rows of at most 64 tokens, row buckets `row_buckets(rows)` (1, 2, 4, 8)."""
    if platform != "cpu":
        return PrefillPolicy(STEADY_CHUNK, STEADY_ROWS)
    rows = max(1, min(CPU_ROWS, max_slots))
    return PrefillPolicy(rows * CPU_ROW_TOKENS, rows, CPU_ROW_TOKENS, row_buckets(rows))


def resolve_prefill_policy(platform: str, max_slots: int, chunk: Optional[int] = None, rows: Optional[int] = None,
                           row_tokens: Optional[int] = None,
                           row_buckets: Optional[Sequence[int]] = None) -> PrefillPolicy:
    """The platform's default when none of the four is given; otherwise the given ones with the
    Engine's keyword defaults for the rest (64 tokens, 2 rows or the largest row bucket given, row
    tokens = chunk, one row bucket), so a flag never mixes with half of another policy."""
    if chunk is None and rows is None and row_tokens is None and not row_buckets:
        return default_prefill_policy(platform, max_slots)
    if rows is None:
        rows = max(row_buckets) if row_buckets else STEADY_ROWS
    return PrefillPolicy(STEADY_CHUNK if chunk is None else chunk, rows, row_tokens,
                         tuple(row_buckets) if row_buckets else None)
