"""`CallMode`: what kind of model call this is, as an explicit argument of the model call.

Why apart from `ExecConfig`: an ExecConfig says *how to compute* (kernels, chunk sizes, layer
loop, placement) and never changes the numbers; a call mode says *what the call is for*, and so
what it returns and which KDA form fits its tokens:

    forward   a whole sequence (cache-free or over a cache): chunked KDA, logits of every position
    prefill   prompt tokens into a cache: chunked KDA, no full-sequence logits (a caller takes the
              last position's from `hidden`); `snapshot_every` N > 0 also returns the KDA states
              after every N tokens of each row (the prefix cache's snapshots inside a chunk)
    decode    new tokens one by one: the recurrent KDA step (on T > 1 tokens the same recurrence,
              token after token: the reference the chunked form is checked against)
    verify    a speculative verification: the recurrent KDA scan keeping the state before and after
              every token, so any accepted prefix can be rolled back to (`kda.kda_rollback`)
    train     a training step: chunked KDA, logits of every position

`logits=False` skips the vocabulary projection of every position (a decode whose caller projects
only some rows, a prefill). A CallMode is hashable and static under `jit`.
"""
from __future__ import annotations

import dataclasses

from ling_jax.checks import check_int

CALL_KINDS = ("forward", "prefill", "decode", "verify", "train")


@dataclasses.dataclass(frozen=True)
class CallMode:
    """kind: one of CALL_KINDS (module doc); snapshot_every: prefill only, 0 or N > 0 tokens between
    returned KDA states; logits: also project every position to the vocabulary."""
    kind: str = "forward"
    snapshot_every: int = 0
    logits: bool = True

    def __post_init__(self):
        if self.kind not in CALL_KINDS:
            raise ValueError(f"CallMode.kind must be one of {', '.join(map(repr, CALL_KINDS))}, got {self.kind!r}")
        check_int(self.snapshot_every, "CallMode.snapshot_every", field="snapshot_every", low=0)
        if self.snapshot_every and self.kind != "prefill":
            raise ValueError(f"CallMode.snapshot_every is for a prefill (KDA states at chunk boundaries), "
                             f"not a {self.kind!r} call")
        if not isinstance(self.logits, bool):
            raise ValueError(f"CallMode.logits must be a bool, got {self.logits!r}")

    @classmethod
    def prefill(cls, snapshot_every: int = 0) -> "CallMode":
        return cls("prefill", snapshot_every, logits=False)

    @classmethod
    def decode(cls, logits: bool = True) -> "CallMode":
        return cls("decode", logits=logits)

    @property
    def kda_recurrent(self) -> bool:
        """KDA runs token by token (decode, verify) rather than chunked."""
        return self.kind in ("decode", "verify")

    @property
    def kda_states(self) -> bool:
        """KDA returns every per-token state for a rollback (verify)."""
        return self.kind == "verify"

    def replace(self, **changes) -> "CallMode":
        return dataclasses.replace(self, **changes)


FORWARD = CallMode("forward")
PREFILL = CallMode.prefill()
DECODE = CallMode.decode()
VERIFY = CallMode("verify")
TRAIN = CallMode("train")
