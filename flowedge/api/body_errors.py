"""A request body's first validation error as a line a person reads: where (`messages[0].content`), what
is wrong, and what was sent when it is short; never pydantic's internal path (`messages.0.content.str`:
the union member it tried) or its prefixes (`Value error, `)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

UNION_MEMBER = re.compile(r"^(str|int|float|bool|list\[.*\]|dict\[.*\]|[a-z-]+\[.*\])$")   # pydantic's union tags
PREFIXES = ("Value error, ", "Assertion failed, ")
OWN_WORDS = ("content", "unsupported", "missing", "json_invalid")   # messages that need no "(got ...)"
MAX_SHOWN = 40   # an input longer than this, as JSON, is not quoted back


@dataclass(frozen=True, slots=True)
class BodyError:
    message: str
    param: str | None
    code: str | None


def field_path(loc: tuple) -> str:
    """`("body", "messages", 0, "content", "str")` -> `messages[0].content`."""
    path = ""
    for part in loc:
        if part == "body" or (isinstance(part, str) and UNION_MEMBER.match(part)):
            continue
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path.lstrip(".")


def shown(value: object) -> str:
    """A short input quoted back (`7`, `'hot'`), or "" for a long one or one that is not a JSON scalar."""
    if not isinstance(value, (str, int, float, bool)) and value is not None:
        return ""
    text = repr(value) if isinstance(value, str) else json.dumps(value)
    return text if len(text) <= MAX_SHOWN else ""


def readable(error: dict) -> BodyError:
    """One pydantic error (an entry of `RequestValidationError.errors()`) in OpenAI's terms."""
    kind = error.get("type", "")
    message = str(error.get("msg", "invalid request body"))
    for prefix in PREFIXES:
        message = message.removeprefix(prefix)
    where = field_path(tuple(error.get("loc", ())))
    if kind == "unsupported":   # the message names the field itself
        return BodyError(message, where or None, "unsupported_parameter")
    if not where and kind in ("model_attributes_type", "model_type", "dict_type"):
        unread = isinstance(error.get("input"), bytes)   # FastAPI reads no JSON without its content type
        return BodyError("the body must be a JSON object" + (", sent with Content-Type: application/json"
                                                             if unread else ""), None, None)
    got = shown(error.get("input")) if kind not in OWN_WORDS and "input" in error else ""
    if got:
        message = f"{message} (got {got})"
    return BodyError(f"{where}: {message}" if where else message, where or None, None)
