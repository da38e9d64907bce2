"""Reading a user's JSONL file line by line, with one clear error for each way a file can be unreadable.

Every JSONL reader of the data layer (preference pairs and feedback, prompt rows, completion rows)
goes through :func:`jsonl_objects`: a line that is not UTF-8, not JSON, or JSON nested too deep for
Python's parser is refused naming the file, the line and the fix, never as a traceback.

>>> import tempfile, pathlib
>>> p = pathlib.Path(tempfile.mkdtemp()) / "rows.jsonl"
>>> _ = p.write_bytes(b'{"a": 1}\\n\\n{"a": "\\xff"}\\n')
>>> list(jsonl_objects(p, error=ValueError))
Traceback (most recent call last):
...
ValueError: ... line 3 is not UTF-8 text (byte 0xff at column 8); save the file as UTF-8
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Union

__all__ = ["jsonl_objects"]


def jsonl_objects(path: Union[str, Path], *, error: type, shape: str = "one JSON object a line") -> Iterator[tuple[int, Any]]:
    """``(line number, parsed value)`` for each non-blank line of ``path``; ``error(message)`` is
    raised for a line that is not UTF-8, not JSON or nested too deep (``shape`` says what a line
    should be)."""
    with open(path, "rb") as fh:
        for n, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8-sig" if n == 1 else "utf-8")
            except UnicodeDecodeError as exc:
                raise error(f"{path}: line {n} is not UTF-8 text (byte 0x{raw[exc.start]:02x} at column "
                            f"{exc.start + 1}); save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(f"{path}: line {n} is not valid JSON ({exc.msg}, column {exc.colno}); {shape}") from None
            except RecursionError:
                raise error(f"{path}: line {n} nests JSON too deeply to read (over Python's recursion limit); "
                            f"{shape}, with flat text fields") from None
