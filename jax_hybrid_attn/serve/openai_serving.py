"""Completions and chat completions on the engine loop: OpenAI requests checked against the model, turned into
engine requests (one per prompt and choice), and their tokens into choices, whole or streamed.

A request is checked in full before anything reaches the engine (a bad one changes nothing). Its choices run as
separate engine requests; each choice's tokens become text through a `TextStream` (stop strings cut there, the
engine request then aborted). When the handler stops waiting (the client disconnected, or a stop string ended
every choice), the choices still running are aborted.

Stop tokens (the model's end-of-sequence tokens, ``stop_token_ids``) end a choice with finish reason "stop" and
add no text; they count as completion tokens. ``usage`` is in every whole response and in a stream's last chunk:
the chunk that ends its last choice, or, when ``stream_options.include_usage`` is true, as OpenAI sends it, one
more chunk with no choices before ``data: [DONE]`` (the other chunks' ``usage`` is then null).

A stream's text chunks are rendered from a template of their JSON with the text spliced in (no pydantic object
per token); events that wait for a handler are merged into one chunk.
"""

import asyncio
import contextlib
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence

from pydantic import BaseModel

from ..engine import SamplingParams
from ..engine.prompts import check_prompt
from ..models.tokenizer import Tokenizer
from .chat_template import ChatTemplate, ChatTemplateError
from .engine_loop import EngineRequest, TokenEvent
from .errors import NOT_FOUND, SERVER_ERROR, APIError
from .protocol import (
    SEED_MODULUS,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    Delta,
    Usage,
)
from .request_streams import RequestStreams
from .text import TextStream

__all__ = ["DONE", "MAX_PROMPTS", "OpenAIServing", "SubmittedStream", "sse"]

MAX_PROMPTS = 256
"""The most prompts one completion request may hold."""
DEFAULT_TEMPERATURE = 1.0
"""OpenAI's default temperature (``jha generate``'s is 0: greedy)."""
DONE = "data: [DONE]\n\n"
"""The last server-sent event of a stream."""


def sse(payload: BaseModel) -> str:
    """One server-sent event holding `payload` as JSON."""
    return f"data: {payload.model_dump_json()}\n\n"


@dataclasses.dataclass
class _Choice:
    """One choice while it runs: its engine request, its text so far, and how it ended."""

    index: int
    request: EngineRequest
    text: TextStream
    token_ids: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None


_Piece = tuple[_Choice, str, list[int], Usage | None]
"""What a running job yields: (choice, its new text, its new tokens, the job's usage once its last choice ends)."""


@dataclasses.dataclass
class _Job:
    """A checked request: its id, prompts (token ids) and choices, ready for the engine."""

    id: str
    prompts: list[list[int]]
    choices: list[_Choice]
    return_token_ids: bool
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))

    @property
    def usage(self) -> Usage:
        return Usage.of(sum(map(len, self.prompts)), sum(len(c.token_ids) for c in self.choices))


class OpenAIServing:
    """OpenAI's completion endpoints on the engine behind `streams`.

    Args:
      streams: the engine client's request streams (its model config and ``max_model_len`` bound the requests).
      tokenizer: the model's tokenizer.
      model_name: the name requests must give (or none).
      chat_template: the template of ``/v1/chat/completions`` (None: chat requests are refused).
      max_n: the largest ``n``.
    """

    def __init__(
        self,
        streams: RequestStreams,
        *,
        tokenizer: Tokenizer,
        model_name: str,
        chat_template: ChatTemplate | None,
        max_n: int,
    ):
        self.streams, self.engine = streams, streams.engine
        self.tokenizer, self.model_name, self.chat_template, self.max_n = tokenizer, model_name, chat_template, max_n

    @property
    def max_model_len(self) -> int | None:
        """The engine's ``max_model_len`` (None until its model has loaded)."""
        return self.engine.max_model_len

    # --------------------------------------------------------------------------------- completions

    async def completion(self, request: CompletionRequest) -> CompletionResponse:
        """The whole response."""
        job = self._completion_job(request)
        await _drain(self._follow(job, self._submit(job)))
        choices = [CompletionChoice(index=c.index, text=c.text.text, finish_reason=c.finish_reason,
                                    **self._token_fields(job, c)) for c in job.choices]  # fmt: skip
        return CompletionResponse(id=job.id, created=job.created, model=self.model_name, choices=choices,
                                  usage=job.usage)  # fmt: skip

    def completion_stream(self, request: CompletionRequest) -> "SubmittedStream":
        """Checks the request and sends it to the engine now; its server-sent events as they come."""
        job = self._completion_job(request)
        submitted = self._submit(job)

        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> str:
            return sse(CompletionChunk(id=job.id, created=job.created, model=self.model_name, choices=choices,
                                       usage=usage))  # fmt: skip

        text_chunk = _TextChunks(lambda index, text: chunk([CompletionChoice(index=index, text=text)]))

        async def events():
            async with contextlib.aclosing(self._follow(job, submitted)) as run:
                async for choice, piece, new_tokens, usage in run:
                    if choice.finish_reason is None and not job.return_token_ids:
                        yield text_chunk(choice.index, piece)
                        continue
                    tokens = {"token_ids": new_tokens} if job.return_token_ids else {}
                    choices = [CompletionChoice(index=choice.index, text=piece, finish_reason=choice.finish_reason,
                                                **tokens)]  # fmt: skip
                    yield chunk(choices, None if request.include_usage else usage)
            if request.include_usage:
                yield chunk([], job.usage)
            yield DONE

        return self._stream(job, events())

    def _completion_job(self, request: CompletionRequest) -> _Job:
        self._check_common(request)
        prompt = request.prompt
        if isinstance(prompt, str):
            prompts = [self.tokenizer.encode(prompt)]
        elif isinstance(prompt[0], str):
            prompts = [self.tokenizer.encode(p) for p in prompt]
        elif isinstance(prompt[0], int):
            prompts = [list(prompt)]
        else:
            prompts = [list(p) for p in prompt]
        if len(prompts) > MAX_PROMPTS:
            raise APIError(f"prompt: {len(prompts)} prompts, more than the {MAX_PROMPTS} one request may hold",
                           param="prompt")  # fmt: skip
        for tokens in prompts:
            self._check_prompt(tokens, param="prompt")
        return self._job("cmpl", prompts, request, max_tokens=request.max_tokens, max_tokens_param="max_tokens")

    # ---------------------------------------------------------------------------------------- chat

    async def chat(self, request: ChatCompletionRequest) -> ChatCompletionResponse:
        """The whole response."""
        job = self._chat_job(request)
        await _drain(self._follow(job, self._submit(job)))
        choices = [ChatChoice(index=c.index, message=AssistantMessage(content=c.text.text),
                              finish_reason=c.finish_reason, **self._token_fields(job, c)) for c in job.choices]  # fmt: skip
        return ChatCompletionResponse(id=job.id, created=job.created, model=self.model_name, choices=choices,
                                      usage=job.usage)  # fmt: skip

    def chat_stream(self, request: ChatCompletionRequest) -> "SubmittedStream":
        """Checks the request and sends it to the engine now; its server-sent events as they come: each choice's
        first chunk gives the assistant role, then its text, then its finish reason."""
        job = self._chat_job(request)
        submitted = self._submit(job)

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> str:
            return sse(ChatCompletionChunk(id=job.id, created=job.created, model=self.model_name, choices=choices,
                                           usage=usage))  # fmt: skip

        text_chunk = _TextChunks(lambda index, text: chunk([ChatChunkChoice(index=index, delta=Delta(content=text))]))

        async def events():
            yield chunk([ChatChunkChoice(index=c.index, delta=Delta(role="assistant", content="")) for c in job.choices])
            async with contextlib.aclosing(self._follow(job, submitted)) as run:
                async for choice, piece, new_tokens, usage in run:
                    if choice.finish_reason is None and not job.return_token_ids:
                        yield text_chunk(choice.index, piece)
                        continue
                    tokens = {"token_ids": new_tokens} if job.return_token_ids else {}
                    delta = Delta(content=piece) if piece or not choice.finish_reason else Delta()
                    choices = [ChatChunkChoice(index=choice.index, delta=delta, finish_reason=choice.finish_reason,
                                               **tokens)]  # fmt: skip
                    yield chunk(choices, None if request.include_usage else usage)
            if request.include_usage:
                yield chunk([], job.usage)
            yield DONE

        return self._stream(job, events())

    def _chat_job(self, request: ChatCompletionRequest) -> _Job:
        self._check_common(request)
        if self.chat_template is None:
            raise APIError(
                f"the model {self.model_name!r} has no chat template (tokenizer_config.json's chat_template): use "
                "/v1/completions, or start the server with --chat-template", param="messages",
                code="no_chat_template",
            )  # fmt: skip
        messages = [message.for_template() for message in request.messages]
        try:
            text = self.chat_template.render(messages, add_generation_prompt=request.add_generation_prompt,
                                             variables=request.template_variables)  # fmt: skip
        except ChatTemplateError as error:
            raise APIError(f"messages: {error}", param="messages") from None
        tokens = self.tokenizer.encode(text, add_special_tokens=False)
        if not tokens:
            raise APIError("messages: the chat template rendered them as no tokens", param="messages")
        self._check_prompt(tokens, param="messages")
        param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        return self._job("chatcmpl", [tokens], request, max_tokens=request.max_output_tokens, max_tokens_param=param)

    # ------------------------------------------------------------------------------------- checks

    @property
    def _model_config(self):
        if self.engine.model_config is None:
            raise APIError("the engine is loading the model", status=503, type=SERVER_ERROR)
        return self.engine.model_config

    def _check_common(self, request) -> None:
        if request.model is not None and request.model != self.model_name:
            raise APIError(f"model: the model {request.model!r} does not exist; this server serves "
                           f"{self.model_name!r}", status=404, param="model", code="model_not_found",
                           type=NOT_FOUND)  # fmt: skip
        unsupported = request.unsupported()
        if unsupported is not None:
            raise APIError(f"{unsupported}: not supported by this server", param=unsupported, code="unsupported")
        if request.n > self.max_n:
            raise APIError(f"n: {request.n} choices, more than this server's limit of {self.max_n}", param="n")
        vocab = self._model_config.vocab_size
        bad = [t for t in request.stop_token_ids or () if not 0 <= t < vocab]
        if bad:
            raise APIError(f"stop_token_ids: {bad[:8]} outside the vocabulary [0, {vocab})", param="stop_token_ids")

    def _check_prompt(self, tokens: Sequence[int], *, param: str) -> None:
        try:
            check_prompt(tokens, model_config=self._model_config, max_model_len=self.max_model_len)
        except (ValueError, NotImplementedError) as error:
            raise APIError(f"{param}: {error}", param=param) from None

    def _job(self, kind: str, prompts: list[list[int]], request, *, max_tokens, max_tokens_param: str) -> _Job:
        job_id = f"{kind}-{uuid.uuid4().hex}"
        choices = []
        for p, tokens in enumerate(prompts):
            room = self.max_model_len - len(tokens)
            if max_tokens is not None and max_tokens > room:
                raise APIError(
                    f"{max_tokens_param}: this model's maximum context length is {self.max_model_len} tokens; the "
                    f"prompt has {len(tokens)}, and {max_tokens_param}={max_tokens} asks for more than the "
                    f"{room} left", param=max_tokens_param,
                )  # fmt: skip
            for j in range(request.n):
                index = p * request.n + j
                sampling = self._sampling(request, max_tokens=room if max_tokens is None else max_tokens, choice=j)
                engine_request = EngineRequest(f"{job_id}-{index}", tokens, sampling)
                text = TextStream(self.tokenizer, prompt_token_ids=tokens, stop=request.stop_strings)
                choices.append(_Choice(index, engine_request, text))
        return _Job(job_id, prompts, choices, request.return_token_ids)

    @staticmethod
    def _sampling(request, *, max_tokens: int, choice: int) -> SamplingParams:
        seed = None if request.seed is None else (request.seed + choice) % SEED_MODULUS
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=DEFAULT_TEMPERATURE if request.temperature is None else request.temperature,
                top_k=0 if request.top_k is None else request.top_k,
                top_p=1.0 if request.top_p is None else request.top_p,
                seed=seed, stop_token_ids=tuple(request.stop_token_ids or ()), ignore_eos=request.ignore_eos,
            )  # fmt: skip
        except ValueError as error:
            param = str(error).split("=", 1)[0]
            raise APIError(f"{param}: {error}", param=param) from None

    @staticmethod
    def _token_fields(job: _Job, choice: _Choice) -> dict:
        if not job.return_token_ids:
            return {}
        return {"token_ids": choice.token_ids, "prompt_token_ids": choice.request.prompt_token_ids}

    # ----------------------------------------------------------------------------------- running

    def _submit(self, job: _Job) -> asyncio.Queue:
        """Send the job's choices to the engine; their events arrive in the returned queue."""
        try:
            return self.streams.open([c.request for c in job.choices])
        except RuntimeError as error:
            raise APIError(str(error), status=503, type=SERVER_ERROR) from None

    def _abort_running(self, job: _Job) -> None:
        """Abort the job's choices still running in the engine (idempotent)."""
        self.streams.close([c.request.request_id for c in job.choices if c.finish_reason is None])

    async def _follow(self, job: _Job, events: asyncio.Queue) -> AsyncIterator[_Piece]:
        """Yield (choice, its new text, its new tokens, the job's usage once its last choice ends, else None) as
        the submitted job's tokens arrive. The events waiting for a choice are taken together: a handler that runs
        behind the engine sends fewer, larger pieces. A choice's last item has its finish reason set. Choices
        still running when this ends (finished, cancelled or closed) are aborted."""
        running = {c.request.request_id: c for c in job.choices}
        try:
            while running:
                waiting = [await events.get()]
                while not events.empty():
                    waiting.append(events.get_nowait())
                for choice, tokens, reason in _merge(waiting, running):
                    new_tokens, piece = self._take(choice, tokens, reason)
                    if choice.finish_reason is not None:
                        del running[choice.request.request_id]
                        if reason is None:  # a stop string: the engine request still runs
                            self.streams.close([choice.request.request_id])
                    yield choice, piece, new_tokens, None if running else job.usage
        finally:
            self._abort_running(job)

    def _stream(self, job: _Job, events: AsyncIterator[str]) -> "SubmittedStream":
        return SubmittedStream(events, abort=lambda: self._abort_running(job))

    @staticmethod
    def _take(choice: _Choice, tokens: list[int], finish_reason: str | None) -> tuple[list[int], str]:
        """Add an event's tokens to `choice`: (the tokens it keeps, the text they release). A stop token (the
        last of a "stop" event) adds no text."""
        text_tokens = tokens[:-1] if finish_reason == "stop" and tokens else tokens
        before = len(choice.token_ids)
        piece = choice.text.add(text_tokens)
        if choice.text.stopped:
            kept = text_tokens[: choice.text.num_tokens - before]
            choice.finish_reason = "stop"
        else:
            kept = list(tokens)
            if finish_reason is not None:
                piece += choice.text.finish()
                choice.finish_reason = finish_reason
        choice.token_ids += kept
        return kept, piece


def _merge(events: list[TokenEvent], running: dict[str, _Choice]) -> list[tuple[_Choice, list[int], str | None]]:
    """The events of running choices, merged per choice in order: (choice, its tokens, its finish reason or
    None). An error event raises its `APIError`."""
    merged: dict[str, tuple[_Choice, list[int], str | None]] = {}
    for event in events:
        choice = running.get(event.request_id)
        if choice is None:
            continue
        if event.error is not None:
            kind = "invalid_request_error" if event.status and event.status < 500 else SERVER_ERROR
            raise APIError(event.error, status=event.status or 500, type=kind)
        _, tokens, _ = merged.get(event.request_id, (choice, [], None))
        merged[event.request_id] = (choice, tokens + event.token_ids, event.finish_reason)
    return list(merged.values())


class SubmittedStream:
    """A stream's server-sent events (`events`) for a job already in the engine: `aclose` aborts its running
    choices (`abort`) also when the events were never iterated (the client left before the response began)."""

    def __init__(self, events: AsyncIterator[str], *, abort: Callable[[], None]):
        self._events, self._abort = events, abort

    def __aiter__(self) -> AsyncIterator[str]:
        return self._events

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            self._abort()


class _TextChunks:
    """A stream's text-only chunks, rendered once per choice by pydantic (`make(index, text)` gives the
    server-sent event) with a placeholder for the text, then by splicing each piece in as JSON."""

    def __init__(self, make: Callable[[int, str], str]):
        self._make = make
        self._templates: dict[int, tuple[str, str]] = {}

    def __call__(self, index: int, text: str) -> str:
        template = self._templates.get(index)
        if template is None:
            before, _, after = self._make(index, _TEXT_SLOT).rpartition(json.dumps(_TEXT_SLOT))
            template = self._templates[index] = (before, after)
        return template[0] + json.dumps(text, ensure_ascii=False) + template[1]


_TEXT_SLOT = "<jha-text-slot>"


async def _drain(items) -> None:
    async with contextlib.aclosing(items):
        async for _ in items:
            pass
