"""L3: the ``last_token`` marker lowered to ONNX and run by ONNX Runtime, in both forms: from the
attention mask, and from the position ids (a graph-captured decoder's form, with no shape
arithmetic), on batches as ONNX Runtime GenAI feeds them: right-padded prompts whose padding has
position 0, a row with one real token, decode steps, a chunk after a past, a row with no real token
in the chunk (position 0, as the mask form gives it)."""

from __future__ import annotations

import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch

import fx_passes.custom_ops.ops  # noqa: F401  (registers the custom ops)
from exporter.lower.torch_onnx import lower
from exporter.verify.postconditions import cpu_placed_nodes

pytestmark = pytest.mark.unit

HIDDEN = 6


class LastTokens(torch.nn.Module):
    """The marker on a hidden state [batch, seq, hidden] (float32 and float16), on the position
    ids themselves (int64 and int32), on a [batch, heads, seq, head] tensor (sequence on axis 2)
    and on booleans."""

    def __init__(self, by_position: bool):
        super().__init__()
        self.by_position = by_position

    def forward(self, hidden, heads, attention_mask, position_ids):
        last_token = torch.ops.genai_exporter.last_token
        reference = position_ids if self.by_position else None
        odd = position_ids.remainder(2) == 1
        return (last_token(hidden, attention_mask, 1, reference), last_token(position_ids, attention_mask, 1, reference),
                last_token(heads, attention_mask, 2, reference), last_token(odd, attention_mask, 1, reference),
                last_token(hidden.half(), attention_mask, 1, reference), last_token(position_ids.int(), attention_mask, 1, reference))


def _genai_inputs(real: list[int], seq: int, past: int):
    """A batch as ONNX Runtime GenAI gives it: row b has ``real[b]`` real tokens in this chunk of
    ``seq``, right-padded; real tokens are numbered by their place after the past, padding gets
    position 0 and mask 0. Padded positions of the tensors hold NaN, which must not leak, except in
    a row with no real token, whose pick (position 0) is then told apart from the others."""
    generator = torch.Generator().manual_seed(0)
    batch = len(real)
    hidden = torch.randn(batch, seq, HIDDEN, generator=generator)
    heads = torch.randn(batch, 2, seq, 3, generator=generator)
    mask = torch.zeros(batch, past + seq, dtype=torch.int64)
    positions = torch.zeros(batch, seq, dtype=torch.int64)
    for row, count in enumerate(real):
        mask[row, : past + count] = 1
        positions[row, :count] = torch.arange(past, past + count)
        if count:
            hidden[row, count:] = float("nan")
            heads[row, :, count:] = float("nan")
    return hidden, heads, mask, positions


# name: (each row's real tokens in the chunk, chunk length, past)
CASES = {
    "unpadded prompt": ([5], 5, 0),
    "right-padded prompts of three lengths": ([7, 3, 5], 7, 0),
    "a row with one real token": ([4, 1], 4, 0),
    "decode step": ([1, 1], 1, 9),
    "chunk after a past": ([3, 2], 3, 6),
    "a row with no real token in the chunk": ([2, 0], 2, 4),
}


@pytest.fixture(scope="module")
def sessions(tmp_path_factory):
    made = {}
    folder = tmp_path_factory.mktemp("last_token")
    for by_position in (False, True):
        sample = _genai_inputs([3, 2], 3, 2)
        batch, seq, total = (torch.export.Dim(n) for n in ("batch", "seq", "total"))
        program = torch.export.export(LastTokens(by_position), sample, dynamic_shapes=(
            {0: batch, 1: seq}, {0: batch, 2: seq}, {0: batch, 1: total}, {0: batch, 1: seq}))
        path = folder / f"by_position_{by_position}.onnx"
        model, _ = lower(program, sample, ["hidden", "heads", "attention_mask", "position_ids"],
                         ["last_hidden", "last_position", "last_heads", "last_odd", "last_hidden_fp16",
                          "last_position_int32"])
        ir.save(model, path)
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        made[by_position] = session, cpu_placed_nodes(model)
    return made


@pytest.mark.l3
@pytest.mark.parametrize("by_position", [False, True], ids=["from the mask", "from the position ids"])
@pytest.mark.parametrize("case", list(CASES))
def test_lowered_last_token_picks_each_rows_last_real_token(sessions, case, by_position):
    real, seq, past = CASES[case]
    inputs = _genai_inputs(real, seq, past)
    session, cpu_nodes = sessions[by_position]
    if by_position:  # what graph capture needs: nothing the CPU would have to compute
        assert cpu_nodes == []
    else:  # the mask form's index arithmetic
        assert "Shape" in {node.op_type for node in cpu_nodes}
    feeds = dict(zip(("hidden", "heads", "attention_mask", "position_ids"), (t.numpy() for t in inputs)))
    got = [torch.from_numpy(value) for value in session.run(None, feeds)]
    kernel = LastTokens(by_position)(*inputs)  # the marker's own kernel, which the L2 tests run
    hidden, heads, _, positions = inputs
    last = [max(count - 1, 0) for count in real]
    want = (torch.stack([hidden[row, [j]] for row, j in enumerate(last)]),
            torch.stack([positions[row, [j]] for row, j in enumerate(last)]),
            torch.stack([heads[row, :, [j]] for row, j in enumerate(last)]),
            torch.stack([positions[row, [j]] % 2 == 1 for row, j in enumerate(last)]),
            torch.stack([hidden[row, [j]] for row, j in enumerate(last)]).half(),
            torch.stack([positions[row, [j]] for row, j in enumerate(last)]).int())
    for name, values in (("ONNX Runtime", got), ("marker kernel", kernel)):
        for value, expected in zip(values, want, strict=True):
            assert value.dtype == expected.dtype, name
            torch.testing.assert_close(value, expected, rtol=0, atol=0, equal_nan=True, msg=name)
