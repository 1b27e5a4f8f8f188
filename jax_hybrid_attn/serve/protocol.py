"""OpenAI's request and response bodies (pydantic) for ``/v1/completions``, ``/v1/chat/completions`` and
``/v1/models``, with vLLM's extensions (``top_k``, ``stop_token_ids``, ``ignore_eos``, ``return_token_ids``,
``add_generation_prompt``, ``chat_template_kwargs``).

Requests are checked here field by field (each error names its field); what depends on the model (the vocabulary,
``max_model_len``, the served name) is checked by `openai_serving`. Fields OpenAI defines and the engine cannot
honour (log probabilities, echo, penalties, tools) are refused by `CompletionRequest.unsupported` and
`ChatCompletionRequest.unsupported` rather than ignored; fields neither knows are ignored, as OpenAI-compatible
servers do.
"""

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

__all__ = [
    "MAX_TEMPERATURE",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "ChatMessage",
    "CompletionChunk",
    "CompletionRequest",
    "CompletionResponse",
    "ModelCard",
    "ModelList",
    "Usage",
]

MAX_TEMPERATURE = 1e6
"""The highest temperature the engine's sampler takes (`SamplingParams`)."""
SEED_MODULUS = 2**32
"""Seeds are reduced modulo this (the engine's seeds are uint32)."""
DEFAULT_COMPLETION_MAX_TOKENS = 16
"""``max_tokens`` of a completion request that gives none (OpenAI's default); a chat request that gives none
may use whatever ``max_model_len`` leaves."""

TokenIds = list[StrictInt]
Temperature = Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
PositiveInt = Annotated[StrictInt, Field(ge=1)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: StrictBool = False


class _Sampling(_Request):
    """The fields both endpoints share."""

    model: StrictStr | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    seed: StrictInt | None = None
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: TokenIds | None = None
    n: PositiveInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    return_token_ids: StrictBool = False
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        strings = [value] if isinstance(value, str) else value
        if strings is not None and any(not s for s in strings):
            raise ValueError("stop strings must not be empty")
        return strings

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _unsupported_sampling(self) -> str | None:
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                return name
        if self.logit_bias:
            return "logit_bias"
        return None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``. `prompt`: a string, a list of strings, a list of token ids, or a list of lists
    of token ids (one choice set per prompt)."""

    prompt: Any
    max_tokens: PositiveInt | None = DEFAULT_COMPLETION_MAX_TOKENS
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    suffix: str | None = None
    best_of: StrictInt | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value):
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value:
            if all(isinstance(p, str) for p in value):
                return value
            if all(_is_token_id(t) for t in value):
                return value
            if all(isinstance(p, list) and p and all(_is_token_id(t) for t in p) for p in value):
                return value
        raise ValueError(
            "must be a string, a non-empty list of strings, a non-empty list of token ids (ints) or a list of "
            "non-empty lists of token ids"
        )

    def unsupported(self) -> str | None:
        """The first field set that the server cannot honour, or None."""
        if self.echo:
            return "echo"
        if self.logprobs is not None:
            return "logprobs"
        if self.suffix is not None:
            return "suffix"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of"
        return self._unsupported_sampling()


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class TextPart(_Request):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(BaseModel):
    """One message of a conversation; keys beyond role and content (``name``, ``tool_calls``, ...) are passed
    to the chat template as they are."""

    model_config = ConfigDict(extra="allow")

    role: StrictStr
    content: StrictStr | list[TextPart] | None = None

    def for_template(self) -> dict:
        """The message as the chat template sees it: content parts joined into one string."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            message["content"] = "".join(part.text for part in self.content)
        return message


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    tools: list[dict] | None = None
    response_format: dict | None = None
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @property
    def max_output_tokens(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's current name), else ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def unsupported(self) -> str | None:
        if self.logprobs or self.top_logprobs is not None:
            return "logprobs"
        if self.tools:
            return "tools"
        if self.response_format is not None and self.response_format.get("type") != "text":
            return "response_format"
        return self._unsupported_sampling()


# ------------------------------------------------------------------------------------------------- responses

FinishReason = Literal["stop", "length", "abort"] | None
_OnlyWhenSet = Field(default=None, exclude_if=lambda value: value is None)
"""vLLM's ``return_token_ids`` fields: left out of the JSON unless asked for."""


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> "Usage":
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)  # fmt: skip


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None = None
    finish_reason: FinishReason = None
    token_ids: list[int] | None = _OnlyWhenSet
    prompt_token_ids: list[int] | None = _OnlyWhenSet


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class CompletionChunk(CompletionResponse):
    """A streamed piece: the same object as a whole response, with a part of one choice's text."""


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason = None
    token_ids: list[int] | None = _OnlyWhenSet
    prompt_token_ids: list[int] | None = _OnlyWhenSet


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: None = None
    finish_reason: FinishReason = None
    token_ids: list[int] | None = _OnlyWhenSet


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jax_hybrid_attn"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
