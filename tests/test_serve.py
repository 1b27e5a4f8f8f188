"""`jha serve`: the OpenAI-compatible server on the engine, driven by the official `openai` client over loopback.

One server for the module (the embedded model, tiny engine sizes, a chat template given on the command line),
run by uvicorn on a thread of the test process with its engine in a process of its own, as ``jha serve`` runs
it, so that the engine compiles once. Greedy outputs are checked against `Engine.generate` on the same engine
(what `jha generate` runs), called in the engine process while no request runs. After every test the engine
holds no request and every KV block is back in the pool.
"""

import asyncio
import functools
import io
import json
import logging
import os
import random
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from jax_hybrid_attn.cli import build_parser, main
from jax_hybrid_attn.engine import SamplingParams
from jax_hybrid_attn.models import ByteTokenizer

MAX_NUM_SEQS, TOKEN_BUDGET, MAX_MODEL_LEN = 8, 64, 128
MAX_N = 4
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)  # fmt: skip
STARTUP_TIMEOUT_S = 240  # loading and compiling on a busy 2-core machine
REQUEST_TIMEOUT_S = 60
IDLE_TIMEOUT_S = 30
FAULT_TEST_BUDGET_S = 20  # the fault test stops sending new requests after this (in CI)
FAULT_REQUESTS = int(os.environ.get("JHA_SERVE_FAULT_REQUESTS", "0"))
"""The fault test's requests when set (it then sends them all, with no time budget): a longer run than CI's."""
WORDS = ["attention", "window", "block", "cache", "token", "layer", "model", "serve", "batch", "paged"]


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


class _ErrorRecords(logging.Handler):
    """Keeps the ERROR records of the server's loggers (a request that failed inside the server)."""

    def __init__(self):
        super().__init__(level=logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture(scope="module")
def served():
    from uvicorn import Config, Server

    from jax_hybrid_attn.serve.server import build_server

    args = build_parser().parse_args(
        ["serve", "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(TOKEN_BUDGET),
         "--max-model-len", str(MAX_MODEL_LEN), "--chat-template", TEMPLATE, "--max-n", str(MAX_N)]
    )  # fmt: skip
    server = build_server(args, log=io.StringIO())
    errors = _ErrorRecords()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "jax_hybrid_attn.serve")]
    for logger in loggers:
        logger.addHandler(errors)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    uvicorn_server = Server(Config(server.app, log_level="warning", log_config=None, lifespan="on"))
    thread = threading.Thread(target=uvicorn_server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    health = []
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    with httpx.Client(base_url=base, timeout=REQUEST_TIMEOUT_S) as http:
        while time.monotonic() < deadline and (not health or health[-1] != 200):
            try:
                health.append(http.get("/health").status_code)
            except httpx.TransportError:  # not listening yet
                pass
            time.sleep(0.2)
    assert health and health[-1] == 200, f"the server did not become healthy: {health[-5:]}"
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=REQUEST_TIMEOUT_S)
    yield type("Served", (), {"server": server, "base": base, "port": port, "client": client, "health": health,
                              "errors": errors, "name": server.serving.model_name})  # fmt: skip
    client.close()
    uvicorn_server.should_exit = True
    thread.join(timeout=IDLE_TIMEOUT_S)
    for logger in loggers:
        logger.removeHandler(errors)
    assert not thread.is_alive()


def engine_state(engine) -> dict:
    """Whether `engine` holds requests, its free and usable blocks, its counters (run in the engine process)."""
    return {"unfinished": engine.has_unfinished_requests(), "free": engine.manager.num_free_blocks,
            "usable": engine.layout.num_blocks - 1, "steps": engine.stats.steps,
            "prompt_tokens": engine.stats.prompt_tokens}  # fmt: skip


def greedy_tokens(prompts: list[list[int]], lengths: list[int], engine) -> list[list[int]]:
    """`Engine.generate`'s greedy tokens (run in the engine process)."""
    sampling = [SamplingParams(max_tokens=n, temperature=0.0) for n in lengths]
    return [o.output_token_ids for o in engine.generate(prompts, sampling)]


def idle_engine(served) -> dict:
    """`engine_state` once the engine is idle."""
    return served.server.engine.when_idle(engine_state).result(timeout=IDLE_TIMEOUT_S)


@pytest.fixture(autouse=True)
def nothing_left(request):
    """After a test that used the server: no request in the engine, every block back in the pool."""
    yield
    if "served" not in request.fixturenames:
        return
    state = idle_engine(request.getfixturevalue("served"))
    assert not state["unfinished"] and state["free"] == state["usable"], state


def reference(served, prompts: list[list[int]], max_tokens: int | list[int]) -> list[list[int]]:
    """Greedy tokens of `Engine.generate` on the server's engine (on its thread, while no request runs)."""
    lengths = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else max_tokens
    outputs = served.server.engine.when_idle(functools.partial(greedy_tokens, prompts, lengths))
    return outputs.result(timeout=REQUEST_TIMEOUT_S)


TOKENIZER = ByteTokenizer()


def test_text_streams_hold_back_incomplete_characters_and_cut_stop_strings():
    from jax_hybrid_attn.serve.text import TextStream

    tokens = list("né 😀 ok".encode())  # multi-byte characters split over byte tokens
    stream = TextStream(TOKENIZER, prompt_token_ids=TOKENIZER.encode("é"))
    pieces = [stream.add([t]) for t in tokens]
    assert pieces[:3] == ["n", "", "é"] and "".join(pieces) + stream.finish() == "né 😀 ok"
    stream = TextStream(TOKENIZER, stop=["😀 o", "zz"])
    released = stream.add(tokens[:5]) + stream.add(tokens[5:])  # the stop string spans the two calls
    assert released + stream.finish() == "né " and stream.stopped and stream.num_tokens == len("né 😀 o".encode())
    assert stream.add([ord("x")]) == "" and stream.text == "né "
    held = TextStream(TOKENIZER, stop=["abc"])
    assert held.add(list(b"xxab")) == "xx" and held.add(list(b"d")) == "a"  # the last 2 could start "abc"
    assert held.finish() == "bd" and not held.stopped


def test_text_streams_of_a_tokenizer_json_match_its_decode(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from jax_hybrid_attn.models import HFTokenizer
    from jax_hybrid_attn.serve.text import TextStream

    vocab = {"<eos>": 0, "<unk>": 1, "hello": 2, "world": 3, "again": 4}
    words_only = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words_only.pre_tokenizer = pre_tokenizers.Whitespace()
    words_only.add_special_tokens(["<eos>"])
    words_only.save(str(tmp_path / "tokenizer.json"))
    tokenizer = HFTokenizer(tmp_path)
    output = [2, 3, 4, 2, 3, 0]
    prompt = [4, 4]
    stream = TextStream(tokenizer, prompt_token_ids=prompt)
    pieces = [stream.add([t]) for t in output]
    # the text that follows the prompt's (its first word's space included, as vLLM gives it)
    assert pieces[:2] == [" hello", " world"] and pieces[-1] == ""  # the end-of-sequence token adds no text
    continuation = tokenizer.decode(prompt + output)[len(tokenizer.decode(prompt)) :]
    assert "".join(pieces) + stream.finish() == continuation == " hello world again hello world"


def test_health_models_and_metrics(served):
    assert served.health[0] == 503 and served.health[-1] == 200  # 503 while compiling
    assert [m.id for m in served.client.models.list().data] == [served.name] == ["jha-embedded-hybrid"]
    served.client.completions.create(model=served.name, prompt="metrics", max_tokens=3, temperature=0)
    text = httpx.get(f"{served.base}/metrics").text
    for name in ("jha:num_requests_running", "jha:num_requests_waiting", "jha:kv_cache_blocks_in_use",
                 "jha:prefix_cache_hit_rate", "jha:time_to_first_token_seconds_bucket",
                 "jha:inter_token_latency_seconds_bucket", "jha:num_preemptions_total",
                 'jha:request_finished_total{finished_reason="length"}'):  # fmt: skip
        assert name in text, name
    import prometheus_client

    assert not any(m.name.startswith("jha:") for m in prometheus_client.REGISTRY.collect())  # its own registry


def test_completions_equal_engine_generate_whole_and_streamed(served):
    prompts = ["The capital of France is", "Sliding-window attention keeps only", "def fibonacci(n):"]
    expected = reference(served, [TOKENIZER.encode(p) for p in prompts], 12)
    whole = served.client.completions.create(model=served.name, prompt=prompts, max_tokens=12, temperature=0,
                                             extra_body={"return_token_ids": True})  # fmt: skip
    assert [c.index for c in whole.choices] == [0, 1, 2]
    for choice, tokens in zip(whole.choices, expected, strict=True):
        assert choice.token_ids == tokens and choice.text == TOKENIZER.decode(tokens)
        assert choice.finish_reason == ("length" if len(tokens) == 12 else "stop")
    prompt_tokens = sum(len(TOKENIZER.encode(p)) for p in prompts)
    assert whole.usage.prompt_tokens == prompt_tokens and whole.usage.completion_tokens == sum(map(len, expected))
    for prompt, tokens in zip(prompts, expected, strict=True):
        chunks = list(served.client.completions.create(model=served.name, prompt=prompt, max_tokens=12,
                                                       temperature=0, stream=True,
                                                       stream_options={"include_usage": True}))  # fmt: skip
        assert "".join(c.choices[0].text for c in chunks if c.choices) == TOKENIZER.decode(tokens)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(tokens)
        assert all(c.usage is None for c in chunks[:-1])
        # without include_usage the chunk that ends the last choice carries the usage
        chunks = list(served.client.completions.create(model=served.name, prompt=prompt, max_tokens=12,
                                                       temperature=0, stream=True))  # fmt: skip
        assert chunks[-1].choices[0].finish_reason and chunks[-1].usage.completion_tokens == len(tokens)
        assert all(c.usage is None for c in chunks[:-1])
    # a prompt of token ids, as one list
    ids = [257, 40, 41, 42]
    by_ids = served.client.completions.create(model=served.name, prompt=ids, max_tokens=5, temperature=0,
                                              extra_body={"return_token_ids": True})  # fmt: skip
    assert by_ids.choices[0].token_ids == reference(served, [ids], 5)[0]


def chat_prompt(messages) -> list[int]:
    """The prompt TEMPLATE renders (no bos_token: the embedded model has no tokenizer_config.json)."""
    text = ""
    for m in messages:
        text += f"<{m['role']}>{m['content']}\n"
    return TOKENIZER.encode(text + "<assistant>", add_special_tokens=False)


def test_chat_whole_and_streamed(served):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]
    [expected] = reference(served, [chat_prompt(messages)], 10)
    whole = served.client.chat.completions.create(model=served.name, messages=messages, max_tokens=10,
                                                  temperature=0)  # fmt: skip
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == TOKENIZER.decode(expected)
    assert whole.usage.prompt_tokens == len(chat_prompt(messages)) and whole.usage.completion_tokens == len(expected)
    stream = served.client.chat.completions.create(model=served.name, messages=messages, max_completion_tokens=10,
                                                   temperature=0, stream=True,
                                                   stream_options={"include_usage": True})  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == TOKENIZER.decode(expected)
    assert chunks[-1].usage.total_tokens == len(chat_prompt(messages)) + len(expected)
    chunks = list(served.client.chat.completions.create(model=served.name, messages=messages, max_tokens=10,
                                                        temperature=0, stream=True, n=2))  # fmt: skip
    assert [c.usage is not None for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].choices[0].finish_reason and chunks[-1].usage.completion_tokens == 2 * len(expected)
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name "}, {"type": "text", "text": "a prime."}]}]
    joined = served.client.chat.completions.create(model=served.name, messages=parts, max_tokens=4, temperature=0)
    assert joined.usage.prompt_tokens == len(chat_prompt([{"role": "user", "content": "Name a prime."}]))


def test_chat_templates_from_a_checkpoint_and_none(served, tmp_path):
    from jax_hybrid_attn.serve.chat_template import load_chat_template

    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": {"content": "<s>"}, "eos_token": "</s>"}))  # fmt: skip
    template = load_chat_template(tmp_path)
    assert template.render([{"role": "user", "content": "hi"}]) == "<s><user>hi\n<assistant>"
    named = tmp_path / "named"
    named.mkdir()
    (named / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "x"}, {"name": "default", "template": "{{ eos_token }}"}],
         "eos_token": "</s>"}))  # fmt: skip
    assert load_chat_template(named).render([]) == "</s>"
    jinja = tmp_path / "jinja"
    jinja.mkdir()
    (jinja / "chat_template.jinja").write_text("{{ messages | length }}")
    assert load_chat_template(jinja).render([{}, {}]) == "2"
    assert load_chat_template(tmp_path / "jinja" / "..", override="{{ 'over' }}").render([]) == "over"
    assert load_chat_template(None) is None and load_chat_template(tmp_path / "missing") is None

    # a server whose model has no chat template: chat is a clear 400, completions still serve
    from jax_hybrid_attn.serve.app import build_app
    from jax_hybrid_attn.serve.openai_serving import OpenAIServing

    serving = OpenAIServing(served.server.serving.streams, tokenizer=TOKENIZER, model_name="plain",
                            chat_template=None, max_n=1)  # fmt: skip
    app = build_app(serving, metrics=served.server.metrics, manage_engine=False)

    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://plain") as http:
            chat = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            completion = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            return chat, completion

    chat, completion = asyncio.run(ask())
    assert chat.status_code == 400 and chat.json()["error"]["code"] == "no_chat_template"
    assert "chat template" in chat.json()["error"]["message"] and chat.json()["error"]["param"] == "messages"
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 2


def test_sampling_options(served):
    client, name = served.client, served.name
    prompt = "In a hybrid model, full-attention layers"
    [greedy] = reference(served, [TOKENIZER.encode(prompt)], 16)
    text = TOKENIZER.decode(greedy)
    # seeded sampling repeats itself; n choices are indexed, each with its own seed
    sampled = [client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=1.0, top_p=0.9,
                                         seed=7, n=3, extra_body={"top_k": 50}) for _ in range(2)]  # fmt: skip
    assert [c.text for c in sampled[0].choices] == [c.text for c in sampled[1].choices]
    assert [c.index for c in sampled[0].choices] == [0, 1, 2] and sampled[0].usage.completion_tokens <= 24
    # a stop string: cut from the text, finish reason stop (streamed and not)
    start = max(1, len(text) // 2)
    stop = text[start : start + 2]
    cut = text[: text.find(stop)]
    whole = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    assert whole.choices[0].text == cut and whole.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0, stop=stop,
                                         stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == cut
    # a stop token: the output ends with it (counted, no text)
    stop_token = greedy[5]
    first = greedy.index(stop_token)
    by_token = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0,
                                         extra_body={"stop_token_ids": [stop_token], "return_token_ids": True})  # fmt: skip
    choice = by_token.choices[0]
    assert choice.token_ids == greedy[: first + 1] and choice.finish_reason == "stop"
    assert choice.text == TOKENIZER.decode(greedy[:first]) and by_token.usage.completion_tokens == first + 1


def test_32_concurrent_streaming_clients(served):
    rng = random.Random(32)
    prompts = [words(rng, rng.randint(1, 4)) for _ in range(32)]
    expected = reference(served, [TOKENIZER.encode(p) for p in prompts], 10)

    async def one(client, prompt):
        stream = await client.completions.create(model=served.name, prompt=prompt, max_tokens=10, temperature=0,
                                                 stream=True)  # fmt: skip
        return "".join([chunk.choices[0].text async for chunk in stream])

    async def all_at_once():
        async with openai.AsyncOpenAI(base_url=f"{served.base}/v1", api_key="unused", max_retries=0,
                                      timeout=REQUEST_TIMEOUT_S) as client:  # fmt: skip
            return await asyncio.gather(*(one(client, p) for p in prompts))

    texts = asyncio.run(all_at_once())
    assert texts == [TOKENIZER.decode(t) for t in expected]


def aborted(served) -> float:
    for line in httpx.get(f"{served.base}/metrics").text.splitlines():
        if line.startswith('jha:request_finished_total{finished_reason="abort"}'):
            return float(line.split()[-1])
    return 0.0


def test_clients_that_disconnect_are_aborted(served):
    before = aborted(served)
    long = {"model": served.name, "max_tokens": MAX_MODEL_LEN // 2, "temperature": 0,
            "extra_body": {"ignore_eos": True}}  # fmt: skip
    streams = [served.client.completions.create(prompt=f"stream {i}", stream=True, **long) for i in range(4)]
    for stream in streams:  # a few chunks each, then gone
        for _, _chunk in zip(range(3), stream, strict=False):
            pass
        stream.close()
    chat = served.client.chat.completions.create(messages=[{"role": "user", "content": "bye"}], stream=True, **long)
    next(iter(chat))
    chat.close()
    with pytest.raises(httpx.TimeoutException):  # a whole-response client that gives up
        httpx.post(f"{served.base}/v1/completions", json={"prompt": "patience", **long}, timeout=0.2)
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while aborted(served) < before + 6 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert aborted(served) == before + 6


# A stream the client leaves early: httpx's response generator is finalized by the garbage collector (client side)
@pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <async_generator object Response.aiter_raw:pytest.PytestUnraisableExceptionWarning"
)
def test_fault_injection_many_requests_some_disconnect(served):
    """Requests for ~20 s of CPU (or all `FAULT_REQUESTS`), 16 at a time, about 20% closing their stream at a
    random chunk: every request that completed equals its greedy reference, no server error, no block leaked
    (checked after each test)."""
    rng = random.Random(2024)
    plans = []
    budget_s = None if FAULT_REQUESTS else FAULT_TEST_BUDGET_S
    for i in range(FAULT_REQUESTS or 400):
        plans.append({"prompt": f"{i} {words(rng, rng.randint(1, 5))}", "max_tokens": rng.randint(2, 16),
                      "stream": rng.random() < 0.8,
                      "drop_after": rng.randint(0, 8) if rng.random() < 0.2 else None})  # fmt: skip
    done: dict[int, str] = {}
    dropped = []
    failures = []
    errors_before = len(served.errors.records)

    async def one(client, index, plan, limit, started):
        async with limit:
            if budget_s is not None and time.monotonic() - started > budget_s:
                return
            try:
                options = {"model": served.name, "prompt": plan["prompt"], "max_tokens": plan["max_tokens"],
                           "temperature": 0}  # fmt: skip
                if plan["drop_after"] is not None:
                    async with await client.completions.create(stream=True, **options) as stream:
                        count = 0
                        async for _ in stream:
                            count += 1
                            if count > plan["drop_after"]:
                                break
                    dropped.append(index)
                elif plan["stream"]:
                    stream = await client.completions.create(stream=True, **options)
                    done[index] = "".join([c.choices[0].text async for c in stream])
                else:
                    done[index] = (await client.completions.create(**options)).choices[0].text
            except Exception as error:  # noqa: BLE001 - every failure is reported below
                failures.append((index, repr(error)))

    async def run_all():
        limit = asyncio.Semaphore(16)
        started = time.monotonic()
        async with openai.AsyncOpenAI(base_url=f"{served.base}/v1", api_key="unused", max_retries=0,
                                      timeout=REQUEST_TIMEOUT_S) as client:  # fmt: skip
            await asyncio.gather(*(one(client, i, p, limit, started) for i, p in enumerate(plans)))

    asyncio.run(run_all())
    print(f"fault test: {len(done)} completed, {len(dropped)} disconnected mid-stream, {len(failures)} failed")
    assert not failures, failures[:5]
    assert len(done) >= 50 and len(dropped) >= 10, (len(done), len(dropped))
    assert len(served.errors.records) == errors_before, [r.getMessage() for r in served.errors.records[-3:]]
    indices = sorted(done)
    expected = reference(served, [TOKENIZER.encode(plans[i]["prompt"]) for i in indices],
                         [plans[i]["max_tokens"] for i in indices])  # fmt: skip
    assert [done[i] for i in indices] == [TOKENIZER.decode(t) for t in expected]


BAD_COMPLETIONS = [  # (body, status, the field the message names)
    ('{"prompt": "x", "max_tokens": 2', 400, None),  # malformed JSON
    ({"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"prompt": {"text": "x"}}, 400, "prompt"),
    ({"prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ({"prompt": "x" * (MAX_MODEL_LEN + 5)}, 400, "prompt"),
    ({"prompt": "x" * 100, "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ({"prompt": [257, 40, ByteTokenizer.vocab_size]}, 400, "prompt"),
    ({"prompt": [[257, 40], [-1]]}, 400, "prompt"),
    ({"prompt": "x", "model": "no-such-model"}, 404, "model"),
    ({"prompt": "x", "n": MAX_N + 1}, 400, "n"),
    ({"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x", "stop_token_ids": [ByteTokenizer.vocab_size + 1]}, 400, "stop_token_ids"),
    ({"prompt": "x", "stop": [""]}, 400, "stop"),
    ({"prompt": "x", "logprobs": 2}, 400, "logprobs"),
]
BAD_CHATS = [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x" * MAX_MODEL_LEN}]}, 400, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "other"}, 404, "model"),
]


@pytest.mark.parametrize(
    "route, body, status, field",
    [("/v1/completions", *case) for case in BAD_COMPLETIONS] + [("/v1/chat/completions", *case) for case in BAD_CHATS],
)
def test_bad_requests_are_openai_errors_that_change_nothing(served, route, body, status, field):
    before = idle_engine(served)
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(f"{served.base}{route}", content=content, headers={"Content-Type": "application/json"},
                          timeout=REQUEST_TIMEOUT_S)  # fmt: skip
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if field is None:
        assert "JSON" in error["message"]
    else:
        assert error["message"].startswith(field) and error["param"].split(".")[0] == field, error
    assert idle_engine(served) == before  # no step ran, no request was added


NAN, INF = float("nan"), float("inf")
NOT_BOOLS = [1, 0, "true", 1.0, [], {}]
NOT_INTS = [True, "1", 1.5, 1.0, [], {}]
NOT_FLOATS = [True, False, "0.5", "1", [], {}, NAN, INF, -INF]
NOT_STRINGS = [True, 1, 1.5, [], {}]
SHARED_FIELDS = {  # field: values both endpoints refuse, naming the field
    "model": NOT_STRINGS + ["no-such-model", "模型"],
    "temperature": NOT_FLOATS + [-0.5, 1e7],
    "top_p": NOT_FLOATS + [0, -0.1, 1.5],
    "top_k": NOT_INTS + [-2, 2**31],
    "seed": NOT_INTS + [2**63, -(2**63) - 1],
    "stop": [True, 1, 1.5, {}, [1], [""], [None], ["x", []]],
    "stop_token_ids": [True, 1, "1", [True], [1.5], ["1"], [-1], [2**40]],
    "n": NOT_INTS + [0, -1, MAX_N + 1, 2**64],
    "stream": NOT_BOOLS,
    "stream_options": [True, 1, "x", [], {}, {"include_usage": True}],  # without "stream": true
    "ignore_eos": NOT_BOOLS + [None],
    "return_token_ids": NOT_BOOLS,
    "frequency_penalty": NOT_FLOATS + [0.5],
    "presence_penalty": NOT_FLOATS + [-0.5],
    "logit_bias": [True, 1, "x", [], {"1": True}, {"1": "1"}, {"1": NAN}, {"1": 5}],
    "user": NOT_STRINGS,
    "max_tokens": NOT_INTS + [0, -1, 2**64],
    # vLLM's extensions the server does not implement, asking for something
    "min_p": [0.1], "repetition_penalty": [1.2, True], "skip_special_tokens": [False, 1], "use_beam_search": [True],
    "guided_json": [{"type": "object"}], "min_tokens": [2], "priority": [1],
}
COMPLETION_FIELDS = {
    "prompt": [True, 1, 1.5, None, [], {}, [[]], [True], [1.5], [-1], [ByteTokenizer.vocab_size], ["x", 1]],
    "echo": NOT_BOOLS + [True],
    "logprobs": NOT_INTS + [-1, 0, 1],
    "suffix": NOT_STRINGS + ["x"],
    "best_of": NOT_INTS + [0, 2],
    "response_format": [{"type": "json_object"}],
    "add_special_tokens": [False],
}
CHAT_FIELDS = {
    "messages": [True, "x", {}, [], [1], [{}], [{"role": 1, "content": "x"}], [{"role": "user", "content": 1}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                 [{"role": "user", "content": [{"type": "text", "text": 1}]}], [{"role": "user", "content": [1]}]],
    "max_completion_tokens": NOT_INTS + [0, 2],  # 2: differs from max_tokens
    "logprobs": NOT_BOOLS + [True],
    "top_logprobs": NOT_INTS + [-1, 0, 5],
    "tools": [True, "x", {}, [1], [{"type": "function", "function": {"name": "f"}}]],
    "response_format": [True, "json", [], {"type": "json_object"}, {}],
    "add_generation_prompt": NOT_BOOLS + [None],
    "chat_template_kwargs": [True, [], "x", {"messages": []}, {"add_generation_prompt": False},
                             {"add_generation_prompt": "yes"}, {"add_generation_prompt": 1}, {"tokenize": True},
                             {"chat_template": "x"}, {"tools": []}, {"continue_final_message": True}],
    "continue_final_message": [True], "echo": [True], "chat_template": ["{{ 'x' }}"],
}
COMPLETION = {"prompt": "x", "max_tokens": 1}
CHAT = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}


def fuzz_cases():
    """(route, body, the field its error must name): every field of both endpoints with each bad value (those of
    the fields both share, which one class checks, sent to either endpoint in turn)."""
    endpoints = [("/v1/completions", COMPLETION, COMPLETION_FIELDS), ("/v1/chat/completions", CHAT, CHAT_FIELDS)]
    for i, (field, values) in enumerate(SHARED_FIELDS.items()):
        for j, value in enumerate(values):
            route, base, _ = endpoints[(i + j) % 2]
            yield route, {**base, field: value}, field
    for route, base, fields in endpoints:
        for field, values in fields.items():
            for value in values:
                yield route, {**base, field: value}, field
    for route, base, _ in endpoints:
        yield route, {**base, "stream": False, "stream_options": {"include_usage": True}}, "stream_options"
        for options in [True, [], {"include_usage": 1}, {"include_usage": None}, {"continuous_usage_stats": True}]:
            yield route, {**base, "stream": True, "stream_options": options}, "stream_options"


def post(http, route: str, body, *, content_type: str | None = "application/json"):
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)  # NaN and Infinity as Python sends them
    headers = {} if content_type is None else {"Content-Type": content_type}
    return http.post(route, content=content, headers=headers)


def test_a_fuzz_of_every_field_gets_a_400_that_names_it(served):
    """Every field of both endpoints, with each wrong type (bool, string, float for int, list, object, null where
    OpenAI takes none), NaN and infinities as Python's json sends them, and out-of-range values: a 4xx in OpenAI's
    error JSON whose message starts with the field and whose param is it; nothing reaches the engine, nothing is
    logged as a server error."""
    before, errors_before = idle_engine(served), len(served.errors.records)
    wrong = []
    with httpx.Client(base_url=served.base, timeout=REQUEST_TIMEOUT_S) as http:
        for route, body, field in fuzz_cases():
            response = post(http, route, body)
            error = response.json().get("error") if response.status_code in (400, 404) else None
            if not (error and error["message"].startswith(field) and (error["param"] or "").split(".")[0] == field):
                wrong.append((route, body.get(field, body), response.status_code, response.text[:200]))
    assert not wrong, f"{len(wrong)} wrong answers, e.g. {wrong[:5]}"
    assert len(served.errors.records) == errors_before
    assert idle_engine(served) == before


MALFORMED = [  # (method, route, body, content type, status)
    ("POST", "/v1/completions", "[1, 2]", "application/json", 400),
    ("POST", "/v1/completions", "null", "application/json", 400),
    ("POST", "/v1/chat/completions", '"x"', "application/json", 400),
    ("POST", "/v1/chat/completions", "", "application/json", 400),
    ("POST", "/v1/completions", b"\xff\xfe{", "application/json", 400),
    ("POST", "/v1/completions", "[" * 10_000, "application/json", 400),
    ("POST", "/v1/completions", json.dumps(COMPLETION), "text/plain", 415),
    ("POST", "/v1/chat/completions", json.dumps(CHAT), "application/x-www-form-urlencoded", 415),
    ("GET", "/v1/completions", None, None, 405),
    ("PUT", "/v1/chat/completions", None, None, 405),
    ("POST", "/v1/models", "{}", "application/json", 405),
    ("GET", "/v1/no-such-route", None, None, 404),
    ("POST", "/v2/completions", json.dumps(COMPLETION), "application/json", 404),
]


def test_malformed_bodies_wrong_content_types_and_unknown_routes_are_openai_errors(served):
    with httpx.Client(base_url=served.base, timeout=REQUEST_TIMEOUT_S) as http:
        for method, route, body, content_type, status in MALFORMED:
            headers = {} if content_type is None else {"Content-Type": content_type}
            response = http.request(method, route, content=body, headers=headers)
            assert response.status_code == status, (method, route, body, response.text)
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        # a JSON body that names no content type, or application/json with a charset, is taken
        for content_type in (None, "application/json; charset=utf-8"):
            assert post(http, "/v1/completions", COMPLETION, content_type=content_type).status_code == 200


def test_edge_values_that_are_valid_are_served(served):
    """Ints for floats, null where OpenAI takes it as the default, the neutral values of vLLM's extensions, and
    chat_template_kwargs: its add_generation_prompt when it agrees with the request's, and any variable the
    template does not own (``self`` failed in the renderer's signature)."""
    prompt_tokens = len(chat_prompt(CHAT["messages"]))
    with httpx.Client(base_url=served.base, timeout=REQUEST_TIMEOUT_S) as http:
        for route, base in [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)]:
            for extra in ({"temperature": 0, "top_p": 1, "seed": -1, "frequency_penalty": 0, "logit_bias": {}},
                          {"n": None, "stream": None, "return_token_ids": None, "stop": ["😀", "é"], "user": "ü"},
                          {"min_p": 0, "repetition_penalty": 1.0, "skip_special_tokens": True, "guided_json": None}):
                response = post(http, route, {**base, **extra})
                assert response.status_code == 200, (route, extra, response.text)
        assert post(http, "/v1/completions", {**COMPLETION, "echo": None, "logprobs": None}).status_code == 200
        chat = [({"chat_template_kwargs": {"add_generation_prompt": True}}, prompt_tokens),
                ({"add_generation_prompt": False, "chat_template_kwargs": {"add_generation_prompt": False}},
                 prompt_tokens - len("<assistant>")),
                ({"chat_template_kwargs": {"self": 1, "bos_token": "B"}}, prompt_tokens + 1),
                ({"max_tokens": 1, "max_completion_tokens": 1, "logprobs": None, "top_logprobs": None}, prompt_tokens)]
        for extra, expected in chat:
            response = post(http, "/v1/chat/completions", {**CHAT, **extra})
            assert response.status_code == 200, (extra, response.text)
            assert response.json()["usage"]["prompt_tokens"] == expected, extra


def test_chat_templates_take_variables_and_fail_as_chat_template_errors():
    from jax_hybrid_attn.serve.chat_template import ChatTemplate, ChatTemplateError

    template = ChatTemplate("{{ bos_token }}{{ messages | length }}{{ add_generation_prompt }}{{ 10 // x }}",
                            special_tokens={"bos_token": "<s>"})
    assert template.render([{}], variables={"x": 5}) == "<s>1True2"
    assert template.render([], add_generation_prompt=False, variables={"x": 1, "bos_token": "B"}) == "B0False10"
    with pytest.raises(ChatTemplateError, match="ZeroDivisionError"):
        template.render([], variables={"x": 0})
    with pytest.raises(ValueError, match=r"variables=\['add_generation_prompt', 'messages'\]"):
        template.render([], variables={"messages": [], "add_generation_prompt": False, "x": 1})


def test_the_cli_refuses_bad_server_options(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--port", "70000"])
    assert exit_.value.code == 2 and "--port='70000' must be an integer in [0, 65535]" in capsys.readouterr().err
    assert main(["serve", "--chat-template", "no-such-template-file"]) == 2
    assert "--chat-template='no-such-template-file'" in capsys.readouterr().err


@pytest.mark.parametrize(("backend", "flags", "budget"), [
    ("gpu", [], "server"), ("gpu", ["--max-num-batched-tokens", "4096"], 4096), ("cpu", [], None),
])  # fmt: skip
def test_the_server_steps_at_its_own_token_budget_on_a_gpu(monkeypatch, backend, flags, budget):
    """`jha serve` on a GPU takes SERVE_GPU_STEP_TOKENS unless the flag says otherwise; elsewhere the engine's
    default (None here, resolved by the engine) stays."""
    import jax

    from jax_hybrid_attn import engine_options
    from jax_hybrid_attn.serve import SERVE_GPU_STEP_TOKENS
    from jax_hybrid_attn.serve.server import build_engine

    class Planned(Exception):
        pass

    def plan_model(args, *, log=None):
        raise Planned(args.max_num_batched_tokens)

    monkeypatch.setattr(jax, "default_backend", lambda: backend)
    monkeypatch.setattr(engine_options, "plan_model", plan_model)
    args = build_parser().parse_args(["serve", *flags])
    with pytest.raises(Planned) as planned:
        build_engine(args)
    assert planned.value.args[0] == (SERVE_GPU_STEP_TOKENS if budget == "server" else budget)
    assert args.max_num_batched_tokens == (4096 if flags else None)  # the caller's options are left as given


def test_the_core_and_the_cli_import_no_server_package():
    import subprocess
    import sys

    code = ("import sys, jax_hybrid_attn, jax_hybrid_attn.cli; jax_hybrid_attn.cli.build_parser(); "
            "print(sorted({'fastapi', 'uvicorn', 'jinja2', 'prometheus_client'} & set(sys.modules)))")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


class _FailingEngine:
    """Just enough of an `Engine` for the engine loop: compiled, takes requests, fails at its first step."""

    def __init__(self):
        from types import SimpleNamespace

        from jax_hybrid_attn.engine import EngineStats
        from jax_hybrid_attn.models import embedded_config

        self.stats, self.model_config, self.max_model_len = EngineStats(), embedded_config(), 16
        self.layout, self.runner = SimpleNamespace(num_blocks=4), SimpleNamespace(compiled=True)
        self.scheduler, self.manager = SimpleNamespace(running=[], waiting=[]), SimpleNamespace(num_free_blocks=3)
        self.request_ids = []

    def has_unfinished_requests(self):
        return bool(self.request_ids)

    def add_request(self, prompt_token_ids, sampling, *, request_id):
        if not prompt_token_ids:
            raise ValueError("prompt_token_ids must be a non-empty flat sequence of ints")
        self.request_ids.append(request_id)

    def step(self, on_token=None):
        raise RuntimeError("the device is gone")


def test_an_engine_that_fails_fails_its_requests_and_its_health_check():
    from jax_hybrid_attn.serve.app import build_app
    from jax_hybrid_attn.serve.engine_loop import EngineLoop, EngineRequest
    from jax_hybrid_attn.serve.metrics import ServerMetrics
    from jax_hybrid_attn.serve.openai_serving import OpenAIServing
    from jax_hybrid_attn.serve.request_streams import RequestStreams

    engine_loop = EngineLoop(_FailingEngine())
    metrics = ServerMetrics(snapshot=lambda: engine_loop.snapshot)
    streams = RequestStreams(engine_loop, observer=metrics)
    serving = OpenAIServing(streams, tokenizer=TOKENIZER, model_name="failing", chat_template=None, max_n=1)
    app = build_app(serving, metrics=metrics, manage_engine=False)
    engine_loop.start()
    assert engine_loop.ready.wait(IDLE_TIMEOUT_S)

    async def run():
        events = streams.open([EngineRequest("empty", [], SamplingParams()),
                               EngineRequest("ok", [1], SamplingParams())])  # fmt: skip
        received = [await asyncio.wait_for(events.get(), IDLE_TIMEOUT_S) for _ in range(2)]
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://failing") as http:
            return received, await http.get("/health"), await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})

    (refused, failed), health, completion = asyncio.run(run())
    assert refused.status == 400 and "non-empty" in refused.error  # the engine refused it: the client's error
    assert failed.status == 500 and "the device is gone" in failed.error
    assert isinstance(engine_loop.error, RuntimeError) and not engine_loop.healthy
    assert health.status_code == 503 and "the device is gone" in health.json()["error"]["message"]
    assert completion.status_code == 503 and "not running" in completion.json()["error"]["message"]


def test_a_burst_of_commands_goes_to_the_engine_process_in_a_few_early_messages():
    """Of the commands sent from the event loop in one pass, the first goes at once and the others in order as
    messages of `MAX_COMMANDS_PER_MESSAGE`, each as soon as it is full (the engine gets a burst's first requests
    while the server parses the rest), and what is left at the pass's end; the next pass starts over."""
    import argparse

    from jax_hybrid_attn.serve.engine_process import MAX_COMMANDS_PER_MESSAGE, EngineProcess

    class Pipe:
        def __init__(self):
            self.messages = []

        def send(self, message):
            self.messages.append(message)

    engine = EngineProcess(argparse.Namespace())
    engine._commands = pipe = Pipe()
    burst = [("abort", [f"request-{i}"]) for i in range(2 * MAX_COMMANDS_PER_MESSAGE + 4)]
    later = [("abort", ["request-late"])]

    async def run():
        engine._reading_on = asyncio.get_running_loop()
        sent = []
        for command in burst:
            engine._send_soon(command)
            sent.append(len(pipe.messages))
        await asyncio.sleep(0)  # the pass ends
        sent_at_pass_end = len(pipe.messages)
        engine._send_soon(later[0])
        sent.append(len(pipe.messages))
        await asyncio.sleep(0)
        return sent, sent_at_pass_end

    sent, sent_at_pass_end = asyncio.run(run())
    assert sent[:len(burst)] == [1 + (i - 1) // MAX_COMMANDS_PER_MESSAGE for i in range(1, len(burst) + 1)]
    assert sent_at_pass_end == 4 and sent[-1] == 5  # the next pass's first command goes at once too
    unbatched = lambda message: message[1] if message[0] == "batch" else [message]
    assert [(kind, len(unbatched((kind, payload)))) for kind, payload in pipe.messages] == [
        ("abort", 1), ("batch", MAX_COMMANDS_PER_MESSAGE), ("batch", MAX_COMMANDS_PER_MESSAGE), ("batch", 3),
        ("abort", 1)]  # fmt: skip
    assert [command for message in pipe.messages for command in unbatched(message)] == burst + later


def test_the_engine_process_reports_what_stops_it():
    """Loading fails: `wait_loaded` raises the engine process's error. The engine process dies mid-request: the
    request gets an error event (500), the client says it failed, and a function that cannot travel to the
    engine process is refused by its future."""
    import argparse

    from jax_hybrid_attn.serve.engine_loop import EngineRequest
    from jax_hybrid_attn.serve.engine_process import EngineProcess
    from jax_hybrid_attn.serve.request_streams import RequestStreams
    from tests import serve_fakes

    args = argparse.Namespace(model="/nowhere", log_level="warning")
    failing = EngineProcess(args, build=serve_fakes.build_nothing).start()
    with pytest.raises(ValueError, match="no config.json"):
        failing.wait_loaded()
    failing.stop()

    engine = EngineProcess(args, build=serve_fakes.build_stepping_engine).start()
    engine.wait_loaded()
    assert engine.max_model_len == 64 and not engine.healthy

    async def run():
        engine.start()  # read its messages on this loop
        deadline = time.monotonic() + IDLE_TIMEOUT_S
        while not engine.healthy and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert engine.healthy
        assert await asyncio.wrap_future(engine.when_idle(serve_fakes.unfinished_requests)) == 0
        with pytest.raises(Exception, match="pickle"):
            await asyncio.wrap_future(engine.when_idle(lambda e: len(e.left)))
        streams = RequestStreams(engine)
        events = streams.open([EngineRequest("long", [1, 2], SamplingParams(max_tokens=10_000))])
        first = await asyncio.wait_for(events.get(), IDLE_TIMEOUT_S)
        engine._process.kill()
        while True:
            event = await asyncio.wait_for(events.get(), IDLE_TIMEOUT_S)
            if event.error is not None:
                return first, event

    first, failed = asyncio.run(run())
    assert first.token_ids == [serve_fakes.TOKEN] and first.finish_reason is None
    assert failed.status == 500 and "exited" in failed.error
    assert not engine.healthy and "exit code" in str(engine.error)
    engine.stop()


def test_the_engine_loop_logs_each_step_function_as_it_compiles(caplog):
    """`jha serve` says what it is doing while it compiles (tens of seconds), not nothing."""
    import logging
    from types import SimpleNamespace

    from jax_hybrid_attn.serve.engine_loop import EngineLoop
    from tests.serve_fakes import SteppingEngine

    class Uncompiled(SteppingEngine):
        def __init__(self):
            super().__init__()
            self.runner = SimpleNamespace(compiled=False, shapes=("16 decode", "256"),
                                          executable_keys=lambda: ["allocate", "forward", "sample"])  # fmt: skip

        def compile(self, *, progress):
            for name in self.runner.executable_keys():
                progress(name)
            self.runner.compiled = True
            return SimpleNamespace(wall_s=1.5, warm_up_s=0.25)

    caplog.set_level(logging.INFO, logger="jax_hybrid_attn.serve.engine_loop")
    loop = EngineLoop(Uncompiled()).start()
    try:
        assert loop.ready.wait(IDLE_TIMEOUT_S)
    finally:
        loop.stop()
    messages = [record.getMessage() for record in caplog.records]
    assert messages[0].startswith("compiling 3 step functions (step shapes 16 decode, 256)")
    assert messages[1:4] == ["compiled 1/3: allocate", "compiled 2/3: forward", "compiled 3/3: sample"]
    assert "compiled in 1.8 s; serving" in messages
