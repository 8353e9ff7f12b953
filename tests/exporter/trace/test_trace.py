"""L1: what the decoder's trace records (``exporter.trace.decoder``)."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from exporter.trace.decoder import NoopsUntraced


class _Noops(torch.nn.Module):
    """A norm's upcast and cast back and repeat_kv's indexing, plus casts and slices that do
    something."""

    def forward(self, x, y):
        same = x.float() * 2 + x.to(torch.float32) + x.type_as(y) + x.to(dtype=torch.float32)
        copied = x.to(torch.float32, copy=True)  # a copy: traced
        half = x.to(torch.float16)  # changes the dtype: traced
        cut = x[:, 1:, None]  # a real slice: traced
        return same, copied, half.type_as(x), x.float(memory_format=torch.contiguous_format), x[:, None, :, None], cut


def _targets(program) -> list[str]:
    return [str(node.target) for node in program.graph.nodes if node.op == "call_function"]


@pytest.mark.l1
def test_noops_leave_no_node_and_the_same_values():
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    shapes = ({0: Dim.DYNAMIC}, {0: Dim.DYNAMIC})
    plain = torch.export.export(_Noops(), (x, y), dynamic_shapes=shapes, strict=False)
    with NoopsUntraced():
        untraced = torch.export.export(_Noops(), (x, y), dynamic_shapes=shapes, strict=False)

    casts = ("aten.to.dtype", "aten.type_as.default")
    to, type_as = casts
    assert [t for t in _targets(plain) if t in casts] == [to, to, type_as, to, to, to, type_as, to]
    # Left: the copy, the cast to fp16 and back, and the float() with a memory format.
    assert [t for t in _targets(untraced) if t in casts] == [to, to, type_as, to]
    assert _targets(untraced)[:4] == ["aten.mul.Tensor", "aten.add.Tensor", "aten.add.Tensor", "aten.add.Tensor"]
    # x[:, None, :, None] is two unsqueezes without the full slice over the dynamic dim; x[:, 1:, None]
    # keeps its slices.
    assert _targets(plain).count("aten.slice.Tensor") == 3 and _targets(untraced).count("aten.slice.Tensor") == 2
    assert _targets(plain).count("aten.unsqueeze.default") == _targets(untraced).count("aten.unsqueeze.default") == 3
    for want, got in zip(plain.module()(x, y), untraced.module()(x, y), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.l1
def test_type_as_a_tensor_on_another_device_still_moves():
    """``x.type_as(y)`` is ``x.to(y``'s dtype and device``)``: a ``y`` elsewhere moves ``x``, under
    the mode as in eager mode."""
    x, on_meta = torch.randn(2), torch.empty(2, device="meta")
    with NoopsUntraced():
        assert x.type_as(on_meta).device == torch.device("meta")
        assert x.type_as(torch.empty(2)) is x and x.to(torch.float32) is x and x.float() is x
        assert x[None, :].shape == (1, 2) and x[:, None].shape == (2, 1)
