"""Server-sent events, as OpenAI-compatible servers stream them."""

from __future__ import annotations

import json


class SSEDecoder:
    """Turns the lines of an SSE stream into ``(event, data)`` pairs.

    Follows the SSE format (``data:`` lines joined by newlines, dispatched at a blank line;
    ``:`` comments, ``id:``/``retry:`` ignored; ``event:`` names the next event) but also
    dispatches as soon as the data collected so far is complete JSON or ``[DONE]``, so a
    server that omits the blank lines is neither mis-parsed nor timed late.
    """

    def __init__(self) -> None:
        self._data: list[str] = []
        self._event = ""

    def _ready(self) -> bool:
        text = "\n".join(self._data)
        if text.strip() == "[DONE]":
            return True
        try:
            json.loads(text)
        except ValueError:
            return False
        return True

    def _dispatch(self) -> list[tuple[str, str]]:
        out = [(self._event or "message", "\n".join(self._data))] if self._data else []
        self._data, self._event = [], ""
        return out

    def feed(self, line: str) -> list[tuple[str, str]]:
        line = line.rstrip("\r\n")
        if not line:
            return self._dispatch()
        if line.startswith(":"):
            return []
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
            return self._dispatch() if self._ready() else []
        if name == "event":
            out = self._dispatch() if self._data else []  # a new event starts: flush the last one
            self._event = value
            return out
        return []  # id:, retry:, unknown fields

    def flush(self) -> list[tuple[str, str]]:
        return self._dispatch()
