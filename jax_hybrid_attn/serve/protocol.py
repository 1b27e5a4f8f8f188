"""OpenAI's request and response bodies (pydantic) for ``/v1/completions``, ``/v1/chat/completions`` and
``/v1/models``, with vLLM's extensions (``top_k``, ``stop_token_ids``, ``ignore_eos``, ``return_token_ids``,
``add_generation_prompt``, ``chat_template_kwargs``).

Requests are checked here field by field (each error names its field); what depends on the model (the vocabulary,
``max_model_len``, the served name) is checked by `openai_serving`. Types are strict: an int field takes only JSON
integers, a bool field only true or false, a float field only finite JSON numbers (integers included), a string field
only strings; null is taken as the default where OpenAI's API takes it so. Fields OpenAI defines and the engine cannot honour (log probabilities, echo, penalties, tools) are
refused by `CompletionRequest.unsupported` and `ChatCompletionRequest.unsupported` rather than ignored, as are
vLLM's extensions that would change what is generated (`VLLM_SAMPLING_EXTENSIONS` and those of each endpoint) set
to anything but the value that asks for nothing; other fields neither knows are ignored, as OpenAI-compatible servers
do.
"""

import time
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from ..integers import INT32_MAX

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

SEED_RANGE = (-(2**63), 2**63 - 1)
"""The seeds a request may give (a 64-bit integer, as OpenAI's and vLLM's)."""
TEMPLATE_OWN_VARIABLES = ("messages", "add_generation_prompt")
"""The chat template's variables that the request's own fields set (``chat_template_kwargs`` may not)."""
APPLY_CHAT_TEMPLATE_OPTIONS = frozenset(
    {
        "conversation",
        "chat_template",
        "tokenize",
        "continue_final_message",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
"""Options of transformers' ``apply_chat_template`` that it takes for itself (they are no template variables):
``chat_template_kwargs`` may not give them."""

Number = Annotated[StrictFloat, Field(allow_inf_nan=False)]
"""A float field: a finite JSON number (an integer is taken as a float; bools and strings are refused)."""
TokenIds = list[StrictInt]
Temperature = Annotated[Number, Field(ge=0.0, le=MAX_TEMPERATURE)]
TopP = Annotated[Number, Field(gt=0.0, le=1.0)]
PositiveInt = Annotated[StrictInt, Field(ge=1)]
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
Seed = Annotated[StrictInt, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])]


def _strings(value):
    """``stop``: a string is a list of one."""
    if not isinstance(value, (str, list)):
        raise PydanticCustomError("string_or_list_type", "must be a string or a list of strings")
    return [value] if isinstance(value, str) else value


def _text_parts(value):
    """A message's ``content``: a string is one text part."""
    if not isinstance(value, (str, list)):
        raise PydanticCustomError("content_type", "must be a string, a list of content parts or null")
    return [{"type": "text", "text": value}] if isinstance(value, str) else value


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    """``stream_options``: only with ``"stream": true``."""

    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False
    """vLLM's: usage in every chunk (not implemented: refused when true)."""


VLLM_SAMPLING_EXTENSIONS = {
    "use_beam_search": False,
    "min_p": 0,
    "repetition_penalty": 1,
    "length_penalty": 1,
    "min_tokens": 0,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "truncate_prompt_tokens": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "prompt_logprobs": None,
    "structured_outputs": None,
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
    "logits_processors": None,
    "priority": 0,
}
"""Fields of vLLM's API (both endpoints) that change what is generated and that this server does not implement,
with the value that asks for nothing (as does null, an empty list or object): a request that sets one to anything
else is refused."""
VLLM_COMPLETION_EXTENSIONS = {"response_format": None, "add_special_tokens": True}
"""The same for ``/v1/completions``."""
VLLM_CHAT_EXTENSIONS = {
    "continue_final_message": False,
    "echo": False,
    "chat_template": None,
    "documents": None,
    "add_special_tokens": False,
}
"""The same for ``/v1/chat/completions``."""


def _asks_nothing(value, neutral) -> bool:
    if value is None or value == [] or value == {}:
        return True
    return isinstance(value, bool) == isinstance(neutral, bool) and value == neutral


class _Sampling(_Request):
    """The fields both endpoints share. Fields beyond them are kept (`model_extra`) to refuse the extensions
    this server does not implement (`not_implemented`)."""

    model_config = ConfigDict(extra="allow")
    not_implemented: ClassVar[dict[str, Any]] = VLLM_SAMPLING_EXTENSIONS

    model: StrictStr | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, le=INT32_MAX)] | None = None
    seed: Seed | None = None
    stop: Annotated[list[Annotated[StrictStr, Field(min_length=1)]], BeforeValidator(_strings)] | None = None
    stop_token_ids: TokenIds | None = None
    n: PositiveInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    ignore_eos: StrictBool = False
    return_token_ids: StrictBool = False
    frequency_penalty: Number | None = None
    presence_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    user: StrictStr | None = None

    @field_validator("n", "stream", "return_token_ids", "echo", "logprobs", mode="before", check_fields=False)
    @classmethod
    def _null_is_default(cls, value, info: ValidationInfo):
        """OpenAI's API takes null for these as their default."""
        return cls.model_fields[info.field_name].default if value is None else value

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(cls, value, info: ValidationInfo):
        if value is not None and info.data.get("stream") is False:
            raise ValueError('only allowed with "stream": true')
        return value

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return tuple(self.stop or ())

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def _unsupported_sampling(self) -> str | None:
        for name, value in (self.model_extra or {}).items():
            if name in self.not_implemented and not _asks_nothing(value, self.not_implemented[name]):
                return name
        if self.stream_options is not None and self.stream_options.continuous_usage_stats:
            return "stream_options.continuous_usage_stats"
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name):
                return name
        if self.logit_bias:
            return "logit_bias"
        return None


class CompletionRequest(_Sampling):
    """``POST /v1/completions``. `prompt`: a string, a list of strings, a list of token ids, or a list of lists
    of token ids (one choice set per prompt)."""

    not_implemented: ClassVar[dict[str, Any]] = VLLM_SAMPLING_EXTENSIONS | VLLM_COMPLETION_EXTENSIONS

    prompt: Any
    max_tokens: PositiveInt | None = DEFAULT_COMPLETION_MAX_TOKENS
    echo: StrictBool = False
    logprobs: NonNegativeInt | None = None
    suffix: StrictStr | None = None
    best_of: PositiveInt | None = None

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
    content: Annotated[list[TextPart], BeforeValidator(_text_parts)] | None = None

    def for_template(self) -> dict:
        """The message as the chat template sees it: content parts joined into one string."""
        message = self.model_dump(exclude_none=True)
        if self.content is not None:
            message["content"] = "".join(part.text for part in self.content)
        return message


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    not_implemented: ClassVar[dict[str, Any]] = VLLM_SAMPLING_EXTENSIONS | VLLM_CHAT_EXTENSIONS

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: StrictBool = False
    top_logprobs: NonNegativeInt | None = None
    tools: list[dict] | None = None
    response_format: dict | None = None
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None
    """Variables of the chat template beyond its own (`TEMPLATE_OWN_VARIABLES`, of which ``add_generation_prompt``
    may be given if it equals the request's field) and the special tokens (which it may override)."""

    @field_validator("max_completion_tokens")
    @classmethod
    def _one_max_tokens(cls, value, info: ValidationInfo):
        other = info.data.get("max_tokens")
        if value is not None and other is not None and value != other:
            raise ValueError(f"{value} differs from max_tokens={other}: give one of them")
        return value

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value, info: ValidationInfo):
        for key in value or ():
            if key in APPLY_CHAT_TEMPLATE_OPTIONS:
                raise ValueError(f"{key!r} is an option of apply_chat_template, not a template variable")
            if key == "tools":
                raise ValueError("'tools': not supported by this server")
            if key == "messages":
                raise ValueError("'messages' is the template's own variable: the request's messages")
        if value and "add_generation_prompt" in value and "add_generation_prompt" in info.data:
            given, own = value["add_generation_prompt"], info.data["add_generation_prompt"]
            if given is not own:
                message = f"'add_generation_prompt': {given!r} differs from the request's add_generation_prompt={own}"
                raise ValueError(f"{message} (true unless given): set that field instead")
        return value

    @property
    def max_output_tokens(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's current name), else ``max_tokens``."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def template_variables(self) -> dict[str, Any]:
        """``chat_template_kwargs`` less the template's own variables (the request's fields give them)."""
        return {k: v for k, v in (self.chat_template_kwargs or {}).items() if k not in TEMPLATE_OWN_VARIABLES}

    def unsupported(self) -> str | None:
        if self.logprobs:
            return "logprobs"
        if self.top_logprobs is not None:
            return "top_logprobs"
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
