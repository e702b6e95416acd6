"""From a validated request body to the engine's work: prompt ids, `RequestParams` per choice.

Why separate from the pydantic models: these checks need the served model (its tokenizer, chat
template, vocabulary, context length and stop ids), and each refusal is an `APIError(400)` naming
the field: an empty prompt or message list, a prompt or `max_tokens` beyond the context, a token
id outside the vocabulary, a sampling field out of its range.
"""
from __future__ import annotations

import dataclasses
import random
from typing import Optional

from ling_jax.checks import FieldError
from ling_jax.serve.request import RequestParams
from ling_jax.server.errors import APIError
from ling_jax.server.generation import ChoicePlan
from ling_jax.server.protocol import (SEED_LIMIT, ChatCompletionRequest, ChatMessage, CompletionRequest,
                                      SamplingFields)

CHAT_DEFAULT_MAX_TOKENS = None  # chat: as many as the context leaves, like vLLM
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """What request checks need to know about the served model."""
    name: str
    tokenizer: object  # ling_jax.tokenizer.Tokenizer
    vocab_size: int
    max_seq_len: int  # prompt + new tokens of one request (the engine's)
    eos_ids: tuple


def check_model(info: ModelInfo, requested: Optional[str]) -> None:
    if requested is not None and requested != info.name:
        shown = repr(requested) if len(requested) <= 100 else repr(requested[:100]) + "..."
        raise APIError(404, f"the model {shown} does not exist (this server serves {info.name!r})",
                       param="model", code="model_not_found")


def check_ids(info: ModelInfo, ids: list, field: str) -> None:
    for t in ids:
        if not 0 <= t < info.vocab_size:
            raise APIError(400, f"{field}: token id {t} is outside the vocabulary [0, {info.vocab_size})", param=field)


def completion_prompts(info: ModelInfo, prompt) -> list[tuple[list, str]]:
    """(ids, text) per prompt of a completions request (a string, strings, ids or lists of ids)."""
    items = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else list(prompt)
    if not items:
        raise APIError(400, "prompt: empty list (need at least one prompt)", param="prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            ids = info.tokenizer.encode(item, add_special_tokens=True)
            text = item
        else:
            ids = list(item)
            check_ids(info, ids, "prompt")
            text = None
        if not ids:
            raise APIError(400, "prompt: empty prompt (it encodes to no tokens)", param="prompt")
        out.append((ids, text))
    return out


def chat_prompt(info: ModelInfo, messages: list[ChatMessage]) -> list:
    """Prompt ids of a chat: the checkpoint's chat template over the messages, then encode (the
    template writes its own special tokens)."""
    if not info.tokenizer.chat_template:
        raise APIError(400, f"the model {info.name!r} has no chat template; use /v1/completions", param="messages")
    if all(not m.text() for m in messages):
        raise APIError(400, "messages: every message is empty", param="messages")
    try:
        text = info.tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in messages],
                                                  add_generation_prompt=True)
    except ValueError as e:
        raise APIError(400, f"messages: {e}", param="messages") from None
    ids = info.tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise APIError(400, "messages: the chat template gave an empty prompt", param="messages")
    return ids


def _max_tokens(info: ModelInfo, n_prompt: int, asked: Optional[int], default: Optional[int], field: str,
                prompt_field: str = "prompt") -> int:
    room = info.max_seq_len - n_prompt
    if room < 1:
        raise APIError(400, f"{prompt_field}: the prompt has {n_prompt} tokens, which leaves no room in this "
                            f"model's context of {info.max_seq_len} tokens", param=prompt_field,
                       code="context_length_exceeded")
    if asked is None:
        return room if default is None else min(default, room)
    if asked > room:
        raise APIError(400, f"{field}={asked} plus the prompt's {n_prompt} tokens exceeds this model's context of "
                            f"{info.max_seq_len} tokens (at most {room} for this prompt)", param=field,
                       code="context_length_exceeded")
    return asked


def _stop_strings(req: SamplingFields) -> tuple:
    if req.stop is None:
        return ()
    stops = (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)
    if any(not s for s in stops):
        raise APIError(400, "stop: stop strings must be non-empty", param="stop")
    return stops


def _engine_params(req: SamplingFields, info: ModelInfo, max_tokens: int, seed: int,
                   logprobs: Optional[int]) -> RequestParams:
    stop_ids = tuple(req.stop_token_ids or ())
    check_ids(info, list(stop_ids), "stop_token_ids")
    if not req.ignore_eos:
        stop_ids = tuple(dict.fromkeys(info.eos_ids + stop_ids))
    try:
        return RequestParams(max_tokens=max_tokens, temperature=float(req.temperature), top_k=max(0, req.top_k),
                             top_p=float(req.top_p), seed=seed, stop_ids=stop_ids,
                             presence_penalty=float(req.presence_penalty),
                             frequency_penalty=float(req.frequency_penalty),
                             repetition_penalty=float(req.repetition_penalty), logprobs=logprobs)
    except FieldError as e:  # every refusal of RequestParams names its field
        raise APIError(400, str(e), param=e.field) from None


def _seeds(req: SamplingFields, count: int) -> list[int]:
    base = req.seed if req.seed is not None else random.randrange(SEED_LIMIT)
    return [(base + k) % SEED_LIMIT for k in range(count)]


def completion_plans(info: ModelInfo, req: CompletionRequest) -> tuple[list[ChoicePlan], int]:
    """(choice plans in OpenAI's order: prompt i's n choices at i*n .. i*n+n-1, prompt tokens)."""
    if req.echo and req.logprobs is not None:
        raise APIError(400, "echo with logprobs needs prompt logprobs, which this server does not compute",
                       param="echo")
    prompts = completion_prompts(info, req.prompt)
    stops = _stop_strings(req)
    seeds = _seeds(req, req.n)
    plans = []
    for ids, text in prompts:
        max_tokens = _max_tokens(info, len(ids), req.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, "max_tokens")
        echo = (text if text is not None else info.tokenizer.decode(ids)) if req.echo else ""
        for k in range(req.n):
            params = _engine_params(req, info, max_tokens, seeds[k], req.logprobs)
            plans.append(ChoicePlan(ids, params, stops, frozenset(params.stop_ids), echo))
    return plans, sum(len(ids) for ids, _ in prompts)


def chat_plans(info: ModelInfo, req: ChatCompletionRequest) -> tuple[list[ChoicePlan], int]:
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise APIError(400, "give max_tokens or max_completion_tokens, not both", param="max_completion_tokens")
    ids = chat_prompt(info, req.messages)
    field = "max_tokens" if req.max_tokens is not None else "max_completion_tokens"
    max_tokens = _max_tokens(info, len(ids), req.max_tokens or req.max_completion_tokens, CHAT_DEFAULT_MAX_TOKENS,
                             field, prompt_field="messages")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    stops = _stop_strings(req)
    plans = []
    for seed in _seeds(req, req.n):
        params = _engine_params(req, info, max_tokens, seed, logprobs)
        plans.append(ChoicePlan(ids, params, stops, frozenset(params.stop_ids)))
    return plans, len(ids)


def tokenize_ids(info: ModelInfo, prompt: Optional[str], messages: Optional[list], add_special: bool) -> list:
    if (prompt is None) == (messages is None):
        raise APIError(400, "give exactly one of prompt or messages", param="prompt")
    if messages is not None:
        return chat_prompt(info, messages)
    return info.tokenizer.encode(prompt, add_special_tokens=add_special)

