"""A refusal in the format the command was asked for: with ``--json``, one JSON object
(``error``, ``flag``, ``fix``) on stdout instead of the one line on stderr; either way a
non-zero exit (issue 66).

The project's one-line errors name the flag first and end with what to do after the last
colon ("--x 3: ...: set --y"), so the object is read from the line itself: ``fix`` is the last
clause (after the last colon, and after the last semicolon there); ``flag`` the flag the line
starts with, else the first the fix names, else the first anywhere (None where it names none,
e.g. a preset's key)."""

from __future__ import annotations

import json
import re
import sys
from typing import Any, Dict, Optional

FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def refusal(message: str) -> Dict[str, Optional[str]]:
    """{error, flag, fix} of a one-line error."""
    fix = message.rsplit(": ", 1)[-1].rsplit("; ", 1)[-1]
    first = FLAG.match(message)
    found = first or FLAG.search(fix) or FLAG.search(message)
    return {"error": message, "flag": found.group(0) if found else None, "fix": fix}


def refuse(command: str, message: str, as_json: bool, code: int = 2) -> int:
    """Print the refusal (JSON on stdout, or ``ssdtrain COMMAND: error: ...`` on stderr) and
    return ``code``."""
    if as_json:
        print(json.dumps(refusal(message), indent=2))
    else:
        print(f"ssdtrain {command}: error: {message}", file=sys.stderr)
    return code


__all__ = ["refusal", "refuse"]
