"""Every FX pass by the name EP profiles use to ask for it."""

from fx_passes.drop_noop_casts import DropNoopCasts
from fx_passes.drop_runtime_asserts import DropRuntimeAsserts

FX_PASSES = {p.name: p for p in (DropRuntimeAsserts(), DropNoopCasts())}
