"""What a client of tritone-openai is told when something goes wrong, in OpenAI's error JSON.

A refusal names the client's field. The server's own failures reach the client as generic
messages, with the detail in the log. An error from tritonserver arrives as text only (Triton's
stream carries an error message, no code), so `classify_triton_error` is the one place that reads
such text; everything after it goes by `Failure`.
"""

from __future__ import annotations

import enum
import logging
import re

logger = logging.getLogger("tritone.openai")
# What a client hears when tritonserver cannot be reached, or the engine failed.
UNAVAILABLE = "the model server is unavailable, retry later"
ENGINE_FAILED = "the engine failed on this request"
# Triton's prefix on a composing model's error, which tells an OpenAI client nothing.
_ENSEMBLE_PREFIX = re.compile(r"^in ensemble '[^']*', ")
# Triton's and gRPC's words for a server that is not there (or not serving the ensemble yet).
_UNAVAILABLE_SIGNS = ("socket closed", "failed to connect", "unavailable", "connection refused", "unknown model")


class RequestError(Exception):
    """A request the front end refuses: HTTP `status`, OpenAI error `type`, the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.status, self.type = message, param, status, type


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error JSON. A message may quote the client's own text, which can be long and hold
    lone surrogates that UTF-8 cannot carry: it goes out cut short and escaped."""
    return {"error": {"message": _printable(message), "type": type, "param": param and _printable(param),
                      "code": code}}


def _printable(text: str, max_chars: int = 500) -> str:
    if len(text) > max_chars:
        text = text[:max_chars] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


class Failure(enum.Enum):
    """What an error from the model server is, to the client: its HTTP status, and the generic
    message that stands in for the server's own words (None: they go out as they are)."""

    REFUSED = (400, None)  # the engine refused the request, in words that name the field
    BUSY = (503, None)  # a full queue or a draining server, in the engine's words (retry later)
    UNAVAILABLE = (503, UNAVAILABLE)  # tritonserver is not there, or not serving the ensemble
    ENGINE_FAILED = (500, ENGINE_FAILED)  # the engine failed on the request

    def __init__(self, status: int, generic: str | None):
        self.status, self.generic = status, generic


def classify_triton_error(message: str) -> Failure:
    """The kind of an error Triton answered a request with, from its text (the engine's messages
    cross Triton as text): the engine starts its own failures with "engine error", its refusals
    for load with "server busy" or "server is shutting down"; gRPC and Triton word an absent
    server or model in their own ways."""
    lowered = message.lower()
    if any(sign in lowered for sign in _UNAVAILABLE_SIGNS):
        return Failure.UNAVAILABLE
    if "server busy" in message or "shutting down" in message:
        return Failure.BUSY
    if message.startswith("engine error"):
        return Failure.ENGINE_FAILED
    return Failure.REFUSED


def triton_error(message: str, guide_field: str | None = None) -> RequestError:
    """What the client is told of an error response: the engine's refusals as they are (they
    name the field; a constraint's under the OpenAI field it came from), the server's own
    failures as generic messages."""
    message = _ENSEMBLE_PREFIX.sub("", message)
    failure = classify_triton_error(message)
    if failure is not Failure.REFUSED:
        return failed(failure, message)
    param = None
    if guide_field and message.startswith("guided_decoding_guide"):
        # The engine names the ensemble's input; the client sent an OpenAI field.
        message = guide_field + message.removeprefix("guided_decoding_guide_type").removeprefix(
            "guided_decoding_guide")
        param = guide_field
    return RequestError(message, param, status=failure.status)


def failed(failure: Failure, detail: str) -> RequestError:
    """A failure on the server's side: the detail goes to the log, and the client gets the
    generic message where there is one."""
    if failure.generic is None:
        return RequestError(detail, status=failure.status, type="server_error")
    if failure is Failure.UNAVAILABLE:
        logger.warning("the model server is unavailable: %s", detail)
    else:
        logger.error("%s", detail)
    return RequestError(failure.generic, status=failure.status, type="server_error")
