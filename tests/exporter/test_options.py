"""``ExportOptions`` and ``export()``'s keyword arguments stay one list: a field added to the record
without its ``export()`` parameter (or with another default), or the reverse, fails here by name."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from exporter import export
from exporter.options import ExportOptions

pytestmark = pytest.mark.unit

# export()'s parameters that are not options of the package: what to export, where, and how the
# call behaves (progress, the graph cache, an in-memory model's processor).
NOT_OPTIONS = {"model", "tokenizer", "output_dir", "overwrite", "processor", "on_stage", "progress", "cache"}


def test_every_option_is_an_export_keyword_with_the_same_default():
    parameters = inspect.signature(export).parameters
    fields = {field.name: field.default for field in dataclasses.fields(ExportOptions)}
    keywords = {name: p.default for name, p in parameters.items() if name not in NOT_OPTIONS}
    assert set(fields) == set(keywords), (f"only in ExportOptions: {sorted(set(fields) - set(keywords))}; "
                                          f"only in export(): {sorted(set(keywords) - set(fields))}")
    assert all(parameters[name].kind is inspect.Parameter.KEYWORD_ONLY for name in fields)
    assert fields == keywords
