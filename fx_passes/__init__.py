"""Rewrites of the torch.export program, one module per pass.

Each pass is a callable ``(program, settings, session) -> (program, changes)``; ``changes`` is a small dict
of counts that the export report shows. Every pass keeps the program runnable in PyTorch.
"""

from fx_passes.analyses.graph_facts import PassDidNotApply
from fx_passes.base import FxPass, PassRecord, Settings, run_fx_passes
from fx_passes.registry import FX_PASSES

__all__ = ["FX_PASSES", "FxPass", "PassDidNotApply", "PassRecord", "Settings", "run_fx_passes"]
