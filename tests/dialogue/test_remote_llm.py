"""Remote slow-path LLM (dialogue/remote_llm.py) against a fake OpenAI-compatible server on 127.0.0.1.

The fake records every request and streams SSE the way vLLM / OpenAI do (HTTP/1.1, chunked,
one event per chunk, paced by a delay); the `openai` SDK test at the end proves it speaks the real
protocol, so the other tests exercise the client against something a real server would send.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from dialogue.remote_llm import (
    RESERVED_BODY_KEYS,
    RemoteChatLlm,
    RemoteLlmOptions,
    SseEvent,
    SseParser,
)
from duplex.base.config import ConfigError
from duplex.base.errors import ModelError

MODEL = "fake-model"
USER = [{"role": "user", "content": "What is the capital of France?"}]


def chunk(content: str | None = None, *, role: str | None = None, finish: str | None = None) -> bytes:
    """One `chat.completion.chunk` event, byte for byte as OpenAI / vLLM format it."""
    delta: dict[str, Any] = {}
    if role is not None:
        delta["role"] = role
    if content is not None:
        delta["content"] = content
    obj = {
        "id": "chatcmpl-fake",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": MODEL,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


DONE = b"data: [DONE]\n\n"


def sse(*texts: str, finish: str = "stop") -> list[bytes]:
    """A whole reply: role chunk, one chunk per text, the finish chunk, [DONE]."""
    return [chunk("", role="assistant"), *(chunk(t) for t in texts), chunk(finish=finish), DONE]


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any] | None


@dataclass
class Script:
    """What the fake answers to the next chat completion."""

    events: list[bytes] = field(default_factory=lambda: sse("Paris", " is", " the", " capital."))
    delay: float = 0.0  # between HTTP chunks
    header_delay: float = 0.0  # before the status line
    hold: float = 0.0  # after the events, keep the connection open this long (or until the client leaves)
    end: bool = True  # send the terminating zero-length chunk
    status: int = 200
    error_body: bytes = b""
    content_type: str = "text/event-stream"
    as_json: str | None = None  # answer with a non-streamed completion of this text


class FakeOpenAI:
    """An OpenAI-compatible HTTP server in a thread that records requests and replays a Script."""

    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self.script = Script()
        self.client_gone = threading.Event()
        self.stop = threading.Event()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.fake = self  # type: ignore[attr-defined]
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True, name="fake-openai"
        )
        self.thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def close(self) -> None:
        self.stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # chunked streaming, like uvicorn under vLLM / SGLang

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass

    @property
    def fake(self) -> FakeOpenAI:
        return self.server.fake  # type: ignore[attr-defined]

    def _record(self) -> dict[str, Any] | None:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        body = json.loads(raw) if raw else None
        self.fake.requests.append(
            Recorded(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body)
        )
        return body

    def _send_json(self, status: int, obj: Any, content_type: str = "application/json") -> None:
        raw = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        self._record()
        if self.path.split("?")[0] != "/v1/models":
            self._send_json(404, {"detail": "Not Found"})
            return
        model = {"id": MODEL, "object": "model", "created": 0, "owned_by": "test"}
        self._send_json(200, {"object": "list", "data": [model]})

    def do_POST(self) -> None:
        body = self._record()
        s = self.fake.script
        if self.path.split("?")[0] != "/v1/chat/completions":
            self._send_json(404, {"detail": "Not Found"})
            return
        if s.header_delay and self.fake.stop.wait(s.header_delay):
            return
        if s.status != 200:
            self._send_json(s.status, s.error_body, s.content_type)
            return
        if s.as_json is not None or not (body or {}).get("stream"):
            text = s.as_json if s.as_json is not None else "Paris is the capital."
            self._send_json(
                200,
                {
                    "id": "chatcmpl-fake",
                    "object": "chat.completion",
                    "created": 1700000000,
                    "model": MODEL,
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "logprobs": None,
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                },
            )
            return
        self.send_response(200)
        self.send_header("Content-Type", s.content_type)
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            for i, ev in enumerate(s.events):
                if i and s.delay and self._wait_gone(s.delay):
                    return
                self.wfile.write(f"{len(ev):x}\r\n".encode() + ev + b"\r\n")
            if s.hold and self._wait_gone(s.hold):
                return
            if s.end:
                self.wfile.write(b"0\r\n\r\n")
        except OSError:  # BrokenPipe / ConnectionReset: the client went away mid-write
            self.fake.client_gone.set()
        self.close_connection = True

    def _wait_gone(self, seconds: float) -> bool:
        """Wait `seconds`; True (and client_gone set) if the client hung up meanwhile."""
        deadline = time.monotonic() + seconds
        while not self.fake.stop.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([self.connection], [], [], min(left, 0.05))
            if ready:
                try:
                    gone = self.connection.recv(1, socket.MSG_PEEK) == b""
                except OSError:
                    gone = True
                if gone:
                    self.fake.client_gone.set()
                    return True
        return True


@pytest.fixture
def fake() -> Iterator[FakeOpenAI]:
    server = FakeOpenAI()
    yield server
    server.close()


def client(fake: FakeOpenAI, **options: Any) -> RemoteChatLlm:
    return RemoteChatLlm({"base_url": fake.base_url, "model": MODEL, **options})


def read_all(stream: Any, max_deltas: int = 1) -> list[str]:
    parts: list[str] = []
    done = False
    while not done:
        text, done = stream.read(max_deltas)
        parts.append(text)
    return parts


# -- request payloads ---------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["continue_final_message", "assistant_prefill", "instruct"])
def test_request_payload_per_prefix_mode(
    fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    monkeypatch.setenv("DUPLEX_TEST_LLM_KEY", "sk-test-123")
    llm = client(
        fake,
        prefix_mode=mode,
        api_key_env="DUPLEX_TEST_LLM_KEY",
        max_tokens=17,
        temperature=0.2,
        system_prompt="Be brief.",
        extra_body={"top_p": 0.9},
    )
    assert llm.complete(USER, prefix="The capital") == "Paris is the capital."
    (req,) = fake.requests
    assert req.method == "POST" and req.path == "/v1/chat/completions"
    assert req.headers["authorization"] == "Bearer sk-test-123"
    assert req.headers["content-type"] == "application/json"
    body = req.body
    assert body is not None
    assert body["model"] == MODEL and body["stream"] is True
    assert body["max_tokens"] == 17 and body["temperature"] == 0.2 and body["top_p"] == 0.9
    if mode == "instruct":
        assert body["messages"] == [
            {"role": "system", "content": "Be brief.\n\nYour reply must begin exactly with: The capital"},
            *USER,
        ]
    else:
        assert body["messages"] == [
            {"role": "system", "content": "Be brief."},
            *USER,
            {"role": "assistant", "content": "The capital"},
        ]
    if mode == "continue_final_message":
        assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    else:
        assert "continue_final_message" not in body and "add_generation_prompt" not in body


@pytest.mark.parametrize("mode", ["continue_final_message", "assistant_prefill", "instruct"])
def test_no_prefix_is_a_plain_chat_request(fake: FakeOpenAI, mode: str) -> None:
    llm = client(fake, prefix_mode=mode)
    llm.complete(USER)
    body = fake.requests[0].body
    assert body is not None
    assert body["messages"] == USER  # no system prompt configured, no prefix: nothing added
    assert "continue_final_message" not in body
    assert "authorization" not in fake.requests[0].headers


def test_instruct_without_system_prompt_and_leading_system_message(fake: FakeOpenAI) -> None:
    rule = "Your reply must begin exactly with: Sure"
    llm = client(fake, prefix_mode="instruct", system_prompt="Prompt.")
    body = llm.request_body(USER, "Sure")
    assert body["messages"] == [{"role": "system", "content": f"Prompt.\n\n{rule}"}, *USER]
    # a leading system message replaces options.system_prompt, as in the in-process stage
    body = llm.request_body([{"role": "system", "content": "Own."}, *USER], "Sure")
    assert body["messages"] == [{"role": "system", "content": f"Own.\n\n{rule}"}, *USER]
    body = client(fake, prefix_mode="instruct").request_body(USER, "Sure")
    assert body["messages"][0] == {"role": "system", "content": rule}
    with pytest.raises(ValueError, match="bad chat message"):
        llm.request_body([{"role": "tool", "content": "x"}])


# -- streaming ----------------------------------------------------------------------------------


def test_deltas_in_order_and_read_returns_at_most_n(fake: FakeOpenAI) -> None:
    pieces = [chr(ord("a") + i) for i in range(12)]
    fake.script = Script(events=sse(*pieces), delay=0.01)
    with client(fake).start(USER) as stream:
        parts = read_all(stream, max_deltas=3)
        assert stream.finish_reason == "stop"
    assert "".join(parts) == "".join(pieces)
    assert all(len(p) <= 3 for p in parts)
    assert all(parts[:-1]), "read blocks until a delta arrives: only the last read may be empty"


def test_read_takes_what_has_arrived_without_waiting_for_more(fake: FakeOpenAI) -> None:
    # five deltas in one write, then a long pause before the end
    burst = b"".join([chunk("", role="assistant"), *(chunk(c) for c in "abcde")])
    fake.script = Script(events=[burst, chunk(finish="stop") + DONE], delay=0.6)
    stream = client(fake).start(USER)
    t0 = time.monotonic()
    assert stream.read(2) == ("ab", False)  # at most n deltas, even when more are there
    assert stream.read(10) == ("cde", False)  # everything already received, without waiting for more
    assert time.monotonic() - t0 < 0.4
    assert stream.read(10) == ("", True)  # blocks for the end: nothing more came
    stream.close()


def test_done_ends_the_stream_even_if_the_server_keeps_the_connection(fake: FakeOpenAI) -> None:
    fake.script = Script(events=sse("Hi", "!"), hold=5.0, end=False)
    t0 = time.monotonic()
    assert client(fake).complete(USER) == "Hi!"
    assert time.monotonic() - t0 < 2.0
    assert fake.client_gone.wait(2.0), "after [DONE] the client closes its connection"


def test_close_mid_stream_releases_the_connection(fake: FakeOpenAI) -> None:
    fake.script = Script(events=sse(*(f" w{i}" for i in range(200))), delay=0.02)
    stream = client(fake).start(USER)
    text, done = stream.read(1)
    assert text and not done
    stream.close()
    assert fake.client_gone.wait(2.0), "the server must see the client go away"
    deadline = time.monotonic() + 2.0  # and the reader thread ends: nothing is left behind
    while any(t.name == "remote-llm-stream" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not any(t.name == "remote-llm-stream" for t in threading.enumerate())
    assert stream.read(5) == ("", True)
    stream.close()  # twice is fine
    assert stream.read(1) == ("", True)


def test_close_from_another_thread_wakes_a_blocked_read(fake: FakeOpenAI) -> None:
    fake.script = Script(events=[chunk("", role="assistant"), chunk("late"), *sse()], delay=5.0)
    stream = client(fake).start(USER)
    got: list[tuple[str, bool]] = []
    reader = threading.Thread(target=lambda: got.append(stream.read(4)))
    reader.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    stream.close()
    reader.join(2.0)
    assert got == [("", True)] and time.monotonic() - t0 < 1.0
    assert fake.client_gone.wait(2.0)


def test_instruct_strips_an_echoed_prefix(fake: FakeOpenAI) -> None:
    llm = client(fake, prefix_mode="instruct")
    # the echo arrives split over several deltas, one of them straddling the seam
    fake.script = Script(events=sse("The", " capi", "tal of France", " is Paris."))
    assert llm.complete(USER, prefix="The capital") == " of France is Paris."
    fake.script = Script(events=sse("of France is Paris."))  # a model that obeyed without echoing
    assert llm.complete(USER, prefix="The capital") == "of France is Paris."
    fake.script = Script(events=sse("The capital"))  # only the echo: nothing new to say
    assert llm.complete(USER, prefix="The capital") == ""
    # the caller's prefix already ends with a space: the seam is not doubled
    fake.script = Script(events=sse(" The capital is", " Paris."))
    assert llm.complete(USER, prefix="The capital ") == "is Paris."
    # continue modes never strip: the server continues, it does not repeat
    fake.script = Script(events=sse("The capital", " again"))
    assert client(fake).complete(USER, prefix="The capital") == "The capital again"


def test_sse_variants_over_the_wire(fake: FakeOpenAI) -> None:
    """CRLF line ends, comments, a multi-line event, `data:` without a space, an event per write."""
    role = chunk("", role="assistant").replace(b"\n", b"\r\n")
    multi = b'data: {"choices": [{"index": 0,\ndata: "delta": {"content": "Par"}}]}\n\n'
    cr_only = b'data:{"choices":[{"delta":{"content":"is"}}]}\r\r'
    events = [b": keep-alive\n\n", role, multi, cr_only, b": ping\r\n\r\n", chunk(finish="stop"), DONE]
    fake.script = Script(events=events)
    assert client(fake).complete(USER) == "Paris"


def test_server_that_ignores_stream_true_still_works(fake: FakeOpenAI) -> None:
    fake.script = Script(as_json="Paris.")
    assert client(fake).complete(USER) == "Paris."


# -- SSE parser ---------------------------------------------------------------------------------


SSE_STREAM = (
    b"\xef\xbb\xbf: comment\r\n"
    b"data: one\r\n\r\n"
    b"event: error\ndata:two\ndata:  three\n\n"
    b"id: 7\rretry: 100\rdata: caf\xc3\xa9\r\r"
    b"data\n\n"  # a field with no colon: empty data line
    b"data: unterminated"
)
SSE_EVENTS = [
    SseEvent("message", "one"),
    SseEvent("error", "two\n three"),
    SseEvent("message", "café"),
    SseEvent("message", ""),
    SseEvent("message", "unterminated"),
]


def test_sse_parser_whole_and_byte_by_byte() -> None:
    assert SseParser().feed(SSE_STREAM, final=True) == SSE_EVENTS
    parser = SseParser()
    events: list[SseEvent] = []
    for i in range(len(SSE_STREAM)):  # splits inside CRLF and inside the UTF-8 é
        events += parser.feed(SSE_STREAM[i : i + 1])
    events += parser.feed(b"", final=True)
    assert events == SSE_EVENTS


def test_sse_parser_rejects_garbage() -> None:
    with pytest.raises(ModelError, match="not UTF-8"):
        SseParser().feed(b"data: \xff\xfe\n\n")


# -- errors -------------------------------------------------------------------------------------


def test_connection_refused_says_is_the_server_running() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    llm = RemoteChatLlm({"base_url": f"http://127.0.0.1:{port}/v1", "model": MODEL})
    expected = rf"connection refused.*is the server running at http://127.0.0.1:{port}/v1\?"
    with pytest.raises(ModelError, match=expected):
        llm.start(USER)
    with pytest.raises(ModelError, match="is the server running"):
        llm.check()


def test_http_4xx_carries_status_and_server_message(fake: FakeOpenAI) -> None:
    msg = "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens."
    fake.script = Script(
        status=400,
        error_body=json.dumps(
            {"object": "error", "message": msg, "type": "BadRequestError", "param": None, "code": 400}
        ).encode(),
    )
    with pytest.raises(ModelError, match=r"HTTP 400 Bad Request: This model's maximum context length") as e:
        client(fake).start(USER, prefix="Well")
    assert "assistant_prefill or instruct" in str(e.value)  # continue_final_message hint on a refused prefix
    fake.script = Script(status=401, error_body=b'{"error": {"message": "Incorrect API key provided"}}')
    with pytest.raises(ModelError, match=r"HTTP 401 .*Incorrect API key provided.*api_key_env"):
        client(fake).start(USER)


def test_http_5xx_body_is_truncated(fake: FakeOpenAI) -> None:
    html = b"<html><body>" + b"Internal Server Error " * 500 + b"</body></html>"
    fake.script = Script(status=502, error_body=html, content_type="text/html")
    with pytest.raises(ModelError, match=r"HTTP 502 Bad Gateway: <html>") as e:
        client(fake).complete(USER)
    assert len(str(e.value)) < 500 and "…" in str(e.value) and "its log" in str(e.value)


def test_404_hints_at_base_url(fake: FakeOpenAI) -> None:
    llm = RemoteChatLlm({"base_url": fake.base_url.removesuffix("/v1"), "model": MODEL})
    with pytest.raises(ModelError, match=r"HTTP 404 .*Not Found.*usually ends in /v1"):
        llm.start(USER)
    with pytest.raises(ModelError, match=r"HTTP 404"):
        llm.check()


def test_timeout_before_headers(fake: FakeOpenAI) -> None:
    fake.script = Script(header_delay=3.0)
    t0 = time.monotonic()
    with pytest.raises(ModelError, match=r"did not answer within 0.3 s \(timeout_s\)"):
        client(fake, timeout_s=0.3).start(USER)
    assert time.monotonic() - t0 < 2.0


def test_timeout_mid_stream(fake: FakeOpenAI) -> None:
    fake.script = Script(events=[chunk("", role="assistant"), chunk("Par"), *sse("is")], delay=3.0)
    stream = client(fake, timeout_s=0.3).start(USER)
    with pytest.raises(ModelError, match=r"sent nothing for 0.3 s in the middle of a reply"):
        read_all(stream)
    assert stream.read(1) == ("", True)


def test_malformed_json_in_the_stream(fake: FakeOpenAI) -> None:
    fake.script = Script(events=[chunk("Par"), b"data: {not json\n\n", DONE])
    stream = client(fake).start(USER)
    assert stream.read(1) == ("Par", False)  # text before the failure is still delivered
    with pytest.raises(ModelError, match="malformed JSON in its event stream"):
        stream.read(1)
    fake.script = Script(events=[chunk("", role="assistant") + chunk("Par") + b"data: {oops\n\n", DONE])
    stream = client(fake).start(USER)  # the bad event arrives in the same packet as good ones
    assert stream.read(5) == ("Par", False)
    with pytest.raises(ModelError, match="malformed JSON"):
        stream.read(5)
    fake.script = Script(events=[b'data: {"object": "something else"}\n\n', DONE])
    with pytest.raises(ModelError, match="without a 'choices' list"):
        client(fake).complete(USER)


def test_error_event_mid_stream(fake: FakeOpenAI) -> None:
    err = {"error": {"message": "CUDA out of memory", "type": "InternalServerError", "code": 500}}
    fake.script = Script(events=[chunk("Par"), b"data: " + json.dumps(err).encode() + b"\n\n", DONE])
    with pytest.raises(ModelError, match="reported an error mid-response: CUDA out of memory"):
        client(fake).complete(USER)
    fake.script = Script(events=[chunk("Par"), b"event: error\ndata: overloaded, try later\n\n", DONE])
    with pytest.raises(ModelError, match="reported an error mid-response: overloaded, try later"):
        client(fake).complete(USER)


def test_stream_cut_before_the_end(fake: FakeOpenAI) -> None:
    fake.script = Script(events=[chunk("", role="assistant"), chunk("Par")])
    with pytest.raises(ModelError, match="ended the stream before the reply was complete"):
        client(fake).complete(USER)


def test_wrong_content_type(fake: FakeOpenAI) -> None:
    fake.script = Script(content_type="text/html")
    with pytest.raises(ModelError, match="not an event stream"):
        client(fake).start(USER)


def test_missing_api_key_env(fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DUPLEX_TEST_NO_SUCH_KEY", raising=False)
    expected = r"\$DUPLEX_TEST_NO_SUCH_KEY, which is not set.*export DUPLEX_TEST_NO_SUCH_KEY="
    with pytest.raises(ModelError, match=expected):
        client(fake, api_key_env="DUPLEX_TEST_NO_SUCH_KEY")
    assert fake.requests == []


def test_check_lists_models(fake: FakeOpenAI, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DUPLEX_TEST_LLM_KEY", "sk-x")
    assert client(fake, api_key_env="DUPLEX_TEST_LLM_KEY").check() == MODEL
    assert fake.requests[0].path == "/v1/models"
    assert fake.requests[0].headers["authorization"] == "Bearer sk-x"


# -- options ------------------------------------------------------------------------------------


def test_options_defaults_and_normalisation() -> None:
    opts = RemoteLlmOptions.from_mapping({"base_url": "http://127.0.0.1:8000/v1/", "model": "m"})
    assert opts.base_url == "http://127.0.0.1:8000/v1"
    assert (opts.prefix_mode, opts.max_tokens, opts.temperature, opts.timeout_s) == (
        "continue_final_message",
        64,
        0.0,
        30.0,
    )
    assert opts.api_key_env is None and dict(opts.extra_body) == {} and opts.system_prompt == ""


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (
            {"base_url": "http://h/v1", "model": "m", "max_token": 5},
            r"unknown options \['max_token'\].*known: base_url, model, api_key_env, prefix_mode",
        ),
        ({"model": "m"}, r"missing required options \['base_url'\]"),
        ({"base_url": "http://h/v1"}, r"missing required options \['model'\]"),
        ({"base_url": "127.0.0.1:8000", "model": "m"}, "must be an http:// or https:// URL"),
        ({"base_url": "http://h/v1", "model": "m", "prefix_mode": "x"}, "not one of continue_final_message"),
        ({"base_url": "http://h/v1", "model": "m", "max_tokens": 0}, "max_tokens must be an integer >= 1"),
        ({"base_url": "http://h/v1", "model": "m", "temperature": "hot"}, "temperature must be a number"),
        ({"base_url": "http://h/v1", "model": "m", "timeout_s": 0}, "timeout_s must be"),
        ({"base_url": "http://h/v1", "model": "m", "extra_body": ["x"]}, "extra_body must be a mapping"),
        ({"base_url": "http://h/v1", "model": "m", "extra_body": {"stream": 0}}, r"may not set \['stream'\]"),
        ({"base_url": "http://h/v1", "model": "m", "api_key_env": "sk-abc1"}, "NAME of an environment"),
    ],
)
def test_options_validation(raw: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        RemoteLlmOptions.from_mapping(raw)


def test_reserved_keys_cover_what_the_client_sets(fake: FakeOpenAI) -> None:
    body = client(fake).request_body(USER, "Hi")
    assert set(body) <= RESERVED_BODY_KEYS


# -- the real protocol --------------------------------------------------------------------------


def test_official_openai_client_talks_to_the_fake(fake: FakeOpenAI) -> None:
    """The `openai` SDK streams from the fake, lists its models and parses its errors, and sends the
    same request our client sends: the fake speaks the real protocol, so the tests above mean something."""
    openai = pytest.importorskip("openai")
    # trust_env=False: a proxy configured in the environment must not see 127.0.0.1 traffic
    http_client = openai.DefaultHttpxClient(trust_env=False)
    with openai.OpenAI(
        base_url=fake.base_url, api_key="sk-sdk", max_retries=0, timeout=10.0, http_client=http_client
    ) as sdk:
        prefix_flags = {"continue_final_message": True, "add_generation_prompt": False}
        messages = [*USER, {"role": "assistant", "content": "Well"}]
        stream = sdk.chat.completions.create(
            model=MODEL,
            messages=messages,
            stream=True,
            max_tokens=64,
            temperature=0.0,
            extra_body=prefix_flags,
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == "Paris is the capital."
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert [m.id for m in sdk.models.list()] == [MODEL]

        client(fake).start(USER, prefix="Well").close()
        sdk_req, ours = fake.requests[0], fake.requests[-1]
        assert ours.body == sdk_req.body  # the very JSON request the SDK makes
        assert ours.path == sdk_req.path

        err = {"error": {"message": "bad prefix", "type": "invalid_request_error"}}
        fake.script = Script(status=400, error_body=json.dumps(err).encode())
        with pytest.raises(openai.BadRequestError, match="bad prefix"):
            sdk.chat.completions.create(model=MODEL, messages=USER, stream=True)
