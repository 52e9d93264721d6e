"""Whether a client's value can go on to the ensemble as it is: text that UTF-8 can carry (JSON's
escapes can spell a lone surrogate), finite numbers (Python's JSON reads NaN and Infinity, and
json.dumps would write them out as invalid JSON), and nesting that stays shallow."""

from __future__ import annotations

import json
import math

# json.dumps and the chat template recurse through what they are given; real schemas and
# messages are nowhere near this deep.
MAX_NESTING = 64


def first_unsendable(value, name: str) -> tuple[str, str] | None:
    """(where, what is wrong) for the first part of field `name`'s value, in the order the client
    wrote them, that cannot be sent on; None when all can."""
    if _depth_within(value, MAX_NESTING):
        try:
            # In C, and quick; only a value that fails is walked part by part, to name the place.
            json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")
            return None
        except ValueError:  # UnicodeEncodeError among them
            pass
    return _first_fault(value, name)


def _depth_within(value, limit: int) -> bool:
    """Whether no more than `limit` lists and objects nest in `value`."""
    level = [value] if isinstance(value, (dict, list)) else []
    for _ in range(limit):
        level = [part for v in level for part in (v.values() if isinstance(v, dict) else v)
                 if isinstance(part, (dict, list))]
        if not level:
            return True
    return not level


def _first_fault(value, name: str) -> tuple[str, str] | None:
    """A loop, not recursion: the nesting is the client's to choose."""
    stack = [((name,), value)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            if not _is_utf8(value):
                return _path(where), "is not valid UTF-8 text (it holds a lone surrogate such as \\ud800)"
        elif isinstance(value, float):
            if not math.isfinite(value):
                return _path(where), "must be a finite number"
        elif isinstance(value, (dict, list)):
            if len(where) > MAX_NESTING:
                return _path(where), f"is nested deeper than {MAX_NESTING} levels"
            if isinstance(value, dict) and not all(_is_utf8(key) for key in value):
                return _path(where), "has a key that is not valid UTF-8 text (a lone surrogate such as \\ud800)"
            parts = value.items() if isinstance(value, dict) else enumerate(value)
            stack += reversed([((*where, key), part) for key, part in parts])
    return None


def _path(where: tuple) -> str:
    """A place in a request as the client wrote it: messages[0].content."""
    return where[0] + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in where[1:])


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
