"""A safetensors file's header, read without torch (the replay path imports no torch): an 8-byte
little-endian header size, then a JSON header giving each tensor's dtype, shape and byte range in
the data that follows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_header(path: Path) -> tuple[int, dict[str, Any]]:
    """Where the data starts, and the header as stored (``__metadata__`` included)."""
    with open(path, "rb") as file:
        size = int.from_bytes(file.read(8), "little")
        return 8 + size, json.loads(file.read(size))
