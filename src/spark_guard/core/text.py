"""Text from users, made safe to show: on a terminal, in the login note, in the journal.

Unit names, model paths, command lines, journal lines and error messages can
come from any user of the machine. Shown as they are, an ESC sequence clears
root's screen or forges lines, a CR overwrites a line, a newline or U+2028
starts a new one, a bidi override (U+202E) reverses what follows. printable()
escapes every character Python does not call printable (C0 and C1 controls,
DEL, separators other than the space, format characters, surrogates,
unassigned code points) and caps the length, saying how much was cut.

Backslashes stay as they are: systemd's own unit names hold \\x2d escapes,
and an admin must be able to copy them. Pure; nothing here does I/O.
"""

from __future__ import annotations

DEFAULT_LIMIT = 1024


def _escape(ch: str) -> str:
    code = ord(ch)
    if code < 0x100:
        return f"\\x{code:02x}"
    if code < 0x10000:
        return f"\\u{code:04x}"
    return f"\\U{code:08x}"


def _marker(cut: int) -> str:
    return f"...[{cut} more chars]"


def printable(value: object, limit: int = DEFAULT_LIMIT) -> str:
    """`value` as text with no character a terminal or a log reader would act on.

    At most `limit` characters long (or the marker's length, for a smaller limit):
    what does not fit is replaced by '...[N more chars]', N counting the
    characters of the original text left out.
    """
    text = value if isinstance(value, str) else str(value)
    if len(text) <= limit and text.isprintable():
        return text  # the usual case, at C speed
    # Each character becomes at least one, so this looks at no more than limit + 1 of them.
    parts: list[str] = []
    used = 0
    for ch in text:
        piece = ch if ch.isprintable() else _escape(ch)
        if used + len(piece) > limit:
            break
        parts.append(piece)
        used += len(piece)
    else:
        return "".join(parts)
    while parts and used + len(_marker(len(text) - len(parts))) > limit:
        used -= len(parts.pop())
    return "".join(parts) + _marker(len(text) - len(parts))


def quoted(value: object, limit: int = 64) -> str:
    """A user's value quoted for a one-line message about it: repr() of its first `limit`
    characters, "..." after a cut (printable() makes the whole line safe)."""
    text = str(value)
    return repr(text if len(text) <= limit else text[:limit] + "...")
