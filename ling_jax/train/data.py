"""Training data: text files → documents → one packed token stream → batches of windows.

`read_corpus` collects the documents, `corpus_tokens` tokenizes and packs them (each document
followed by EOS), and `BatchStream` cuts the stream into non-overlapping windows served in a
reshuffled order every epoch, with an exact resume position.
"""
from __future__ import annotations

import fnmatch
import os
from typing import Iterable

import numpy as np

from ling_jax.tokenizer import Tokenizer


def read_corpus(path: str, pattern: str = "*") -> list[str]:
    """Documents: the file itself, or every matching file under a directory (sorted, UTF-8, binary skipped)."""
    if os.path.isfile(path):
        files = [path]
    elif os.path.isdir(path):
        files = []
        for root, dirs, names in os.walk(path):
            dirs.sort()
            files += [os.path.join(root, n) for n in sorted(names) if fnmatch.fnmatch(n, pattern)]
    else:
        raise FileNotFoundError(f"--text: {path} not found")
    docs = []
    for f in files:
        try:
            with open(f, "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        if b"\0" in data[:4096]:
            continue
        text = data.decode("utf-8", errors="replace")
        if text.strip():
            docs.append(text)
    if not docs:
        raise ValueError(f"--text: no text documents found in {path}")
    return docs


def pack_documents(docs: Iterable[list[int]], eos_id: int) -> np.ndarray:
    """Concatenate token lists, each followed by EOS, into one int32 stream."""
    parts = [p for d in docs for p in (np.asarray(d, np.int32), np.asarray([eos_id], np.int32))]
    return np.concatenate(parts) if parts else np.zeros((0,), np.int32)


def corpus_tokens(docs: list[str], tok: Tokenizer, eos_id: int) -> np.ndarray:
    """The packed int32 token stream of `docs` (no special tokens added; EOS after each document)."""
    enc = tok.backend.encode_batch(docs, add_special_tokens=False)
    return pack_documents([e.ids for e in enc], eos_id)


class BatchStream:
    """Batches of non-overlapping `seq`-token windows of a packed stream, reshuffled every epoch.

    Deterministic in (seed, epoch); `position()` / `set_position()` give the exact resume point.
    """

    def __init__(self, tokens: np.ndarray, batch: int, seq: int, seed: int = 0):
        self.tokens = np.asarray(tokens, np.int32)
        self.batch, self.seq, self.seed = int(batch), int(seq), int(seed)
        self.n_windows = len(self.tokens) // self.seq
        if self.n_windows < 1:
            raise ValueError(f"corpus has {len(self.tokens)} tokens: fewer than one window of --seq {seq}")
        self.epoch, self.index = 0, 0
        self._order = self._perm(0)

    def _perm(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)

    def position(self) -> dict:
        return {"epoch": int(self.epoch), "index": int(self.index)}

    def set_position(self, pos: dict) -> None:
        self.epoch, self.index = int(pos["epoch"]), int(pos["index"])
        self._order = self._perm(self.epoch)

    def next(self) -> np.ndarray:
        """The next batch [batch, seq] (int32)."""
        rows = []
        for _ in range(self.batch):
            if self.index >= self.n_windows:
                self.epoch += 1
                self.index = 0
                self._order = self._perm(self.epoch)
            w = self._order[self.index]
            self.index += 1
            rows.append(self.tokens[w * self.seq:(w + 1) * self.seq])
        return np.stack(rows)
