"""What a caller asks an export for, as one frozen record: the command line (the export and the
``plan`` parsers), ``export()``, ``ExportOnSave`` and the replay key all build an ``ExportOptions``,
and ``resolve()`` turns it into the profile, the precision and the block-quantization options, the
one place those are checked. A new option is one field here plus its flag in ``exporter.cli``.

Where the package goes (``output_dir``, ``overwrite``), the cache, and what is shown while it runs
(``progress``, ``on_stage``) are not options of the package and stay arguments of ``export()``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ep_profiles import EpProfile, get_profile
from ep_profiles.registry import UnknownProfileError
from exporter.errors import ExporterError
from exporter.int4_options import Int4Options
from exporter.precisions import PRECISIONS, choose_precision, int4_options


@dataclass(frozen=True)
class ResolvedOptions:
    profile: EpProfile
    precision: str
    int4: Int4Options | None  # the block-quantization settings at int4 and int8; None at float precisions


@dataclass(frozen=True)
class ExportOptions:
    """``export()``'s keyword arguments of the same names say what each does."""

    ep: str | EpProfile = "cpu"
    precision: str | None = None
    graph_capture: bool = True
    full_logits: bool = False
    int4: Int4Options | None = None
    int4_encoders: bool = False
    max_length: int | None = None
    text_only: bool = False
    strict: bool = False
    random_weights: bool = False
    trust_remote_code: bool = False
    allow_pickled_weights: bool = False

    def resolve(self) -> ResolvedOptions:
        """The profile, the precision (the profile's first where none is asked) and the
        block-quantization options, each checked; an ``ExporterError`` says what is wrong."""
        try:
            profile = self.ep if isinstance(self.ep, EpProfile) else get_profile(self.ep)
        except UnknownProfileError as error:
            raise ExporterError(str(error)) from error
        precision = choose_precision(profile, self.precision)
        int4 = int4_options(profile, precision, self.int4)
        if self.int4_encoders and PRECISIONS[precision].weight_bits is None:
            raise ExporterError(f"int4_encoders (--int4-encoders) applies to precision int4 or int8, not {precision}")
        if self.max_length is not None and self.max_length < 1:
            raise ExporterError(f"max_length must be 1 or more, not {self.max_length}")
        return ResolvedOptions(profile, precision, int4)

    def keywords(self) -> dict[str, Any]:
        """The options as ``export()``'s keyword arguments."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}

    def replay_key(self, resolved: ResolvedOptions) -> dict[str, Any]:
        """Every option, resolved, as JSON values (the replay key's options:
        ``exporter.cache.replay.fingerprint``). Built from the fields, so a new option is in the key
        and a replay never serves a package made with another value of it."""
        key = {name: value for name, value in self.keywords().items() if name not in ("ep", "precision", "int4")}
        return {**key, "ep": resolved.profile.name, "precision": resolved.precision,
                "int4": dataclasses.asdict(resolved.int4) if resolved.int4 else None}
