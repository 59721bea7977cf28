"""Writing shell scripts others run: every value quoted, every comment one line."""

from __future__ import annotations

import re
import shlex

_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")


def quote(value: object) -> str:
    """``value`` as one shell word, whatever characters it holds."""
    return shlex.quote(str(value))


def comment(text: str) -> str:
    """``text`` as one comment line: line breaks and other control characters become spaces, so nothing after them
    can become a command."""
    return "# " + _CONTROL.sub(" ", text)
