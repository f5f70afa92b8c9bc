"""The slow-path LLM served by any OpenAI-compatible ``/v1/chat/completions`` server.

Users who scale out run the slow model on vLLM, SGLang, a llama.cpp server or OpenAI itself
instead of in-process (`dialogue/llm.py`). Only the standard library is used (``http.client`` +
``json``), so this backend adds no dependency, and the API is synchronous and blocking: the engine
calls it from a worker thread, never from the asyncio loop.

Continuing a committed prefix. When the fast path has already spoken the first words of a reply,
the slow model must continue that very utterance, not start a new one. ``prefix_mode`` says how
the server is asked to do that:

- ``continue_final_message`` (vLLM, SGLang): the prefix is sent as a final assistant message with
  ``{"continue_final_message": true, "add_generation_prompt": false}``, so the chat template leaves
  the assistant turn open and the model writes on from the prefix's last token.
- ``assistant_prefill`` (llama.cpp server, Anthropic-style APIs): the same final assistant message,
  without the flags; those servers continue a trailing assistant message by themselves.
- ``instruct`` (servers that cannot continue, OpenAI itself): the system prompt gets
  "Your reply must begin exactly with: <prefix>", and since such a model writes the prefix again,
  an echoed prefix is cut from the returned text.

Whatever the mode, `RemoteStream.read` never returns the prefix itself, only what follows it.

Joining text. The caller appends the returned text to the prefix verbatim; nothing is inserted or
removed at the seam. A continuation carries its own leading space (prefix ``"Hello"`` ->
``" world"``); if the prefix ends without a space and the continuation starts with a letter
(``"Hel"`` -> ``"lo there"``), the model is finishing a word and the two are joined as they are.
Pass the prefix without trailing whitespace: a trailing space is sent as it is, and most
tokenizers then continue poorly (the model's next token usually carries its own space).

One TCP (or TLS) connection is opened per response and closed when it ends, so `RemoteStream.close`
can abort a response at once (barge-in) by shutting its socket down: the server sees the client
go away and stops generating.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import ssl
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType, TracebackType
from typing import Any
from urllib.parse import urlsplit

from duplex.base.config import ConfigError
from duplex.base.errors import ModelError

PREFIX_MODES = ("continue_final_message", "assistant_prefill", "instruct")
#: request keys the client sets itself; `extra_body` may not override them (it would break the
#: protocol or silently shadow an option of the same name)
RESERVED_BODY_KEYS = frozenset(
    {
        "model",
        "messages",
        "stream",
        "max_tokens",
        "temperature",
        "continue_final_message",
        "add_generation_prompt",
    }
)
INSTRUCTION = "Your reply must begin exactly with: {prefix}"
#: longest SSE line or error body kept; a server that sends more is broken, not chatty
MAX_LINE_BYTES = 1 << 20
MAX_JSON_BYTES = 8 << 20
ERROR_BODY_CHARS = 300
USER_AGENT = "duplex-remote-llm/0.1"


@dataclass(frozen=True)
class RemoteLlmOptions:
    """Frozen options of the remote slow-path LLM (models.yaml ``options:`` of the ``llm`` component)."""

    #: the API root, e.g. http://127.0.0.1:8000/v1; ``/chat/completions`` and ``/models`` are appended
    base_url: str
    #: model name as the server knows it (llama.cpp ignores it, vLLM and OpenAI check it)
    model: str
    #: name of the environment variable holding the API key (never the key itself, so it stays out of
    #: models.yaml); None sends no Authorization header
    api_key_env: str | None = None
    prefix_mode: str = "continue_final_message"
    max_tokens: int = 64
    temperature: float = 0.0
    #: connect timeout and longest silence while reading, in seconds
    timeout_s: float = 30.0
    #: merged into every request body (e.g. top_p, chat_template_kwargs); keys in RESERVED_BODY_KEYS
    #: are refused
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    system_prompt: str = ""

    def __post_init__(self) -> None:
        """Validate here rather than only in from_mapping, so options built in code are checked too."""
        if not isinstance(self.base_url, str) or not self.base_url.strip():
            raise ConfigError("remote llm: base_url must be a URL such as http://127.0.0.1:8000/v1")
        url = self.base_url.strip().rstrip("/")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"remote llm: base_url {self.base_url!r} must be an http:// or https:// URL with a host, "
                "such as http://127.0.0.1:8000/v1"
            )
        if parts.fragment:
            raise ConfigError(f"remote llm: base_url {self.base_url!r} must not have a #fragment")
        try:
            _ = parts.port  # raises ValueError for a port out of range
        except ValueError as exc:
            raise ConfigError(f"remote llm: base_url {self.base_url!r}: {exc}") from None
        object.__setattr__(self, "base_url", url)
        if not isinstance(self.model, str) or not self.model.strip():
            raise ConfigError("remote llm: model must be the model name the server serves")
        if self.api_key_env is not None and (
            not isinstance(self.api_key_env, str)
            or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.api_key_env)
        ):
            raise ConfigError(
                f"remote llm: api_key_env {self.api_key_env!r} must be the NAME of an environment variable "
                "(e.g. OPENAI_API_KEY), not the key itself"
            )
        if self.prefix_mode not in PREFIX_MODES:
            raise ConfigError(
                f"remote llm: prefix_mode {self.prefix_mode!r} is not one of {', '.join(PREFIX_MODES)}"
            )
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ConfigError("remote llm: max_tokens must be an integer >= 1")
        if not _is_number(self.temperature) or not 0.0 <= float(self.temperature) <= 2.0:
            raise ConfigError("remote llm: temperature must be a number in [0, 2]")
        object.__setattr__(self, "temperature", float(self.temperature))
        if not _is_number(self.timeout_s) or not float(self.timeout_s) > 0:
            raise ConfigError("remote llm: timeout_s must be a number of seconds > 0")
        object.__setattr__(self, "timeout_s", float(self.timeout_s))
        if not isinstance(self.extra_body, Mapping):
            raise ConfigError("remote llm: extra_body must be a mapping of request fields")
        clash = sorted(set(self.extra_body) & RESERVED_BODY_KEYS)
        if clash:
            raise ConfigError(
                f"remote llm: extra_body may not set {clash}: the client sets them "
                "(use the max_tokens / temperature / prefix_mode options)"
            )
        try:
            json.dumps(dict(self.extra_body))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"remote llm: extra_body is not JSON-serialisable: {exc}") from None
        object.__setattr__(self, "extra_body", MappingProxyType(dict(self.extra_body)))
        if not isinstance(self.system_prompt, str):
            raise ConfigError("remote llm: system_prompt must be a string")

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any]) -> RemoteLlmOptions:
        """Validate a models.yaml options mapping; unknown or missing keys raise ConfigError."""
        known = [f.name for f in fields(cls)]
        unknown = set(raw) - set(known)
        if unknown:
            raise ConfigError(f"remote llm: unknown options {sorted(unknown)} (known: {', '.join(known)})")
        missing = [k for k in ("base_url", "model") if raw.get(k) in (None, "")]
        if missing:
            raise ConfigError(f"remote llm: missing required options {missing} (known: {', '.join(known)})")
        return cls(**dict(raw))


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


# -- server-sent events ---------------------------------------------------------------------------


@dataclass(frozen=True)
class SseEvent:
    """One dispatched server-sent event: its type (``message`` unless an ``event:`` field said otherwise)
    and its data lines joined by newlines."""

    event: str
    data: str


_EOL = re.compile(rb"\r\n|\r|\n")


class SseParser:
    """Incremental ``text/event-stream`` parser (WHATWG rules): bytes in, whole events out.

    Written by hand because the network splits the stream anywhere (inside a line, between the
    CR and LF of a CRLF, inside a UTF-8 character), servers use LF, CRLF or CR, send ``:`` comments
    as keep-alives and may split one event's JSON over several ``data:`` lines.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._data: list[str] = []
        self._event = ""
        self._first = True

    def feed(self, data: bytes, final: bool = False) -> list[SseEvent]:
        """Events completed by `data`; `final` (end of stream) also dispatches a last unterminated event.

        Raises ModelError for a line over MAX_LINE_BYTES or one that is not UTF-8.
        """
        self._buf += data
        events: list[SseEvent] = []
        pos = 0
        while True:
            m = _EOL.search(self._buf, pos)
            # a CR at the very end may be the first half of a CRLF still in flight
            if m is None or (m.group() == b"\r" and m.end() == len(self._buf) and not final):
                break
            self._line(bytes(self._buf[pos : m.start()]), events)
            pos = m.end()
        del self._buf[:pos]
        if len(self._buf) > MAX_LINE_BYTES:
            raise ModelError(f"malformed event stream: a line longer than {MAX_LINE_BYTES} bytes")
        if final:
            if self._buf:
                self._line(bytes(self._buf), events)
                self._buf.clear()
            # the spec drops an event the stream ends inside; servers that forget the last blank
            # line are more common than truncated events (which fail as malformed JSON anyway)
            self._line(b"", events)
        return events

    def _line(self, raw: bytes, events: list[SseEvent]) -> None:
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ModelError(f"malformed event stream: a line is not UTF-8 ({exc})") from None
        if self._first:
            self._first = False
            line = line.removeprefix("\ufeff")
        if not line:
            if self._data:
                events.append(SseEvent(self._event or "message", "\n".join(self._data)))
            self._data = []
            self._event = ""
            return
        if line.startswith(":"):
            return  # comment / keep-alive
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        # id, retry and unknown fields mean nothing for a one-shot completion stream


# -- the stream -----------------------------------------------------------------------------------

_END = object()


class RemoteStream:
    """One streamed chat completion, read by the caller's thread, abortable from any thread.

    A small reader thread pulls the HTTP body as it arrives and parses it into content deltas, so
    `read` can return every delta that has already arrived without blocking on the network (a
    caller that reads once per engine step must not be throttled to one token per step), and so
    `close` never races a read on the socket: it only shuts the socket down, which wakes the reader.
    """

    def __init__(
        self,
        conn: http.client.HTTPConnection,
        sock: socket.socket | None,
        resp: http.client.HTTPResponse,
        *,
        where: str,
        timeout_s: float,
        echo_prefix: str = "",
        strip_seam_space: bool = False,
    ) -> None:
        self._conn = conn
        self._sock = sock
        self._resp = resp
        self._where = where
        self._timeout_s = timeout_s
        self._cond = threading.Condition()
        self._items: deque[object] = deque()
        self._closed = False
        self._done = False
        self._released = False
        self._finish_reason: str | None = None
        # instruct mode: text held back while it could still be the model repeating the prefix
        self._echo = echo_prefix
        self._echo_buf = ""
        self._strip_seam_space = strip_seam_space
        self._thread = threading.Thread(target=self._pump, name="remote-llm-stream", daemon=True)
        self._thread.start()

    @property
    def finish_reason(self) -> str | None:
        """The server's finish_reason ("stop", "length", ...) once it has sent one, else None."""
        return self._finish_reason

    # -- caller side --

    def read(self, max_deltas: int = 1) -> tuple[str, bool]:
        """New text and whether the response is over.

        Blocks until at least one content delta has arrived (or the stream ends, fails or is
        closed), then also takes the deltas already received, up to `max_deltas` in all. After the
        end or `close()` it returns ("", True). A server error or a broken stream raises ModelError
        (text received before the failure is returned first; the next read raises).
        """
        if not _is_int(max_deltas) or max_deltas < 1:
            raise ValueError("max_deltas must be an integer >= 1")
        out: list[str] = []
        n = 0
        with self._cond:
            if self._closed or self._done:
                return "", True
            while True:
                while not self._items and n == 0 and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return "", True
                if not self._items:
                    break  # text in hand and nothing more has arrived: do not wait for it
                item = self._items[0]
                if isinstance(item, str):
                    if n >= max_deltas:
                        break
                    self._items.popleft()
                    text = self._unecho(item)
                    if text:
                        out.append(text)
                        n += 1
                elif item is _END:
                    self._items.popleft()
                    self._done = True
                    break
                else:
                    if out:
                        break  # hand over the text first; the error comes with the next read
                    self._items.popleft()
                    self._done = True
                    assert isinstance(item, ModelError)
                    raise item
            return "".join(out), self._done

    def close(self) -> None:
        """Abort the response: the socket is shut down at once, the server sees the client leave.

        Safe to call twice, after the end, and from another thread while `read` blocks (it then
        returns ("", True)). Does not wait for the reader thread, so it is cheap enough for an
        event loop.
        """
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            live = not self._released
        if live and self._sock is not None:
            try:
                # the base-class call also works on a TLS socket, without touching its SSL state,
                # which the reader thread may be using right now
                socket.socket.shutdown(self._sock, socket.SHUT_RDWR)
            except OSError:
                pass  # already gone

    def __enter__(self) -> RemoteStream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _unecho(self, piece: str) -> str:
        """Instruct mode: cut the prefix if the model repeats it, holding text back until it can tell."""
        if not self._echo:
            return piece
        self._echo_buf += piece
        probe = self._echo_buf.lstrip()
        if len(probe) < len(self._echo) and self._echo.startswith(probe):
            return ""  # so far a (possibly partial) repeat of the prefix
        held, self._echo_buf, echo = self._echo_buf, "", self._echo
        self._echo = ""
        if not probe.startswith(echo):
            return held  # the model did not repeat the prefix: everything is new text
        rest = probe[len(echo) :]
        # the caller's prefix already ends with a space: do not double it at the seam
        return rest.lstrip() if self._strip_seam_space else rest

    # -- reader thread --

    def _post(self, items: Sequence[object]) -> None:
        if items:
            with self._cond:
                self._items.extend(items)
                self._cond.notify_all()

    def _pump(self) -> None:
        try:
            ctype = (self._resp.getheader("Content-Type") or "").split(";")[0].strip().lower()
            if ctype == "application/json":
                self._pump_json()  # a server that ignored stream=true: one delta with everything
            else:
                self._pump_sse()
        except Exception as exc:  # every failure must reach the reader, never be lost
            if not self._closed:
                self._post([exc if isinstance(exc, ModelError) else self._stream_error(exc)])
        finally:
            with self._cond:
                self._released = True
            for obj in (self._resp, self._conn):
                try:
                    obj.close()
                except Exception:  # closing a broken connection may fail; nothing to do
                    pass

    def _pump_sse(self) -> None:
        parser = SseParser()
        while not self._closed:
            data = self._resp.read1(65536)
            events = parser.feed(data, final=not data)
            items: list[object] = []
            done = False
            try:
                for ev in events:
                    if self._event(ev, items):
                        done = True
                        break
            except ModelError:
                self._post(items)  # the text before a bad event still reaches the caller, then the error
                raise
            if done:
                self._post([*items, _END])  # [DONE]: do not wait for the server to close
                return
            self._post(items)
            if not data:
                break
        if self._closed:
            return
        if self._finish_reason is None:
            raise ModelError(
                f"the LLM server at {self._where} ended the stream before the reply was complete "
                "(no finish_reason, no [DONE]); it may have crashed or a proxy cut the connection"
            )
        self._post([_END])

    def _event(self, ev: SseEvent, items: list[object]) -> bool:
        """Append the content of one event to `items`; True at ``[DONE]``."""
        if ev.data.strip() == "[DONE]":
            return True
        if ev.event == "error":
            try:
                detail = _error_text(json.loads(ev.data))
            except ValueError:
                detail = _clip(ev.data)
            raise ModelError(f"the LLM server at {self._where} reported an error mid-response: {detail}")
        try:
            obj = json.loads(ev.data)
        except ValueError:
            raise ModelError(
                f"the LLM server at {self._where} sent malformed JSON in its event stream: {_clip(ev.data)!r}"
            ) from None
        if isinstance(obj, dict) and obj.get("error"):
            raise ModelError(
                f"the LLM server at {self._where} reported an error mid-response: {_error_text(obj)}"
            )
        choices = obj.get("choices") if isinstance(obj, dict) else None
        if not isinstance(choices, list):
            raise ModelError(
                f"the LLM server at {self._where} sent an event without a 'choices' list "
                f"(not a chat.completion.chunk): {_clip(ev.data)!r}"
            )
        for ch in choices:
            if not isinstance(ch, dict):
                raise ModelError(
                    f"the LLM server at {self._where} sent a malformed choice: {_clip(ev.data)!r}"
                )
            if ch.get("index", 0) != 0:
                continue
            delta = ch.get("delta")
            content = delta.get("content") if isinstance(delta, dict) else None
            if content is not None and not isinstance(content, str):
                raise ModelError(
                    f"the LLM server at {self._where} sent non-text content (content must be a string): "
                    f"{_clip(ev.data)!r}"
                )
            if content:
                items.append(content)
            if ch.get("finish_reason"):
                self._finish_reason = str(ch["finish_reason"])
        return False

    def _pump_json(self) -> None:
        body = self._resp.read(MAX_JSON_BYTES + 1)
        try:
            obj = json.loads(body)
            msg = obj["choices"][0]["message"]
            content = msg.get("content") or ""
            if not isinstance(content, str):
                raise TypeError("content is not a string")
            self._finish_reason = obj["choices"][0].get("finish_reason")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            raise ModelError(
                f"the LLM server at {self._where} answered with JSON that is not a chat completion: "
                f"{_clip(body.decode('utf-8', 'replace'))!r}"
            ) from None
        self._post([content, _END] if content else [_END])

    def _stream_error(self, exc: BaseException) -> ModelError:
        if isinstance(exc, TimeoutError):
            return ModelError(
                f"the LLM server at {self._where} sent nothing for {self._timeout_s:g} s in the middle of a "
                "reply (timeout_s); is it overloaded?"
            )
        return ModelError(
            f"the connection to the LLM server at {self._where} broke in the middle of a reply: {exc!r}"
        )


# -- the client -----------------------------------------------------------------------------------


class RemoteChatLlm:
    """Client of one OpenAI-compatible server; stateless between calls, so one instance serves every
    session and thread."""

    def __init__(self, options: RemoteLlmOptions | Mapping[str, Any]) -> None:
        self.options = (
            options if isinstance(options, RemoteLlmOptions) else RemoteLlmOptions.from_mapping(options)
        )
        parts = urlsplit(self.options.base_url)
        self._https = parts.scheme == "https"
        self._host = parts.hostname or ""
        self._port = parts.port or (443 if self._https else 80)
        self._root = parts.path.rstrip("/")
        self._query = f"?{parts.query}" if parts.query else ""
        self._api_key()  # a missing key is a start-up error, not a first-turn one

    # -- public API --

    def start(self, messages: list[dict[str, str]], prefix: str = "") -> RemoteStream:
        """Send one streamed completion for `messages` (system prompt excluded: the client adds
        ``options.system_prompt``; a leading system message replaces it, as in the in-process stage)
        continuing the already spoken `prefix` (empty: a fresh reply).

        Returns once the server has answered with its headers, so a refused request (bad model,
        context too long) raises ModelError here rather than on the first read.
        """
        body = self.request_body(messages, prefix)
        where = self.options.base_url
        conn, sock, resp = self._send("POST", "/chat/completions", body)
        if resp.status != 200:
            raise self._http_error(conn, resp, "/chat/completions", with_prefix=bool(prefix.strip()))
        ctype = (resp.getheader("Content-Type") or "").split(";")[0].strip().lower()
        if ctype not in ("", "text/event-stream", "application/json"):
            _close_quietly(resp, conn)
            raise ModelError(
                f"the server at {where} answered /chat/completions with {ctype!r}, not an event stream: "
                "is base_url the API root of an OpenAI-compatible server (it usually ends in /v1)?"
            )
        echo = prefix.strip() if self.options.prefix_mode == "instruct" else ""
        return RemoteStream(
            conn,
            sock,
            resp,
            where=where,
            timeout_s=self.options.timeout_s,
            echo_prefix=echo,
            strip_seam_space=bool(echo) and prefix != prefix.rstrip(),
        )

    def complete(self, messages: list[dict[str, str]], prefix: str = "") -> str:
        """The whole continuation at once (tests, offline tools): `start` read to the end."""
        parts: list[str] = []
        with self.start(messages, prefix) as stream:
            done = False
            while not done:
                text, done = stream.read(1 << 16)
                parts.append(text)
        return "".join(parts)

    def check(self) -> str:
        """GET {base_url}/models at start-up, so a wrong URL, key or dead server fails before the first
        call rather than during it. Returns the served model ids, comma-separated.

        It does not insist that ``options.model`` is listed: llama.cpp serves whatever name it is
        asked for and lists its file name instead; the caller may compare.
        """
        conn, _sock, resp = self._send("GET", "/models", None)
        if resp.status != 200:
            raise self._http_error(conn, resp, "/models", with_prefix=False)
        try:
            raw = resp.read(MAX_JSON_BYTES + 1)
        except TimeoutError:
            raise self._timeout_error() from None
        except (OSError, http.client.HTTPException) as exc:
            raise ModelError(f"reading {self.options.base_url}/models failed: {exc!r}") from None
        finally:
            _close_quietly(resp, conn)
        try:
            data = json.loads(raw)["data"]
            ids = [str(m["id"]) for m in data]
        except (ValueError, KeyError, TypeError):
            raise ModelError(
                f"GET {self.options.base_url}/models did not return an OpenAI model list "
                f"({_clip(raw.decode('utf-8', 'replace'))!r}); "
                "is base_url the API root (it usually ends in /v1)?"
            ) from None
        return ", ".join(ids)

    def request_body(self, messages: Sequence[Mapping[str, str]], prefix: str = "") -> dict[str, Any]:
        """The JSON body `start` sends: public so the engine (and tests) can log or inspect it."""
        opts = self.options
        msgs = [dict(m) for m in messages]
        for m in msgs:
            if m.get("role") not in ("system", "user", "assistant") or not isinstance(m.get("content"), str):
                raise ValueError(
                    f"remote llm: bad chat message {m!r}; need role system/user/assistant and str content"
                )
        system = opts.system_prompt.strip()
        if msgs and msgs[0]["role"] == "system":
            system = msgs.pop(0)["content"]
        has_prefix = bool(prefix.strip())
        if has_prefix and opts.prefix_mode == "instruct":
            instruction = INSTRUCTION.format(prefix=prefix.strip())
            system = f"{system}\n\n{instruction}" if system else instruction
        full = ([{"role": "system", "content": system}] if system else []) + msgs
        if has_prefix and opts.prefix_mode != "instruct":
            full.append({"role": "assistant", "content": prefix})
        body: dict[str, Any] = {
            "model": opts.model,
            "messages": full,
            "stream": True,
            "max_tokens": opts.max_tokens,
            "temperature": opts.temperature,
        }
        body.update(opts.extra_body)
        if has_prefix and opts.prefix_mode == "continue_final_message":
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        return body

    # -- HTTP --

    def _api_key(self) -> str | None:
        name = self.options.api_key_env
        if name is None:
            return None
        key = os.environ.get(name, "").strip()
        if not key:
            raise ModelError(
                f"remote llm: api_key_env names ${name}, which is not set (or empty): "
                f"export {name}=<your API key>, or remove api_key_env if the server needs no key"
            )
        return key

    def _send(
        self, method: str, endpoint: str, body: dict[str, Any] | None
    ) -> tuple[http.client.HTTPConnection, socket.socket | None, http.client.HTTPResponse]:
        opts = self.options
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        payload = None
        if body is not None:
            payload = json.dumps(body, ensure_ascii=False).encode("utf-8")
            headers["Content-Type"] = "application/json"
            headers["Accept"] = "text/event-stream"
        key = self._api_key()
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        conn: http.client.HTTPConnection
        if self._https:
            conn = http.client.HTTPSConnection(self._host, self._port, timeout=opts.timeout_s)
        else:
            conn = http.client.HTTPConnection(self._host, self._port, timeout=opts.timeout_s)
        where = opts.base_url
        try:
            conn.connect()
            sock = conn.sock  # kept: getresponse() may hand the socket over to the response
            conn.request(method, self._root + endpoint + self._query, body=payload, headers=headers)
            resp = conn.getresponse()
        except ConnectionRefusedError:
            conn.close()
            raise ModelError(
                f"cannot connect to the LLM server: connection refused by {self._host}:{self._port}; "
                f"is the server running at {where}?"
            ) from None
        except TimeoutError:
            conn.close()
            raise self._timeout_error() from None
        except socket.gaierror as exc:
            conn.close()
            raise ModelError(f"cannot resolve the host {self._host!r} of base_url {where}: {exc}") from None
        except ssl.SSLError as exc:
            conn.close()
            raise ModelError(f"TLS with the LLM server at {where} failed: {exc}") from None
        except http.client.HTTPException as exc:
            conn.close()
            raise ModelError(
                f"the server at {where} did not answer with valid HTTP ({exc!r}); "
                "is base_url pointing at an OpenAI-compatible server?"
            ) from None
        except OSError as exc:
            conn.close()
            raise ModelError(
                f"cannot reach the LLM server at {where}: {exc}; is the server running at {where}?"
            ) from None
        return conn, sock, resp

    def _timeout_error(self) -> ModelError:
        return ModelError(
            f"the LLM server at {self.options.base_url} did not answer within {self.options.timeout_s:g} s "
            "(timeout_s); is it overloaded or still loading the model?"
        )

    def _http_error(
        self,
        conn: http.client.HTTPConnection,
        resp: http.client.HTTPResponse,
        endpoint: str,
        with_prefix: bool,
    ) -> ModelError:
        try:
            raw = resp.read(64 << 10)
        except (OSError, http.client.HTTPException):
            raw = b""
        finally:
            _close_quietly(resp, conn)
        text = raw.decode("utf-8", "replace")
        try:
            detail = _error_text(json.loads(text))
        except ValueError:
            detail = text
        detail = _clip(" ".join(detail.split())) or "(empty body)"
        opts = self.options
        msg = f"the LLM server answered {endpoint} with HTTP {resp.status} {resp.reason}: {detail}"
        if resp.status in (401, 403):
            msg += (
                f" (check the API key in ${opts.api_key_env})"
                if opts.api_key_env
                else " (the server wants an API key: set api_key_env to the name of the variable holding it)"
            )
        elif resp.status == 404:
            msg += (
                f" (check base_url {opts.base_url}: it usually ends in /v1;"
                f" and that the server serves {opts.model!r})"
            )
        elif resp.status == 429:
            msg += " (the server is rate-limiting or out of capacity)"
        elif resp.status >= 500:
            msg += " (the server failed; its log says why)"
        elif with_prefix and opts.prefix_mode == "continue_final_message" and resp.status in (400, 422):
            msg += (
                " (prefix_mode continue_final_message: if this server does not support it, "
                "use assistant_prefill or instruct)"
            )
        return ModelError(msg)


def _error_text(obj: object) -> str:
    """The human part of an error body: OpenAI {"error": {"message"}}, {"error": str}, {"message"},
    FastAPI {"detail"}; else the JSON itself."""
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return err["message"]
        if isinstance(err, str):
            return err
        for key in ("message", "detail"):
            val = obj.get(key)
            if isinstance(val, str):
                return val
            if val is not None:
                return _clip(json.dumps(val))
    return _clip(json.dumps(obj))


def _clip(text: str, n: int = ERROR_BODY_CHARS) -> str:
    return text if len(text) <= n else text[: n - 1] + "…"


def _close_quietly(resp: http.client.HTTPResponse, conn: http.client.HTTPConnection) -> None:
    for obj in (resp, conn):
        try:
            obj.close()
        except Exception:  # a broken connection may fail to close; nothing to do
            pass
