"""Train the tokenizer of a from-scratch model on its corpus (`ling-jax train` does this first)."""
from __future__ import annotations

from typing import Iterable

from ling_jax.checkpoint.tokenizer_files import special_tokens, tokenizer_config, train_byte_bpe, with_special_ids
from ling_jax.config import LingConfig


def train_tokenizer(texts: Iterable[str], cfg: LingConfig, min_frequency: int = 2) -> tuple[str, dict]:
    """Byte-level BPE trained on `texts` with `cfg.vocab_size` ids in total.

    The special tokens sit at the ids the config names (eos → `<|endoftext|>`, pad → `<|pad|>`,
    bos → `<|begin_of_text|>`); the BPE vocabulary fills the other ids in order.
    Returns (tokenizer.json text, tokenizer_config.json dict); write it with `checkpoint.tokenizer_files.write_tokenizer_files`.
    """
    specials = special_tokens(cfg)
    n_bpe = cfg.vocab_size - len(specials)
    if n_bpe < 256:
        raise ValueError(f"vocab_size={cfg.vocab_size} is too small for a byte-level BPE (needs >= {256 + len(specials)})")
    text, added = with_special_ids(train_byte_bpe(texts, n_bpe, min_frequency), cfg.vocab_size, specials)
    return text, tokenizer_config(cfg, specials, added)
