"""Tokenizer and chat template for a Hugging Face style checkpoint directory.

Wraps the `tokenizers` library (the fast Rust tokenizer behind `tokenizer.json`) and renders
the checkpoint's Jinja chat template the way Hugging Face does (sandboxed environment,
`trim_blocks` / `lstrip_blocks`, a `raise_exception` helper), without depending on
`transformers`.

Files read from the checkpoint directory:
  tokenizer.json           required (otherwise `Tokenizer.from_dir` returns None)
  tokenizer_config.json    optional: chat_template, eos_token, bos_token, add_bos_token
  chat_template.jinja      optional: chat template when tokenizer_config.json has none
  generation_config.json   optional: read by `load_generation_config`
"""
from __future__ import annotations

import datetime
import json
import os
from typing import Any, Iterable, Mapping, Optional, Sequence, Union

import jinja2
import jinja2.ext
import jinja2.sandbox
import tokenizers

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"
# texts longer than this are encoded through `encode_batch`, which releases the GIL while the Rust
# tokenizer runs: a server tokenising a 4 MiB prompt on a worker thread keeps its event loop going
_GIL_FREE_CHARS = 4096


def _read_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> Optional[str]:
    """A special-token entry is a string or an AddedToken dict {"content": ...}."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"unrecognised special token entry: {value!r}")


def _select_template(template: Any) -> Optional[str]:
    """`chat_template` is a string, or a list of {"name", "template"} (use "default")."""
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        return named.get("default")
    raise ValueError(f"unrecognised chat_template entry of type {type(template).__name__}")


def _compile_template(source: str) -> jinja2.Template:
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                          separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.datetime.now().strftime(fmt)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the bits of tokenizer_config.json generation needs."""

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, chat_template: Optional[str] = None,
                 eos_token: Optional[str] = None, bos_token: Optional[str] = None, add_bos_token: bool = False):
        self.backend = tokenizer
        self.chat_template = chat_template
        self.eos_token = eos_token
        self.bos_token = bos_token
        self.add_bos_token = bool(add_bos_token)
        self._compiled_template = None

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_dir(cls, checkpoint_dir: Union[str, os.PathLike]) -> Optional["Tokenizer"]:
        """Load from a checkpoint directory (or `demo`, a Hub id ORG/NAME[@REVISION]: its tokenizer
        files, `ling_jax.checkpoint.locate`); None when it has no tokenizer.json."""
        from ling_jax.checkpoint.locate import resolve_checkpoint
        checkpoint_dir = resolve_checkpoint(os.fspath(checkpoint_dir), weights=False, what="checkpoint")
        path = os.path.join(checkpoint_dir, TOKENIZER_FILE)
        if not os.path.isfile(path):
            return None
        backend = tokenizers.Tokenizer.from_file(path)
        config: dict = {}
        config_path = os.path.join(checkpoint_dir, TOKENIZER_CONFIG_FILE)
        if os.path.isfile(config_path):
            config = _read_json(config_path)
        template = _select_template(config.get("chat_template"))
        template_path = os.path.join(checkpoint_dir, CHAT_TEMPLATE_FILE)
        if template is None and os.path.isfile(template_path):
            with open(template_path, encoding="utf-8") as f:
                template = f.read()
        return cls(backend, chat_template=template, eos_token=_token_content(config.get("eos_token")),
                   bos_token=_token_content(config.get("bos_token")),
                   add_bos_token=bool(config.get("add_bos_token", False)))

    # ------------------------------------------------------------------ vocabulary

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> Optional[int]:
        return self.backend.token_to_id(token)

    @property
    def eos_token_id(self) -> Optional[int]:
        """Id of `eos_token` when it is set and in the vocabulary, else None."""
        return None if self.eos_token is None else self.backend.token_to_id(self.eos_token)

    @property
    def bos_token_id(self) -> Optional[int]:
        """Id of `bos_token` when it is set and in the vocabulary, else None."""
        return None if self.bos_token is None else self.backend.token_to_id(self.bos_token)

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids for `text`.

        Special tokens written in the text (e.g. by a chat template) are matched as single
        tokens. With `add_special_tokens=True` the tokenizer.json post-processor runs and, if
        tokenizer_config.json sets add_bos_token, a BOS is prepended unless already there.
        The default (False) suits text rendered by `apply_chat_template`, which carries its
        own special tokens.
        """
        if len(text) > _GIL_FREE_CHARS:  # the batch call releases the GIL (`encode` holds it throughout)
            ids = list(self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        else:
            ids = list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)
        if add_special_tokens and self.add_bos_token:
            bos = self.bos_token_id
            if bos is not None and (not ids or ids[0] != bos):
                ids.insert(0, bos)
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text for `ids` (numpy / JAX integer arrays are fine); special tokens skipped."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------ chat template

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the chat template.

        The template sees `messages`, `add_generation_prompt`, `bos_token`, `eos_token` and
        any extra keyword arguments (e.g. `tools`). Raises ValueError when the checkpoint has
        no chat template or the template calls `raise_exception(...)`.
        """
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template: tokenizer_config.json has no 'chat_template' "
                             "and there is no chat_template.jinja; pass a raw prompt instead, or set "
                             "Tokenizer.chat_template")
        if self._compiled_template is None or self._compiled_template[0] != self.chat_template:
            self._compiled_template = (self.chat_template, _compile_template(self.chat_template))
        context = dict(messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
                       bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        context.update(kwargs)  # extra variables may override the defaults
        try:
            return self._compiled_template[1].render(**context)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template error: {e}") from e

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, eos_token={self.eos_token!r}, "
                f"bos_token={self.bos_token!r}, chat_template={bool(self.chat_template)})")


# ---------------------------------------------------------------------- generation config


def load_generation_config(checkpoint_dir: Union[str, os.PathLike]) -> dict:
    """generation_config.json as a dict ({} when the file is absent).

    Values are returned as written; in particular `eos_token_id` may be an int or a list of
    ints (see `eos_token_ids` for a normalised list).
    """
    path = os.path.join(os.fspath(checkpoint_dir), GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        return {}
    return _read_json(path)


def eos_token_ids(generation_config: Optional[Mapping[str, Any]] = None, tokenizer: Optional[Tokenizer] = None
                  ) -> list[int]:
    """Stop ids: generation_config's eos_token_id (int or list) then the tokenizer's eos.

    Deduplicated, order preserved; empty when neither source defines one.
    """
    ids: list[int] = []
    raw = (generation_config or {}).get("eos_token_id")
    if raw is not None:
        for i in (raw if isinstance(raw, (list, tuple)) else [raw]):
            if int(i) not in ids:
                ids.append(int(i))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        if tokenizer.eos_token_id not in ids:
            ids.append(tokenizer.eos_token_id)
    return ids
