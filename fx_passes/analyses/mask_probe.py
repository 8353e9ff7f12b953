"""Learn what an attention mask of the traced program means by running the nodes that build it.

GroupQueryAttention builds causal and sliding-window masks itself, so substituting it is only
right when the model's mask is exactly causal, optionally limited to the last W tokens. Rather
than trusting config fields (which differ per family and are sometimes ignored by the code), the
mask subgraph is run (``graph_facts.evaluate_nodes``) on an unpadded probe prompt and on one decode
step at the end of the context, and the results are compared with those two forms. Padding is not
probed: GroupQueryAttention takes it from the attention mask's row sums.
"""

from __future__ import annotations

import torch

from fx_passes.analyses.graph_facts import PassDidNotApply


def allowed_keys(mask: torch.Tensor, name: str) -> torch.Tensor:
    """[queries, keys] booleans of a boolean mask (True = attend) or an additive one, whose entries
    must each be 0 (attend) or a large negative number (blocked); anything else is a bias, which
    GroupQueryAttention cannot express."""
    if mask.dtype == torch.bool:
        allowed = mask
    else:
        allowed = mask == 0
        if not bool((allowed | (mask <= -1e4)).all()):
            raise PassDidNotApply(f"mask {name} adds a bias to the scores, not just 0 or -inf")
    return allowed.reshape(-1, *allowed.shape[-2:])[0]


def causal_window(mask: torch.Tensor, name: str) -> int:
    """0 for a causal mask, W for a causal mask limited to the last W keys; anything else is an
    error. ``mask`` is [..., queries, keys] for a prompt with no past."""
    allowed = allowed_keys(mask, name)
    queries, keys = allowed.shape
    if queries != keys:
        raise PassDidNotApply(f"mask {name} of the probe is {tuple(mask.shape)}; expected square")
    seen = int(allowed[-1].sum())
    window = 0 if seen == keys else seen
    position = torch.arange(keys)
    expected = position[None, :] <= position[:, None]
    if window:
        expected &= position[None, :] > position[:, None] - window
    if not bool((allowed == expected).all()):
        raise PassDidNotApply(
            f"mask {name} is neither causal nor a causal sliding window (its last query sees {seen} of "
            f"{keys} keys); GroupQueryAttention cannot build it"
        )
    return window


def decode_step_agrees(mask: torch.Tensor, window: int, name: str) -> None:
    """The mask of one query at the end of the context must see all keys, or the last ``window``:
    this catches windows and chunks wider than the prompt probe."""
    row = allowed_keys(mask, name)[-1]
    keys = row.shape[0]
    expected = torch.arange(keys) >= (keys - window if window else 0)
    if not bool((row == expected).all()):
        raise PassDidNotApply(
            f"mask {name} at the end of the context lets its query see {int(row.sum())} of {keys} keys, "
            f"not {window or keys}: a window or chunking the prompt probe did not show"
        )
