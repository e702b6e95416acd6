"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Why strict models that forbid unknown fields: OpenAI's API answers a wrong type ("5" for an int)
or an unknown parameter with a 400 naming it, and so does this server; a silently ignored typo
(`max_token`) would otherwise change what a client gets without telling it. The few fields beyond
OpenAI's (`top_k`, `repetition_penalty`, `ignore_eos`, `stop_token_ids`, `return_token_ids`) are
declared, so `extra_body={...}` in the openai client works for them.

Every number is bounded where it is declared to what the engine can represent (int32 for counts,
token ids and `top_k`; finite floats in their ranges; `seed` in [0, 2**32)), and every string must
be Unicode scalar values (`Text`: no lone surrogates), so nothing a client sends can fail inside
the engine thread or the tokenizer.

Range checks that need the engine (prompt length against the context, token ids against the
vocabulary, `n` against the queue) live in `ling_jax.server.requests`; everything static is here.
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

SEED_LIMIT = 2 ** 32
MAX_TOP_LOGPROBS = 20
INT32_MAX = 2 ** 31 - 1  # counts, token ids and top_k travel to the engine as int32
MAX_TEMPERATURE = 100.0


def scalar_text(s: str) -> str:
    """The string unchanged if every code point is a Unicode scalar value; else a ValueError naming
    the first lone surrogate (JSON `"\\ud800"` escapes and raw `ED A0 80` bytes both decode to one,
    and the tokenizer cannot take them)."""
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"not valid Unicode text: a lone surrogate U+{ord(s[e.start]):04X} at character "
                             f"{e.start} (text must be Unicode scalar values, UTF-8 encoded)") from None
    return s


Text = Annotated[str, AfterValidator(scalar_text)]
MAX_STOP_CHARS = 1024  # a stop string is matched on the event loop against every streamed piece


def stop_text(s: str) -> str:
    scalar_text(s)
    if len(s) > MAX_STOP_CHARS:
        raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters, this one has {len(s)}")
    return s


StopText = Annotated[str, AfterValidator(stop_text)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


class StreamOptions(Strict):
    include_usage: bool = False


class SamplingFields(Strict):
    """Fields both endpoints share. temperature 0 = greedy (OpenAI's convention); default 1."""
    model: Optional[Text] = None
    max_tokens: Optional[Annotated[int, Field(ge=1, le=INT32_MAX)]] = None
    temperature: Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(ge=-1, le=INT32_MAX)] = 0  # extra field; 0 or -1 = off
    n: Annotated[int, Field(ge=1, le=128)] = 1
    seed: Optional[Annotated[int, Field(ge=0, lt=SEED_LIMIT)]] = None
    stop: Optional[Union[StopText, Annotated[list[StopText], Field(max_length=16)]]] = None
    stop_token_ids: Optional[Annotated[list[TokenId], Field(max_length=64)]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=100.0, allow_inf_nan=False)] = 1.0
    ignore_eos: bool = False
    return_token_ids: bool = False  # extra field: each choice also carries its token ids
    user: Optional[Text] = None  # accepted and ignored, as an end-user identifier


TokenIds = Annotated[list[TokenId], Field(min_length=1)]
MAX_PROMPTS = 2048  # prompts of one completions request (OpenAI's limit for a prompt array)
Prompt = Union[Text, Annotated[list[Text], Field(max_length=MAX_PROMPTS)], TokenIds,
               Annotated[list[TokenIds], Field(max_length=MAX_PROMPTS)]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]] = None
    echo: bool = False


class TextPart(Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[Text, Annotated[list[TextPart], Field(min_length=1)]]] = None
    name: Optional[Text] = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Optional[Annotated[int, Field(ge=1, le=INT32_MAX)]] = None
    logprobs: bool = False
    top_logprobs: Optional[Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]] = None


class TokenizeRequest(Strict):
    model: Optional[Text] = None
    prompt: Optional[Text] = None
    messages: Optional[Annotated[list[ChatMessage], Field(min_length=1)]] = None
    add_special_tokens: bool = True


class DetokenizeRequest(Strict):
    model: Optional[Text] = None
    tokens: list[TokenId]


# ---- responses ------------------------------------------------------------------------------------
# "abort": the server shut down before the choice finished (not in OpenAI's list; vLLM's word)
FinishReason = Literal["stop", "length", "abort"]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[Optional[float]] = []
    top_logprobs: Optional[list[Optional[dict[str, float]]]] = None
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[FinishReason] = None
    token_ids: Optional[list[int]] = Field(None, exclude_if=lambda v: v is None)  # return_token_ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: Optional[str] = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[FinishReason] = None
    token_ids: Optional[list[int]] = Field(None, exclude_if=lambda v: v is None)  # return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Optional[Usage] = None


class ChatDelta(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[FinishReason] = None
    token_ids: Optional[list[int]] = Field(None, exclude_if=lambda v: v is None)  # return_token_ids


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = Field(None, exclude_if=lambda v: v is None)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ling-jax"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorBody
