"""Who may open a session: API keys, single-use client secrets and the browser Origin rule.

Sans-I/O: header values in, decisions out, with an injected clock, so every rule is tested
without a socket. `duplex.transports.native` applies them before the WebSocket upgrade.

- API keys travel as `Authorization: Bearer KEY` (what the `openai` package sends for `api_key`).
- Browsers cannot set headers on a WebSocket: they trade a key (on their own backend, or the page
  asks its user) for a *client secret* at `POST /v1/realtime/client_secrets` and offer it as the
  WebSocket subprotocol `openai-insecure-api-key.SECRET` (the OpenAI convention) or
  `duplex-secret.SECRET`. A secret opens one session, within its lifetime.
- Origin: a browser's `Origin` must be the page's own (the request's `Host`) or in the allow-list;
  clients that send no Origin (servers, the SDKs) are not browsers and pass.
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

SECRET_PREFIX = "ek_"
SUBPROTOCOL_PREFIXES = ("openai-insecure-api-key.", "duplex-secret.")
#: subprotocols a client may offer besides the secret; the server selects the first one it knows
PLAIN_SUBPROTOCOLS = ("realtime", "duplex")
MAX_OUTSTANDING_SECRETS = 10_000
MAX_SECRET_TTL_S = 3600.0
MIN_SECRET_TTL_S = 10.0


class AuthError(ValueError):
    """A request was refused; `status` is the HTTP status, `code` the documented error code."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


def is_loopback(host: str) -> bool:
    """Whether a bind address only accepts connections from this machine."""
    if host in ("localhost", "ip6-localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def bearer_token(authorization: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header; None if absent or another scheme."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def offered_subprotocols(header: str | None) -> list[str]:
    """The comma-separated `Sec-WebSocket-Protocol` values a client offered."""
    return [p.strip() for p in (header or "").split(",") if p.strip()]


def secret_from_subprotocols(offered: Iterable[str]) -> str | None:
    """The client secret carried in an offered subprotocol, if any."""
    for proto in offered:
        for prefix in SUBPROTOCOL_PREFIXES:
            if proto.startswith(prefix) and len(proto) > len(prefix):
                return proto[len(prefix) :]
    return None


def choose_subprotocol(offered: Sequence[str]) -> str | None:
    """The subprotocol the server answers with: a plain one if offered, else the secret's own one.

    A browser fails a connection whose answer names none of the protocols it offered."""
    for proto in offered:
        if proto in PLAIN_SUBPROTOCOLS:
            return proto
    for proto in offered:
        if any(proto.startswith(p) for p in SUBPROTOCOL_PREFIXES):
            return proto
    return None


def origin_allowed(origin: str | None, host: str | None, allowed: Sequence[str] | None) -> bool:
    """A browser Origin is allowed if it is in `allowed` or names the page's own host.

    No Origin: not a browser, allowed (keys and secrets authenticate those)."""
    if origin is None:
        return True
    if allowed and ("*" in allowed or origin in allowed):
        return True
    if not host:
        return False
    parsed = urllib.parse.urlsplit(origin)
    # behind a TLS proxy the page is https:// while the request reaching us is plain: compare hosts
    return parsed.scheme in ("http", "https") and parsed.netloc.lower() == host.strip().lower()


@dataclass(frozen=True)
class ClientSecret:
    value: str
    expires_at: float  # seconds since the epoch (what OpenAI reports)


class ClientSecrets:
    """Short-lived, single-use secrets: `issue()` one, `redeem()` it once before it expires."""

    def __init__(self, clock: Callable[[], float] = time.time, limit: int = MAX_OUTSTANDING_SECRETS) -> None:
        self._clock = clock
        self._limit = limit
        self._live: OrderedDict[str, float] = OrderedDict()  # value -> expires_at, oldest first

    def __len__(self) -> int:
        return len(self._live)

    def issue(self, ttl_s: float) -> ClientSecret:
        ttl_s = min(max(ttl_s, MIN_SECRET_TTL_S), MAX_SECRET_TTL_S)
        self._prune()
        while len(self._live) >= self._limit:  # bounded: the oldest unused secret is forgotten
            self._live.popitem(last=False)
        value = SECRET_PREFIX + secrets.token_urlsafe(24)
        expires_at = self._clock() + ttl_s
        self._live[value] = expires_at
        return ClientSecret(value, round(expires_at, 3))

    def redeem(self, value: str) -> bool:
        """True once for a live secret; it cannot be used again."""
        expires_at = self._live.pop(value, None)
        return expires_at is not None and self._clock() < expires_at

    def _prune(self) -> None:
        now = self._clock()
        for value in [v for v, exp in self._live.items() if exp <= now]:
            del self._live[value]


class Authenticator:
    """The server's API keys and client secrets; with no key, everything is allowed."""

    def __init__(self, api_keys: Sequence[str] = (), secrets_store: ClientSecrets | None = None) -> None:
        self.api_keys = tuple(k for k in api_keys if k)
        self.secrets = secrets_store or ClientSecrets()

    @property
    def enabled(self) -> bool:
        return bool(self.api_keys)

    def key_valid(self, token: str | None) -> bool:
        if token is None:
            return False
        # compare with every key in constant time, so timing tells nothing about which one nearly matched
        found = False
        for key in self.api_keys:
            found |= hmac.compare_digest(token.encode(), key.encode())
        return found

    def check_key(self, authorization: str | None) -> None:
        """For HTTP endpoints that need the API key itself (client secrets, /metrics, /stats)."""
        if not self.enabled:
            return
        token = bearer_token(authorization)
        if token is None:
            raise AuthError(401, "missing_api_key", "send the API key as 'Authorization: Bearer KEY'")
        if not self.key_valid(token):
            raise AuthError(401, "invalid_api_key", "the API key is not valid")

    def check_session(self, authorization: str | None, subprotocols: str | None) -> None:
        """For WebSocket sessions: a valid key (Bearer) or a live client secret (subprotocol)."""
        if not self.enabled:
            return
        token = bearer_token(authorization)
        if token is not None:
            if self.key_valid(token):
                return
            if token.startswith(SECRET_PREFIX) and self.secrets.redeem(token):
                return
            raise AuthError(401, "invalid_api_key", "the API key or client secret is not valid")
        secret = secret_from_subprotocols(offered_subprotocols(subprotocols))
        if secret is None:
            raise AuthError(
                401,
                "missing_api_key",
                "authenticate with 'Authorization: Bearer KEY' or, from a browser, a client secret "
                "offered as the subprotocol 'openai-insecure-api-key.SECRET'",
            )
        if not self.secrets.redeem(secret):
            raise AuthError(401, "invalid_client_secret", "the client secret is unknown, used or expired")
