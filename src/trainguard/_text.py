"""Terminal-safe text for human-readable output (the CLI, ``trainguard status``).

A checkpoint or an event log is untrusted input: an entry key, a metric name, a problem string, a run id or a
run root's path may hold terminal control sequences (``ESC [ 2 J`` clears the screen, ``ESC ] 0 ; ... BEL``
retitles the window). Every human-readable line printed from such data goes through :func:`printable` (plain
text) or :func:`markup` (rich markup), which show each control character (C0, DEL, C1) as a visible ``\\xNN``
escape. JSON output needs nothing: ``json.dumps`` already escapes them.
"""

from __future__ import annotations

import re
from typing import Any

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_CONTROL_BUT_LINES = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def _show(m: re.Match[str]) -> str:
    return f"\\x{ord(m.group()):02x}"


def printable(text: Any, *, lines: bool = False) -> str:
    """``str(text)`` with every control character (C0, DEL, C1) replaced by its ``\\xNN`` escape.

    Args:
        text: anything; converted with ``str``.
        lines: keep newlines and tabs (for a whole message the CLI composed; never for one field).

    Returns:
        The text, safe to write to a terminal: ``"k\\x1b[2J"`` becomes the 9 characters ``k\\x1b[2J``.
    """
    return (_CONTROL_BUT_LINES if lines else _CONTROL).sub(_show, str(text))


def markup(text: Any) -> str:
    """``text`` for a rich markup string: control characters escaped as by :func:`printable`, and ``[``
    escaped so that data never becomes markup."""
    from rich.markup import escape

    return escape(printable(text))


def exception_text(e: BaseException) -> str:
    """``"TypeName: message"`` for an exception, or the type alone when it has no message (a Ctrl-C is
    ``"KeyboardInterrupt (interrupted)"``), so an error line never ends in a dangling ``": "``.

    Args:
        e: any exception.

    Returns:
        One human-readable description (not escaped: pass it through :func:`printable` for a terminal).
    """
    name = type(e).__name__
    text = str(e).strip()
    if text:
        return f"{name}: {text}"
    return f"{name} (interrupted)" if isinstance(e, KeyboardInterrupt) else name


def error_field_text(error: object) -> str:
    """An ``error`` field read back from an event (``"TypeName: message"``), tidied for a listing: an empty
    message (written by older versions as ``"KeyboardInterrupt: "``) shows as the type alone."""
    text = str(error).rstrip()
    if text.endswith(":"):
        text = text[:-1]
        if text == "KeyboardInterrupt":
            text += " (interrupted)"
    return text


def naming_step(message: str, step: int) -> str:
    """``message`` prefixed with ``"saving step N failed: "`` unless it already names ``step N``, so that every
    save error says which step failed, also when a later call reports it (a background save)."""
    if re.search(rf"\bsteps? {step}\b", message):
        return message
    return f"saving step {step} failed: {message}"
