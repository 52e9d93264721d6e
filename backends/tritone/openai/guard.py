"""The front door of tritone-openai: the API key and the body's size, checked before the body is
read, so that a client without the key, or with a body too large, costs neither memory nor a parse.

A pure ASGI middleware: Starlette's BaseHTTPMiddleware wraps the connection's receive, through
which a streamed response notices a client's disconnect.
"""

from __future__ import annotations

import json
import secrets

from tritone.openai.errors import error_body

DEFAULT_MAX_BODY_BYTES = 4 << 20
# Open without the key: the launcher and load balancers probe it.
_OPEN = {("GET", "/health")}


class Guard:
    """Wraps an ASGI app: every HTTP request but the open ones must carry the key (when there is
    one), and no body over `max_body_bytes` reaches the app, whatever its framing."""

    def __init__(self, app, api_key: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or (scope["method"], scope["path"]) in _OPEN:
            return await self.app(scope, receive, send)
        headers = _headers(scope)
        # Until the body is read to its end, the connection cannot carry another request;
        # uvicorn would read and discard the whole body to keep it alive, so a refusal closes it.
        may_have_body = headers.get(b"content-length", [b"0"]) != [b"0"] or b"transfer-encoding" in headers
        if self.expected is not None and not self._has_key(headers):
            return await _refuse(send, 401, "invalid or missing API key (Authorization: Bearer ...)",
                                 "authentication_error", close=may_have_body)
        lengths = headers.get(b"content-length", [])
        if lengths:
            if len(set(lengths)) > 1 or not lengths[0].strip().isdigit():
                return await _refuse(send, 400, "Content-Length must be one non-negative integer", close=True)
            digits = lengths[0].strip().lstrip(b"0") or b"0"
            # Compared by the number of digits first: int() of thousands of them is itself work.
            if len(digits) > len(str(self.max_body_bytes)) or int(digits) > self.max_body_bytes:
                return await _refuse(send, 413, self._too_large(), close=True)
        body = await self._read_body(receive)
        if body is None:  # the client left before sending all of it
            return
        if len(body) > self.max_body_bytes:
            return await _refuse(send, 413, self._too_large(), close=True)
        await self.app(scope, _replay(body, receive), send)

    def _has_key(self, headers: dict[bytes, list[bytes]]) -> bool:
        given = headers.get(b"authorization", [])
        return len(given) == 1 and secrets.compare_digest(given[0], self.expected)

    async def _read_body(self, receive) -> bytes | None:
        """The body, or as much of it as first goes past the limit (then no more is read)."""
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes or not message.get("more_body", False):
                return bytes(body)

    def _too_large(self) -> str:
        return f"the request body is larger than this server's limit of {self.max_body_bytes} bytes"


def _headers(scope) -> dict[bytes, list[bytes]]:
    headers: dict[bytes, list[bytes]] = {}
    for name, value in scope["headers"]:
        headers.setdefault(name.lower(), []).append(value)
    return headers


def _replay(body: bytes, receive):
    """A receive that hands the app the body already read, then the connection's own receive
    (through which the app learns of a disconnect)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed


async def _refuse(send, status: int, message: str, type: str = "invalid_request_error", close: bool = False):
    body = json.dumps(error_body(message, type)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
