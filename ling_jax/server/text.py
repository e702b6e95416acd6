"""Streaming text: an incremental detokeniser and a stop-string matcher.

Why both are needed for "streamed text == non-streamed text": a token can end in the middle of a
UTF-8 character (byte-level BPE), so the text of the tokens so far may end in U+FFFD that the next
token turns into a real character; and a stop string can be split over tokens and over chunks, so
text that might be the start of one has to be held back until it is known not to be. Both the
streamed and the non-streamed responses are built from the pieces these classes hand out, so they
are the same text by construction; the tests also check it equals `tokenizer.decode` of the ids.
"""
from __future__ import annotations

from typing import Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Text of a growing token list, handed out in pieces that never end inside a character.

    Only the tokens since the last piece (and the piece before, for context) are decoded each
    time, so the cost per token does not grow with the length. The pieces joined equal
    `decode(all ids)` for decoders whose output for a prefix of tokens is a prefix of the output
    for all of them (byte-level BPE: yes, apart from an unfinished character at the end).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids[prefix:read] decoded to the last piece handed out (context)
        self.read = 0    # ids before `read` are handed out

    def _decode(self, ids) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, ids: Sequence[int]) -> str:
        """Add tokens; return the new text that is complete (maybe "")."""
        self.ids.extend(int(i) for i in ids)
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        if after.endswith(REPLACEMENT):
            return ""  # an unfinished character: wait for the token that completes it
        piece = after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        return piece

    def flush(self) -> str:
        """The rest, unfinished characters included (the sequence has ended)."""
        before = self._decode(self.ids[self.prefix:self.read])
        after = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return after[len(before):]


class StopMatcher:
    """Cuts a text stream at the first occurrence of any stop string (the stop string excluded).

    push(piece) returns the text that is safe to send: everything except a tail that could still
    be the start of a stop string. A stop string split over any number of pieces is found, because
    the held tail plus the next piece is searched again.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.pending = ""
        self.stopped = False

    def push(self, piece: str) -> str:
        if self.stopped:
            return ""
        buf = self.pending + piece
        hits = [i for i in (buf.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stopped, self.pending = True, ""
            return buf[:min(hits)]
        keep = 0
        for s in self.stops:  # longest tail of buf that is a proper prefix of a stop string
            for k in range(min(len(s) - 1, len(buf)), keep, -1):
                if buf.endswith(s[:k]):
                    keep = k
                    break
        self.pending = buf[len(buf) - keep:] if keep else ""
        return buf[:len(buf) - keep]

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return "" if self.stopped else out
