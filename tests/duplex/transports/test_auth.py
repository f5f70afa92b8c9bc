"""Authentication: API keys on every WebSocket transport, single-use client secrets, the Origin rule,
and the refusal to serve a public address without a key. Real sockets, tiny tone stages."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
import uuid
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from duplex.base.config import load_profile
from duplex.runtime.service import DuplexService, ServiceLimits
from duplex.testing.fakes import fake_stages, scripted_answer
from duplex.transports.auth import (
    Authenticator,
    AuthError,
    ClientSecrets,
    bearer_token,
    choose_subprotocol,
    is_loopback,
    origin_allowed,
    secret_from_subprotocols,
)
from duplex.transports.gateway import GatewaySettings, exposure_problem
from duplex.transports.native import DuplexServer, ServerSettings
from duplex.transports.realtime import mount_realtime
from duplex.transports.twilio import mount_twilio

KEY = "sk-test-key-1"
OTHER_KEY = "sk-test-key-2"


@pytest.fixture
async def server():
    service = DuplexService(
        load_profile("cpu"), fake_stages(scripted_answer), limits=ServiceLimits(max_sessions=4)
    )
    srv = DuplexServer(service, ServerSettings(host="127.0.0.1", port=0, api_keys=(KEY, OTHER_KEY)))
    mount_twilio(srv)
    mount_realtime(srv)
    await srv.start()
    yield srv
    await srv.close()
    service.close()


def ws_url(srv: DuplexServer, path: str = "/v1/duplex") -> str:
    return f"ws://127.0.0.1:{srv.port}{path}"


def http(srv: DuplexServer, path: str, method: str = "GET", headers: dict[str, str] | None = None):
    req = urllib.request.Request(f"http://127.0.0.1:{srv.port}{path}", method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


async def status_of(url: str, **kwargs: Any) -> int:
    """The HTTP status of a refused upgrade (101 if it was accepted)."""
    try:
        async with connect(url, **kwargs):
            return 101
    except InvalidStatus as exc:
        return exc.response.status_code


async def started(url: str, **kwargs: Any) -> dict[str, Any]:
    async with connect(url, **kwargs) as ws:
        await ws.send(json.dumps({"type": "session.start"}))
        return json.loads(await ws.recv())


async def new_secret(srv: DuplexServer, key: str = KEY, query: str = "") -> dict[str, Any]:
    status, body = await asyncio.to_thread(
        http, srv, "/v1/realtime/client_secrets" + query, "POST", {"Authorization": f"Bearer {key}"}
    )
    assert status == 200, body
    return json.loads(body)


# -- sans-I/O rules -------------------------------------------------------------------------


def test_rules_without_sockets() -> None:
    assert bearer_token("Bearer abc") == "abc" and bearer_token("bearer  abc ") == "abc"
    assert (
        bearer_token("Basic abc") is None and bearer_token("Bearer ") is None and bearer_token(None) is None
    )
    assert secret_from_subprotocols(["realtime", "openai-insecure-api-key.ek_x"]) == "ek_x"
    assert secret_from_subprotocols(["duplex-secret.ek_y"]) == "ek_y"
    assert secret_from_subprotocols(["realtime", "openai-insecure-api-key."]) is None
    assert choose_subprotocol(["openai-insecure-api-key.ek_x", "realtime"]) == "realtime"
    assert choose_subprotocol(["duplex-secret.ek_y"]) == "duplex-secret.ek_y"
    assert choose_subprotocol([]) is None
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.5") and not is_loopback("example.com")
    # Origin: none (not a browser), the page's own host (any scheme: TLS ends at the proxy), the list
    assert origin_allowed(None, "a.example:8765", None)
    assert origin_allowed("https://a.example:8765", "a.example:8765", None)
    assert not origin_allowed("https://evil.example", "a.example:8765", None)
    assert origin_allowed("https://app.example", "a.example", ("https://app.example",))
    assert origin_allowed("https://any.example", "a.example", ("*",))
    assert not origin_allowed("null", "a.example", None)


def test_client_secrets_are_single_use_and_expire() -> None:
    now = [1000.0]
    store = ClientSecrets(clock=lambda: now[0], limit=3)
    a = store.issue(60)
    assert a.value.startswith("ek_") and a.expires_at == 1060.0
    assert store.redeem(a.value) and not store.redeem(a.value)  # once
    b = store.issue(60)
    now[0] += 61
    assert not store.redeem(b.value)  # expired
    assert not store.redeem("ek_made_up")
    for _ in range(5):  # bounded: the oldest unused ones are forgotten
        store.issue(60)
    assert len(store) == 3


def test_authenticator_refusals_have_codes() -> None:
    auth = Authenticator([KEY])
    auth.check_session(f"Bearer {KEY}", None)
    cases = [
        ((None, None), "missing_api_key"),
        (("Bearer nope", None), "invalid_api_key"),
        ((None, "realtime"), "missing_api_key"),
        ((None, "openai-insecure-api-key.ek_unknown"), "invalid_client_secret"),
    ]
    for args, code in cases:
        with pytest.raises(AuthError) as err:
            auth.check_session(*args)
        assert err.value.code == code and err.value.status == 401
    Authenticator([]).check_session(None, None)  # no key: no auth (loopback default)


def test_public_bind_needs_a_key_or_insecure() -> None:
    public = GatewaySettings(http=ServerSettings(host="0.0.0.0"))
    problem = exposure_problem(public)
    assert problem is not None and "--api-key" in problem and "--insecure" in problem
    assert exposure_problem(public, insecure=True) is None
    assert exposure_problem(GatewaySettings(http=ServerSettings(host="0.0.0.0", api_keys=(KEY,)))) is None
    assert exposure_problem(GatewaySettings(http=ServerSettings(host="127.0.0.1"))) is None
    open_as = GatewaySettings(http=ServerSettings(api_keys=(KEY,)), audiosocket=("0.0.0.0", 9092))
    assert "--audiosocket-uuid" in (exposure_problem(open_as) or "")
    listed = GatewaySettings(
        http=ServerSettings(api_keys=(KEY,)), audiosocket=("0.0.0.0", 9092), audiosocket_uuids=[uuid.uuid4()]
    )
    assert exposure_problem(listed) is None
    local = GatewaySettings(http=ServerSettings(api_keys=(KEY,)), audiosocket=("127.0.0.1", 9092))
    assert "--audiosocket-uuid" in (exposure_problem(local) or "")  # keys set: every endpoint authenticates
    assert exposure_problem(local, insecure=True) is None
    assert exposure_problem(GatewaySettings(audiosocket=("127.0.0.1", 9092))) is None  # loopback, no keys


def test_serve_refuses_public_host_without_key(capsys, monkeypatch) -> None:
    from duplex.cli import (
        _serve,
        build_parser,
    )  # not main(): it would install log handlers on capsys's stream

    monkeypatch.delenv("DUPLEX_API_KEY", raising=False)
    assert _serve(build_parser().parse_args(["serve", "--host", "0.0.0.0", "--tones", "--port", "0"])) == 2
    err = capsys.readouterr().err
    assert "refusing to start" in err and "no API key" in err


# -- over sockets ----------------------------------------------------------------------------


async def test_native_needs_a_key(server) -> None:
    url = ws_url(server)
    assert await status_of(url) == 401
    assert await status_of(url, additional_headers={"Authorization": "Bearer wrong"}) == 401
    assert await status_of(url, additional_headers={"Authorization": f"Basic {KEY}"}) == 401
    for key in (KEY, OTHER_KEY):  # several keys
        ev = await started(url, additional_headers={"Authorization": f"Bearer {key}"})
        assert ev["type"] == "session.started"
    _, body = await asyncio.to_thread(http, server, "/healthz")
    assert json.loads(body)["auth"] is True


async def test_realtime_needs_a_key_with_the_openai_client(server) -> None:
    assert await status_of(ws_url(server, "/v1/realtime?model=x")) == 401
    base = f"ws://127.0.0.1:{server.port}/v1"
    client = AsyncOpenAI(api_key=KEY, websocket_base_url=base)
    async with client.realtime.connect(model="gpt-realtime") as conn:
        first = await asyncio.wait_for(conn.recv(), 5)
        assert first.type == "session.created"
    wrong = AsyncOpenAI(api_key="sk-wrong", websocket_base_url=base)
    with pytest.raises((InvalidStatus, openai.OpenAIError)) as err:
        async with wrong.realtime.connect(model="gpt-realtime") as conn:
            await asyncio.wait_for(conn.recv(), 5)
    assert "401" in str(err.value)


async def test_twilio_is_refused_when_keys_are_set_without_a_twilio_token(server) -> None:
    assert await status_of(ws_url(server, "/v1/twilio")) == 403
    assert (
        await status_of(ws_url(server, "/v1/twilio"), additional_headers={"Authorization": f"Bearer {KEY}"})
        == 403
    )


async def test_client_secret_works_once_for_its_lifetime(server) -> None:
    status, body = await asyncio.to_thread(http, server, "/v1/realtime/client_secrets", "POST")
    assert status == 401 and json.loads(body)["error"]["code"] == "missing_api_key"
    status, _ = await asyncio.to_thread(
        http, server, "/v1/realtime/client_secrets", "POST", {"Authorization": "Bearer wrong"}
    )
    assert status == 401
    status, _ = await asyncio.to_thread(http, server, "/v1/realtime/client_secrets")
    assert status == 405
    secret = await new_secret(server)
    assert secret["value"].startswith("ek_") and time.time() < secret["expires_at"] <= time.time() + 61
    # a browser: the secret as a subprotocol; the server answers with the plain one it offered
    protos = ["realtime", f"openai-insecure-api-key.{secret['value']}"]
    async with connect(ws_url(server, "/v1/realtime?model=x"), subprotocols=protos) as ws:
        assert ws.subprotocol == "realtime"
        assert json.loads(await ws.recv())["type"] == "session.created"
    assert await status_of(ws_url(server, "/v1/realtime?model=x"), subprotocols=protos) == 401  # used
    # the native endpoint takes one too (duplex-secret.), also as a Bearer token
    other = await new_secret(server, OTHER_KEY)
    ev = await started(ws_url(server), subprotocols=[f"duplex-secret.{other['value']}"])
    assert ev["type"] == "session.started"
    third = await new_secret(server, query="?expires_after=30")
    assert third["expires_at"] <= time.time() + 31
    ev = await started(ws_url(server), additional_headers={"Authorization": f"Bearer {third['value']}"})
    assert ev["type"] == "session.started"
    # expired: the same server an hour later
    late = await new_secret(server)
    server.auth.secrets._clock = lambda: time.time() + 3600
    assert await status_of(ws_url(server), subprotocols=[f"duplex-secret.{late['value']}"]) == 401


async def test_the_openai_client_can_use_a_client_secret_once(server) -> None:
    secret = (await new_secret(server))["value"]
    base = f"ws://127.0.0.1:{server.port}/v1"
    async with AsyncOpenAI(api_key=secret, websocket_base_url=base).realtime.connect(model="m") as conn:
        assert (await asyncio.wait_for(conn.recv(), 5)).type == "session.created"
    with pytest.raises((InvalidStatus, openai.OpenAIError)) as err:
        async with AsyncOpenAI(api_key=secret, websocket_base_url=base).realtime.connect(model="m") as conn:
            await asyncio.wait_for(conn.recv(), 5)
    assert "401" in str(err.value)


async def test_origin_defaults_to_the_pages_own(server) -> None:
    headers = {"Authorization": f"Bearer {KEY}"}
    own = f"http://127.0.0.1:{server.port}"
    assert await status_of(ws_url(server), additional_headers=headers, origin=own) == 101
    assert await status_of(ws_url(server), additional_headers=headers, origin="https://evil.example") == 403


async def test_stats_and_metrics_need_the_key_health_does_not(server) -> None:
    for path in ("/stats", "/metrics"):
        status, _ = await asyncio.to_thread(http, server, path)
        assert status == 401
        status, _ = await asyncio.to_thread(http, server, path, "GET", {"Authorization": f"Bearer {KEY}"})
        assert status == 200
    for path in ("/healthz", "/readyz"):
        status, _ = await asyncio.to_thread(http, server, path)
        assert status == 200


async def test_duplex_talk_sends_the_key_from_the_environment(server, monkeypatch) -> None:
    from clients.talk.connection import open_session
    from clients.talk.errors import TalkError

    monkeypatch.delenv("DUPLEX_API_KEY", raising=False)
    with pytest.raises(TalkError, match="needs an API key"):
        await open_session(ws_url(server), {})
    monkeypatch.setenv("DUPLEX_API_KEY", f"{OTHER_KEY},unused")
    ws, started_ev = await open_session(ws_url(server), {})
    assert started_ev["type"] == "session.started"
    await ws.close()
