"""L3: ONNX Runtime CPU vs PyTorch on logits and every present KV."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from exporter.trace import GenAIDecoder, input_names, make_inputs

# fp32 through different kernels (MLAS vs ATen) and different summation orders: observed max
# differences are ~5e-6; 1e-4 leaves room without hiding a wrong mask or a wrong position.
TOLERANCE = 1e-4

# (batch, seq, past, left padding per row, right padding of the past per row)
CASES = [
    (1, 7, 0, None, None),
    (2, 1, 9, None, None),
    (3, 20, 0, None, None),
    (1, 1, 30, None, None),
    (2, 6, 0, (0, 3), None),  # prefill of a batch whose second prompt is left-padded by 3
    (2, 1, 8, (0, 3), None),  # a decode step of that batch
    (2, 1, 8, None, (0, 3)),  # a decode step of a right-padded batch, as ONNX Runtime GenAI pads
]


@pytest.mark.l3
def test_onnx_runtime_matches_pytorch(family_export):
    package, layout = family_export.package, family_export.package.layout
    session = ort.InferenceSession(str(package.model_path), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == input_names(layout)
    reference = GenAIDecoder(family_export.model, layout).eval()
    generator = torch.Generator().manual_seed(0)
    for batch, seq, past, padding, right_padding in CASES:
        inputs = make_inputs(layout, batch, seq, past, generator=generator, left_padding=padding,
                             past_right_padding=right_padding)
        with torch.no_grad():
            expected = [t.numpy() for t in reference(*inputs)]
        feeds = dict(zip(input_names(layout), [t.numpy() for t in (*inputs[:3], *inputs[3])]))
        actual = session.run(None, feeds)
        assert len(actual) == len(expected)
        real = inputs[1].numpy().astype(bool)  # [batch, past + seq]: False at padding
        for name, got, want in zip([o.name for o in session.get_outputs()], actual, expected):
            assert got.shape == want.shape, name
            if name == "logits":
                # A padded query position attends to nothing; its output is never read.
                keep = real[:, past:]
                got, want = got[keep], want[keep]
            else:
                keep = real  # KV rows of padded positions are masked out of every later step
                got, want = got.transpose(0, 2, 1, 3)[keep], want.transpose(0, 2, 1, 3)[keep]
            diff = float(np.max(np.abs(got - want))) if got.size else 0.0
            assert diff <= TOLERANCE, f"{name} at (batch={batch}, seq={seq}, past={past}, pad={padding}): {diff:.2e}"
