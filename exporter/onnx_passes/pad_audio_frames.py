"""Pad a session's frames to the multiple its trace took (the speech session's 4), as masked frames,
before anything reads them.

torch.export traces Gemma 4's audio tower only for frame counts divisible by 4
(``exporter.sessions.speech``), and ONNX Runtime GenAI feeds whatever count the log-mel gives (199
for 2 s of audio). A padded frame is zero and masked: the tower's convolutions see it as the zero
padding they would add anyway, attention never reads it, and its output rows are dropped with the
rest of the padding, so the real frames' features and their count (ceil(ceil(T / 2) / 2)) stay as
they were.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

FRAMES_DIM = "audio_frames"


class PadAudioFrames:
    name = "pad_audio_frames"

    def applies(self, settings, session) -> str | None:
        if not session.traced_frame_multiple:
            return None
        return (f"the {session.name} session was traced for frame counts divisible by "
                f"{session.traced_frame_multiple}; GenAI feeds any count")

    def __call__(self, model: ir.Model, settings, session) -> dict[str, int]:
        graph = model.graph
        features, mask = graph.inputs[0], graph.inputs[1]
        if (features.name, mask.name) != ("input_features", "input_features_mask"):
            raise RuntimeError(f"{self.name}: expected the speech inputs, found {features.name}, {mask.name}")
        tape = ir.tape.Tape(graph)
        frames = tape.op("Shape", [features], attributes={"start": 1, "end": 2})
        multiple = tape.initializer(ir.tensor(np.array([session.traced_frame_multiple], dtype=np.int64), name="pad_audio_frames.multiple"))
        zero = tape.initializer(ir.tensor(np.array([0], dtype=np.int64), name="pad_audio_frames.zero"))
        missing = tape.op("Mod", [tape.op("Sub", [multiple, tape.op("Mod", [frames, multiple])]), multiple])
        padded_features = tape.op("Pad", [features, tape.op("Concat", [zero, zero, zero, zero, missing, zero],
                                                              attributes={"axis": 0})])
        # ONNX Runtime's Pad has no bool kernel: pad the mask as uint8.
        mask_bytes = tape.op("Cast", [mask], attributes={"to": ir.DataType.UINT8})
        padded_bytes = tape.op("Pad", [mask_bytes, tape.op("Concat", [zero, zero, zero, missing], attributes={"axis": 0})])
        padded_mask = tape.op("Cast", [padded_bytes], attributes={"to": ir.DataType.BOOL})
        new_nodes = set(tape.nodes)
        for old, new in ((features, padded_features), (mask, padded_mask)):
            for user, index in list(old.uses()):
                if user not in new_nodes:
                    user.replace_input_with(index, new)
        for node in reversed(tape.nodes):
            graph.insert_before(graph[0], node) if len(graph) else graph.append(node)
        for value in (features, mask):
            dims = list(value.shape)
            dims[1] = ir.SymbolicDim(FRAMES_DIM)
            value.shape = ir.Shape(dims)
        return {"inputs_padded": 2}
