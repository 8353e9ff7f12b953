"""The plan's settings for FX-pass tests that run passes on a traced program without an export."""

from __future__ import annotations

import dataclasses

from exporter.plan import ExportSettings, export_settings
from exporter.sessions import SESSIONS

DECODER = SESSIONS["decoder"]


def pass_settings(profile, layout, precision: str = "fp32", graph_capture: bool = False) -> ExportSettings:
    """``export_settings`` for ``profile``, with ``graph_capture`` as given even where the profile
    captures nothing: the last-token passes' captured form is tested on the CPU, where it runs."""
    return dataclasses.replace(export_settings(profile, layout, precision), graph_capture=graph_capture)
