"""The export's last check of a half-precision package: one prefill of a sample prompt through ONNX
Runtime GenAI on the CPU EP, at the package's own precision, whose logits must be finite.

An fp16 package can overflow where its float32 model does not (a real Gemma 3 270M's residual
stream reaches 104,000; fp16 ends at 65,504), and then every logit is NaN and every token
``<pad>``. The residual scale (``onnx_passes.scale_residual_stream``) prevents what calibration
saw; this check refuses, before the package replaces ``-o``, whatever it did not. fp32 packages
are not run (float32 does not overflow where the model does not), nor bf16 ones (no CPU kernel
runs bf16), nor packages whose weights would take more memory than ``MAX_WEIGHT_BYTES``: the
report then says it was skipped.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from exporter.errors import ExporterError
from exporter.load.activation_ranges import CALIBRATION_PROMPTS

# The CPU EP holds an fp16 package's weights, and converts some to fp32: a full-size Gemma 4 E2B
# (about 10 GB at fp16) would not fit beside the export on a 24 GiB machine.
MAX_WEIGHT_BYTES = 4 << 30


class NonFiniteLogits(ExporterError):
    pass


def run_sample_prefill(package: Path, tokenizer: Any, weight_bytes: int) -> dict[str, Any]:
    """Prefill CALIBRATION_PROMPTS[0] on the CPU EP and return what the report records; raises
    NonFiniteLogits naming the session, the step and the counts where a logit is NaN or infinite."""
    from exporter.verify.check_against import greedy_with_logits
    from exporter.verify.distribution import nonfinite

    if weight_bytes > MAX_WEIGHT_BYTES:
        return {"skipped": f"{weight_bytes / (1 << 30):.1f} GiB of weights: more than the "
                           f"{MAX_WEIGHT_BYTES >> 30} GiB this check loads on the CPU"}
    prompt = CALIBRATION_PROMPTS[0]
    ids = [int(i) for i in tokenizer(prompt)["input_ids"]]
    start = time.perf_counter()
    generation = greedy_with_logits(package, [ids], new_tokens=1, on_cpu=True)[0]
    logits = generation.logits[0]
    if counts := nonfinite(logits):
        raise NonFiniteLogits(
            f"the decoder's logits are not finite on the sample prompt {prompt!r} at step 0 (prefill), run on the "
            f"CPU EP: {counts}; the package would generate garbage, so it was not written. Its activations "
            "pass fp16's range where calibration did not see it: export at --precision fp32 (or bf16 where the "
            "EP runs it), and please report the model")
    return {"prompt": prompt, "prompt_tokens": len(ids), "max_abs_logit": round(float(abs(logits).max()), 4),
            "seconds": round(time.perf_counter() - start, 3)}
