"""Multi-host serving: process 0 schedules, every process runs the same step programs.

Under `jax.distributed` the parameters and pools are global arrays on a mesh spanning every
process, so each compiled step is one SPMD program every process must launch, in the same order,
with the same inputs. Only process 0 (the leader) holds the queue and the scheduler; before each
program call it broadcasts what to run, and the followers, in `Engine.follow()`, receive and run
it until the leader's `Engine.shutdown()`. The message is one int32 buffer of a fixed size
(`StepLink.size`, so the broadcast compiles once): [op, R, T, W, call number, the StepInputs'
leaves in pytree order (4-byte dtypes bit-exact through a view, bools and small ints through
int32), zero padding]; a follower rebuilds the StepInputs from a template of shape (op, R, T, W)
(`ModelRunner.padding_inputs`); the call number catches a follower out of step (it would run
another program and hang in a collective). The prefix cache's copies (`OP_SAVE`, `OP_RESTORE`)
carry their int32 index arrays instead. Transport: `multihost_utils.broadcast_one_to_all`.
"""
from __future__ import annotations

from typing import Callable, Iterator, NamedTuple, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from ling_jax.serve.step import StepInputs

OP_SHUTDOWN, OP_DECODE, OP_PREFILL, OP_SPEC, OP_SAVE, OP_RESTORE = 0, 1, 2, 3, 4, 5
INDEX_OPS = (OP_SAVE, OP_RESTORE)  # payload: raw int32 index words, not a StepInputs
HEADER = 5  # op, R, T, W, call number


class ProgramShape(NamedTuple):
    """One compiled step shape: op, rows R and token width T of `ids` [R, T], block-table width W."""
    op: int
    rows: int
    tokens: int
    width: int


def packed_size(inputs) -> int:
    """int32 words `pack` needs for this StepInputs (one per element)."""
    return sum(np.asarray(x).size for x in jax.tree.leaves(inputs))


def _as_words(x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x)
    if x.dtype.itemsize == 4:
        return x.reshape(-1).view(np.int32)
    if x.dtype == np.bool_ or (np.issubdtype(x.dtype, np.integer) and x.dtype.itemsize < 4):
        return x.reshape(-1).astype(np.int32)
    raise TypeError(f"multihost: cannot broadcast a {x.dtype} step input (4-byte dtypes, bools and small ints only)")


def _from_words(words: np.ndarray, like: np.ndarray) -> np.ndarray:
    if like.dtype.itemsize == 4:
        return words.view(like.dtype).reshape(like.shape).copy()
    return words.astype(like.dtype).reshape(like.shape)


def pack(header: Sequence[int], inputs, size: int) -> np.ndarray:
    """[size] int32: the header words, then every leaf of `inputs` flattened in pytree order."""
    parts = [np.asarray(header, np.int32)] + [_as_words(np.asarray(x)) for x in jax.tree.leaves(inputs)]
    n = sum(p.size for p in parts)
    if n > size:
        raise ValueError(f"multihost: step inputs of {n} words exceed the message size {size}")
    buf = np.zeros(size, np.int32)
    buf[:n] = np.concatenate(parts)
    return buf


def unpack(buf: np.ndarray, template):
    """The StepInputs `pack` wrote after the header, shaped and typed like `template`."""
    leaves, treedef = jax.tree.flatten(template)
    out, i = [], HEADER
    for like in leaves:
        like = np.asarray(like)
        n = like.size
        out.append(_from_words(buf[i:i + n], like))
        i += n
    return jax.tree.unflatten(treedef, out)


class StepLink:
    """The leader's program calls, broadcast to the followers (module docstring).

    template(op, R, T, W) -> a numpy StepInputs of that program's shapes (values unused);
    shapes: every ProgramShape the engine compiles (they size the message); index_words: the
    largest index payload (the snapshot copies')."""

    def __init__(self, template: Callable[[int, int, int, int], StepInputs], shapes: Sequence[ProgramShape],
                 index_words: int = 0):
        self.template = template
        self.size = HEADER + max([packed_size(template(*s)) for s in shapes] + [index_words])
        self.is_leader = jax.process_index() == 0
        self.calls = 0  # messages sent (leader) or received (follower)
        self.closed = False

    def _broadcast(self, buf: np.ndarray) -> np.ndarray:
        return np.asarray(multihost_utils.broadcast_one_to_all(buf, is_source=self.is_leader))

    def send(self, op: int, inputs) -> None:
        """Leader: tell every follower to run program `op` on `inputs` (blocks until they take it): a
        StepInputs, the int32 index words of an INDEX_OPS copy, or None (OP_SHUTDOWN)."""
        if self.closed:
            raise RuntimeError("the engine was shut down (Engine.shutdown): it runs no more steps")
        if isinstance(inputs, StepInputs):
            shape = (*inputs.ids.shape, inputs.block_table.shape[1])
        else:
            shape, inputs = (0, 0, 0), () if inputs is None else np.asarray(inputs, np.int32).reshape(-1)
        self._broadcast(pack((op, *shape, self.calls), inputs, self.size))
        self.calls += 1

    def shutdown(self) -> None:
        """Leader: end the followers' `follow()` (idempotent)."""
        if self.is_leader and not self.closed:
            self.send(OP_SHUTDOWN, None)
            self.closed = True

    def messages(self) -> Iterator[tuple[int, StepInputs | np.ndarray]]:
        """Follower: every (op, inputs) the leader sends (for INDEX_OPS the payload words [size -
        HEADER]), until it shuts down."""
        while True:
            buf = self._broadcast(np.zeros(self.size, np.int32))
            op, R, T, W, n = (int(v) for v in buf[:HEADER])
            if n != self.calls:
                raise RuntimeError(f"multihost: process {jax.process_index()} received call {n}, expected "
                                   f"{self.calls} (out of step with process 0)")
            self.calls += 1
            if op == OP_SHUTDOWN:
                self.closed = True
                return
            yield op, buf[HEADER:].copy() if op in INDEX_OPS else unpack(buf, self.template(op, R, T, W))

    def wrap(self, op: int, program):
        """`program(params, pools, inputs, *state)` (state: device arrays it also takes, a prefill's
        snapshot rows) that the leader broadcasts before running and that a follower may run only
        inside `follow()` (called directly it raises); `.program` is the unwrapped one."""
        def linked(params, pools, inputs, *state):
            if not self.is_leader:
                raise RuntimeError(f"process {jax.process_index()} follows process 0's steps: call engine.follow() "
                                   "there (submit / step / warmup run on process 0 only)")
            self.send(op, inputs)
            return program(params, pools, inputs, *state)
        linked.program, linked._cache_size = program, program._cache_size
        return linked


def make_link(template: Callable[[int, int, int, int], StepInputs], shapes: Sequence[ProgramShape],
              index_words: int = 0) -> StepLink | None:
    """A StepLink when running multi-process, else None (single-process: nothing to broadcast)."""
    return StepLink(template, shapes, index_words) if jax.process_count() > 1 else None
