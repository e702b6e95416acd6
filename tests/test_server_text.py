"""The server's streaming text pieces: incremental detokenisation never splits a character and joins
to `decode(all ids)`; stop strings are found across any split of the text and left out."""
import random

import pytest

from ling_jax.server.text import IncrementalDetokenizer, StopMatcher
from ling_jax.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_cfg):
    import tokenizers

    import np_reference as R
    from ling_jax.checkpoint.tokenizer_files import build_tokenizer
    text, _ = build_tokenizer(R.tiny_config(vocab_size=300, eos_token_id=295, pad_token_id=296))
    return Tokenizer(tokenizers.Tokenizer.from_str(text), eos_token="<|endoftext|>")


def test_detokenizer_pieces_join_to_decode_and_never_split_a_character(tok):
    rng = random.Random(0)
    texts = ["héllo wörld — ½ € 日本語 🙂 the river ran", "plain ascii text, numbers 3.14159 and 42"]
    for text in texts:
        ids = tok.encode(text)
        for _ in range(5):
            d, pieces, i = IncrementalDetokenizer(tok), [], 0
            while i < len(ids):  # random groups of tokens, as engine steps deliver them
                k = rng.randint(1, 3)
                pieces.append(d.push(ids[i:i + k]))
                i += k
            pieces.append(d.flush())
            assert "".join(pieces) == tok.decode(ids) == text
            assert all("\ufffd" not in p for p in pieces)
    # random ids (invalid UTF-8 runs included): the pieces still join to decode(all), and a piece
    # handed out before the end never ends in an unfinished character
    for seed in range(20):
        r = random.Random(seed)
        ids = [r.randrange(0, 295) for _ in range(r.randint(1, 30))]
        d = IncrementalDetokenizer(tok)
        early = [d.push([t]) for t in ids]
        assert all(not p.endswith("\ufffd") for p in early)
        assert "".join(early) + d.flush() == tok.decode(ids)
    # special tokens add no text
    d = IncrementalDetokenizer(tok)
    assert d.push([295]) == "" and d.flush() == ""


@pytest.mark.parametrize("stops", [["STOP"], ["ab", "b c"], ["xyzzy", "zz"], ["\n\n"], ["aaa"]])
def test_stop_matcher_every_split(stops):
    rng = random.Random(1)
    for text in ["one two ab c three", "no stop at all here", "xyzzzy and xyzzy", "para\n\nnext", "aa aaaa",
                 "STOP at the start", "ends with STO", "ends with STOP"]:
        hits = [text.find(s) for s in stops if s in text]
        want = text[:min(hits)] if hits else text
        for _ in range(30):
            cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 6))))
            parts = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
            m, out = StopMatcher(stops), ""
            for p in parts:
                out += m.push(p)
                assert want.startswith(out)  # nothing after a stop, nothing of a stop, ever sent
            out += m.flush()
            assert out == want and m.stopped == bool(hits)
