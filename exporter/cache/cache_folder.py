"""Where the caches live: ``$XDG_CACHE_HOME/genai-exporter/graphs`` (``~/.cache/...`` when unset), or
the folder the caller names; ``--no-cache`` (API ``cache=False``) or ``GENAI_EXPORTER_NO_CACHE=1``
turns them off. Both the graph cache (``exporter.cache.graph_cache``) and the command line's replays
(``exporter.cache.replay``) keep their entries there, pruned together."""

from __future__ import annotations

import os
from pathlib import Path

from exporter.errors import ExporterError

NO_CACHE_VARIABLE = "GENAI_EXPORTER_NO_CACHE"
# Every entry (a folder named by its key) holds its key's ingredients in this file; pruning counts
# only folders that do.
KEY_FILENAME = "key.json"


def default_folder() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "genai-exporter" / "graphs"


def chosen_folder(cache: bool | str | Path) -> Path | None:
    """The cache folder ``export(cache=...)`` asks for: None where the cache is off. A folder named
    by the caller is used even where ``GENAI_EXPORTER_NO_CACHE`` is set (the variable turns off the
    default folder)."""
    if cache is False:
        return None
    if cache is True:
        turned_off = os.environ.get(NO_CACHE_VARIABLE, "").strip().lower() not in ("", "0", "false", "no")
        return None if turned_off else default_folder()
    if not isinstance(cache, (str, Path)) or not str(cache):
        raise ExporterError(f"cache must be True, False or a folder, not {cache!r}")
    return Path(cache).expanduser()
