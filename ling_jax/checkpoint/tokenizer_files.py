"""Byte-level BPE tokenizer files whose special tokens sit at exactly a config's ids.

Two producers share this: `build_tokenizer` (the small tokenizer `write_checkpoint` /
`ling-jax make-checkpoint` put next to a synthetic checkpoint, trained on a built-in text) and
`ling_jax.train.tokenizer_train.train_tokenizer` (trained on the user's corpus). Both give
(tokenizer.json text, tokenizer_config.json dict), written by `write_tokenizer_files`.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Optional

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from ling_jax.config import LingConfig, write_json

_CORPUS = """\
A language model reads a stream of tokens and predicts the next one. Each token is a small piece
of text: a whole word, part of a word, a space, a digit or a punctuation mark. The model turns
every token into a vector, mixes the vectors of the sequence with attention and recurrent layers,
and finally scores every entry of its vocabulary.

The river ran quietly past the old mill, where the water wheel had not turned for many years.
Children walked along the bank in the evening, counting boats and throwing small stones into the
current. On Saturdays the market filled the square with bread, apples, cheese, honey and flowers.

Numbers matter too: 0 1 2 3 4 5 6 7 8 9, 10, 42, 100, 2025, 3.14159, 1e-6, 4096 and 128.
Lists, dates and prices (12.50, 7.99) appear in ordinary writing as often as long sentences do.

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))

Questions and answers: What is the capital of France? Paris. How many days are in a week? Seven.
Why is the sky blue? Sunlight is scattered by the air, and blue light is scattered the most.
The user asks, the assistant answers, and the conversation continues until the end of the text.
"""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def special_tokens(cfg: LingConfig) -> dict[int, str]:
    """id -> content of the special tokens the config refers to (eos ids, pad, bos); every id must
    lie inside the vocabulary."""
    sp: dict[int, str] = {}
    for j, e in enumerate(cfg.eos_token_id):
        sp.setdefault(int(e), "<|endoftext|>" if j == 0 else f"<|eos_{j}|>")
    if cfg.pad_token_id is not None:
        sp.setdefault(int(cfg.pad_token_id), "<|pad|>")
    if cfg.bos_token_id is not None:
        sp.setdefault(int(cfg.bos_token_id), "<|begin_of_text|>")
    for i, s in sp.items():
        if not 0 <= i < cfg.vocab_size:
            raise ValueError(f"special token id {i} ({s}) is outside the vocabulary (vocab_size={cfg.vocab_size})")
    return sp


def train_byte_bpe(texts: Iterable[str], n_bpe: int, min_frequency: int = 2) -> Tokenizer:
    """A byte-level BPE (all 256 byte symbols + merges) with at most `n_bpe` entries, no special tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=n_bpe, min_frequency=min_frequency, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
    tok.train_from_iterator(texts, trainer)
    return tok


def with_special_ids(tok: Tokenizer, vocab_size: int, specials: dict[int, str]) -> tuple[str, list]:
    """A trained `tokenizers` BPE re-numbered so the special tokens sit at exactly the config's ids.

    Returns (tokenizer.json text, the added-token entries). Merges refer to tokens by text, so the
    BPE vocabulary can take the free ids in order.
    """
    d = json.loads(tok.to_str())
    bpe = sorted(d["model"]["vocab"].items(), key=lambda kv: kv[1])
    free = (i for i in range(vocab_size) if i not in specials)
    d["model"]["vocab"] = {t: next(free) for t, _ in bpe}
    added = []
    for i, s in sorted(specials.items()):
        d["model"]["vocab"][s] = i
        added.append({"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
                      "normalized": False, "special": True})
    d["added_tokens"] = added
    text = json.dumps(d, ensure_ascii=False)
    Tokenizer.from_str(text)  # must load
    return text, added


def tokenizer_config(cfg: LingConfig, specials: dict[int, str], added: list,
                     chat_template: Optional[str] = None) -> dict:
    """tokenizer_config.json for a tokenizer of `with_special_ids` (no BOS/EOS added on encode)."""
    tcfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": specials[int(cfg.eos_token_id[0])],
            "pad_token": specials[int(cfg.pad_token_id)] if cfg.pad_token_id is not None else None,
            "bos_token": specials[int(cfg.bos_token_id)] if cfg.bos_token_id is not None else None,
            "add_bos_token": False, "add_eos_token": False, "clean_up_tokenization_spaces": False,
            "model_max_length": int(cfg.max_position_embeddings)}
    if chat_template is not None:
        tcfg["chat_template"] = chat_template
    tcfg["added_tokens_decoder"] = {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added}
    return tcfg


def build_tokenizer(cfg: LingConfig) -> tuple[str, dict]:
    """(tokenizer.json text, tokenizer_config dict): a byte-level BPE trained on a built-in text.

    The BPE vocabulary has at most 512 entries and avoids the config's special ids; the special
    tokens (eos, pad, bos) sit exactly at the ids the config names, so the model and tokenizer agree.
    """
    specials = special_tokens(cfg)
    n_bpe = min(512, cfg.vocab_size - len(specials))
    if n_bpe < 260:
        raise ValueError(f"vocab_size={cfg.vocab_size} is too small for a byte-level tokenizer "
                         f"(needs >= {260 + len(specials)}); write without a tokenizer")
    paragraphs = [p for p in _CORPUS.split("\n\n") if p.strip()]
    tok = train_byte_bpe(paragraphs * 4, n_bpe)
    text, added = with_special_ids(tok, cfg.vocab_size, specials)
    return text, tokenizer_config(cfg, specials, added, CHAT_TEMPLATE)


def write_tokenizer_files(out_dir: str, tok: tuple[str, dict]) -> None:
    """Write (tokenizer.json text, tokenizer_config dict) into `out_dir` (created if missing)."""
    os.makedirs(out_dir, exist_ok=True)
    text, tcfg = tok
    with open(os.path.join(out_dir, "tokenizer.json"), "w", encoding="utf-8") as f:
        f.write(text)
    write_json(os.path.join(out_dir, "tokenizer_config.json"), tcfg)
