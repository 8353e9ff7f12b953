"""Every FX pass, in the order they run: the export plan keeps those whose ``applies`` says why
(``exporter.plan``). A new pass is one module plus one line here."""

from fx_passes.complex_as_real_pairs import ComplexAsRealPairs
from fx_passes.drop_noop_casts import DropNoopCasts
from fx_passes.drop_runtime_asserts import DropRuntimeAsserts
from fx_passes.fold_untranslatable_constants import FoldUntranslatableConstants
from fx_passes.gather_last_token import GatherLastToken
from fx_passes.split_oversized_weights import SplitOversizedWeights
from fx_passes.substitute_group_query_attention import SubstituteGroupQueryAttention
from fx_passes.substitute_mixture_of_experts import SubstituteMixtureOfExperts
from fx_passes.truncate_shared_kv_layers import TruncateSharedKvLayers

FX_PASSES = {p.name: p for p in (
    DropRuntimeAsserts(),
    DropNoopCasts(),
    FoldUntranslatableConstants(),
    ComplexAsRealPairs(),
    SplitOversizedWeights(),
    SubstituteGroupQueryAttention(),
    SubstituteMixtureOfExperts(),
    GatherLastToken(),
    TruncateSharedKvLayers(),
)}
