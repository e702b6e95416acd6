"""Tests for ling_jax.tokenizer on a tiny byte-level BPE tokenizer trained on the fly."""
from __future__ import annotations

import json

import numpy as np
import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from ling_jax.tokenizer import Tokenizer, eos_token_ids, load_generation_config

EOS, BOS = "<|endoftext|>", "<|startoftext|>"
ROLE_OPEN, ROLE_CLOSE = "<role>", "</role>"
SPECIALS = [EOS, BOS, ROLE_OPEN, ROLE_CLOSE]

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! This is a tiny corpus for a tiny tokenizer.",
    "Mixture-of-experts models route each token to a few experts.",
    "Speculative decoding drafts tokens and verifies them in parallel.",
    "Numbers 0123456789 and punctuation: ,.;:!?()[]{}",
]

# Ling-style template written over several lines: trim_blocks / lstrip_blocks must keep the
# block tags from leaking newlines and indentation into the prompt.
TEMPLATE = """{{- bos_token -}}
{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('unknown role: ' + message['role']) }}
    {% endif %}
<role>{{ message['role'] | upper }}</role>{{ message['content'] }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}
<role>ASSISTANT</role>
{%- endif %}"""


@pytest.fixture(scope="module")
def backend() -> HFTokenizer:
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer=trainer)
    return tok


def _write_dir(path, backend, config=None, generation_config=None):
    path.mkdir(parents=True, exist_ok=True)
    backend.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_config is not None:
        (path / "generation_config.json").write_text(json.dumps(generation_config))
    return path


@pytest.fixture
def ckpt(tmp_path, backend):
    config = {
        "chat_template": TEMPLATE,
        "eos_token": EOS,
        "bos_token": {"content": BOS, "lstrip": False, "rstrip": False, "__type": "AddedToken"},
        "add_bos_token": False,
    }
    return _write_dir(tmp_path / "ckpt", backend, config, {"eos_token_id": [0, 2]})


def test_from_dir_missing_returns_none(tmp_path):
    assert Tokenizer.from_dir(tmp_path / "does-not-exist") is None
    (tmp_path / "empty").mkdir()
    assert Tokenizer.from_dir(tmp_path / "empty") is None


@pytest.mark.parametrize(
    "text",
    [
        "The quick brown fox jumps over the lazy dog.",
        "unseen words: zebra quokka, 42 + 17 = 59\n\ttabs and  double  spaces",
        "héllo wörld — 世界 🙂",
        "",
    ],
)
def test_round_trip(ckpt, text):
    tok = Tokenizer.from_dir(ckpt)
    ids = tok.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(np.asarray(ids, np.int32)) == text


def test_special_tokens(ckpt):
    tok = Tokenizer.from_dir(ckpt)
    assert tok.eos_token == EOS and tok.bos_token == BOS  # AddedToken dict form parsed
    assert tok.eos_token_id == tok.token_to_id(EOS) == 0
    assert tok.bos_token_id == tok.token_to_id(BOS) == 1
    assert tok.vocab_size > 256
    ids = tok.encode(f"hello{EOS}")
    assert ids[-1] == tok.eos_token_id
    assert tok.decode(ids) == "hello"  # special tokens skipped by default
    assert tok.decode(ids, skip_special_tokens=False) == f"hello{EOS}"
    # add_bos_token=False: no BOS even when asking for special tokens
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")


def test_add_bos_token(tmp_path, backend):
    d = _write_dir(tmp_path / "bos", backend,
                   {"bos_token": BOS, "eos_token": EOS, "add_bos_token": True})
    tok = Tokenizer.from_dir(d)
    plain = tok.encode("hi")
    assert tok.encode("hi", add_special_tokens=True) == [tok.bos_token_id] + plain
    # not doubled when the text already starts with BOS
    assert tok.encode(BOS + "hi", add_special_tokens=True) == [tok.bos_token_id] + plain


def test_eos_not_in_vocab_and_no_config(tmp_path, backend):
    d = _write_dir(tmp_path / "odd", backend, {"eos_token": "</s>"})
    tok = Tokenizer.from_dir(d)
    assert tok.eos_token == "</s>" and tok.eos_token_id is None
    d2 = _write_dir(tmp_path / "bare", backend)
    tok2 = Tokenizer.from_dir(d2)
    assert tok2.eos_token is None and tok2.eos_token_id is None and tok2.bos_token_id is None
    assert tok2.decode(tok2.encode("plain text")) == "plain text"


def test_chat_template(ckpt):
    tok = Tokenizer.from_dir(ckpt)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    prompt = tok.apply_chat_template(messages)
    # block-tag lines vanish and their indentation is not emitted (trim/lstrip_blocks)
    assert prompt == (
        f"{BOS}<role>SYSTEM</role>Be brief.{EOS}\n<role>USER</role>Hi there{EOS}\n"
        "<role>ASSISTANT</role>"
    )
    no_gen = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert no_gen == f"{BOS}<role>SYSTEM</role>Be brief.{EOS}\n<role>USER</role>Hi there{EOS}\n"
    # the rendered special tokens encode to their single ids
    ids = tok.encode(prompt)
    for special in SPECIALS:
        assert tok.token_to_id(special) in ids
    assert ids[0] == tok.bos_token_id
    assert ids.count(tok.eos_token_id) == 2
    assert tok.decode(ids) == "SYSTEMBe brief.\nUSERHi there\nASSISTANT"


def test_chat_template_raise_exception(ckpt):
    tok = Tokenizer.from_dir(ckpt)
    with pytest.raises(ValueError, match="unknown role: tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])


def test_chat_template_extras_and_sandbox(ckpt):
    tok = Tokenizer.from_dir(ckpt)
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% if loop.index == 1 %}{% break %}"
        "{% endif %}{% endfor %}|{{ tools | tojson }}"
    )
    out = tok.apply_chat_template(
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
        tools=[{"name": "f", "description": "é"}],
    )
    assert out == 'a|[{"name": "f", "description": "é"}]'
    # the environment is sandboxed: no reaching into Python internals
    tok.chat_template = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(ValueError, match="chat template error"):
        tok.apply_chat_template([{"role": "user", "content": "a"}])


def test_missing_chat_template_is_a_clear_error(tmp_path, backend):
    d = _write_dir(tmp_path / "notemplate", backend, {"eos_token": EOS})
    tok = Tokenizer.from_dir(d)
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_template_file_and_named_templates(tmp_path, backend):
    d = _write_dir(tmp_path / "jinja", backend, {"eos_token": EOS})
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (d / "chat_template.jinja").write_text(template)
    tok = Tokenizer.from_dir(d)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[x]"

    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    d2 = _write_dir(tmp_path / "named", backend, {"chat_template": named})
    assert Tokenizer.from_dir(d2).apply_chat_template([]) == "D"


def test_generation_config(ckpt, tmp_path, backend):
    cfg = load_generation_config(ckpt)
    assert cfg == {"eos_token_id": [0, 2]}
    tok = Tokenizer.from_dir(ckpt)
    assert eos_token_ids(cfg, tok) == [0, 2]

    d = _write_dir(tmp_path / "int_eos", backend, {"eos_token": BOS},
                   {"eos_token_id": 0, "temperature": 0.7})
    cfg = load_generation_config(d)
    assert cfg["eos_token_id"] == 0 and cfg["temperature"] == 0.7
    assert eos_token_ids(cfg, Tokenizer.from_dir(d)) == [0, 1]

    assert load_generation_config(tmp_path / "nowhere") == {}
    assert eos_token_ids({}, None) == []
    assert eos_token_ids(None, tok) == [tok.eos_token_id]
