"""The golden plan: which passes run where, for every profile x precision, written out.

The first file to read to see what runs where. Each row is (model, EP, precision) -> the decoder
session's FX passes and ONNX passes, in order."""

from __future__ import annotations

import json

import pytest

from ep_profiles import get_profile
from exporter.cli import main
from exporter.load.layout import derive_layout
from exporter.load.presets import build_preset
from exporter.plan import export_settings, make_plan
from exporter.precisions import int4_options

pytestmark = pytest.mark.unit

CLEANUP = ["drop_runtime_asserts", "drop_noop_casts", "fold_untranslatable_constants", "complex_as_real_pairs"]
GQA = "substitute_group_query_attention"
MOE = "substitute_mixture_of_experts"
SPLIT = "split_oversized_weights"
LAST_TOKEN = "gather_last_token"
TRUNCATE = "truncate_shared_kv_layers"

LOWERED = ["inline_functions", "fold_weight_transposes", "fold_constants"]
CAPTURE = ["static_reshape_targets"]
TIDY_AND_FUSE = ["tidy", "fuse_rms_norms", "fuse_skip_rms_norms", "fold_fusion_constants"]
# KV-shared layers (Gemma 4) without the present outputs nobody reads, and on one query per row as
# MatMul/Softmax, where the EP's kernel was run so.
TIDY_OMIT_AND_FUSE = [TIDY_AND_FUSE[0], "omit_unread_presents", "matmul_kv_shared_attention", *TIDY_AND_FUSE[1:]]
INT4 = ["quantize_weights"]  # int4 and int8
# fp16 activations (fp16, and int4 on every profile but cpu): the decoder's residual stream scaled
# into fp16's range by the power of two its float32 peaks need.
SCALE = ["scale_residual_stream"]

GEMMA4_FX = [*CLEANUP, GQA, LAST_TOKEN, TRUNCATE]
LLAMA_FX = [*CLEANUP, GQA, LAST_TOKEN]
ONNX = [*LOWERED, *TIDY_AND_FUSE]
ONNX_CAPTURED = [*LOWERED, *CAPTURE, *TIDY_AND_FUSE]
ONNX_BF16 = [*LOWERED, "widen_unsupported_dtypes", *TIDY_AND_FUSE]
ONNX_SHARED_KV = [*LOWERED, *TIDY_OMIT_AND_FUSE]
ONNX_FP16 = ONNX + SCALE
ONNX_CAPTURED_FP16 = ONNX_CAPTURED + SCALE

GOLDEN = {
    ("tiny-gemma-4", "cpu", "fp32"): (GEMMA4_FX, ONNX_SHARED_KV),
    ("tiny-gemma-4", "cpu", "int4"): (GEMMA4_FX, ONNX_SHARED_KV + INT4),
    ("tiny-gemma-4", "cpu", "int8"): (GEMMA4_FX, ONNX_SHARED_KV + INT4),
    ("tiny-gemma-4", "cuda", "fp16"): (GEMMA4_FX, ONNX_FP16),
    ("tiny-gemma-4", "cuda", "bf16"): (GEMMA4_FX, ONNX_BF16),
    ("tiny-gemma-4", "cuda", "fp32"): ([*CLEANUP, LAST_TOKEN, TRUNCATE], ONNX),  # no fp32 GroupQueryAttention
    ("tiny-gemma-4", "cuda", "int4"): (GEMMA4_FX, ONNX_FP16 + INT4),
    ("tiny-gemma-4", "dml", "fp16"): (GEMMA4_FX, ONNX_FP16),
    ("tiny-gemma-4", "dml", "fp32"): (GEMMA4_FX, ONNX),
    ("tiny-gemma-4", "dml", "int4"): (GEMMA4_FX, ONNX_FP16 + INT4),
    ("tiny-gemma-4", "webgpu", "fp16"): ([*CLEANUP, SPLIT, GQA, LAST_TOKEN, TRUNCATE], ONNX_CAPTURED_FP16),
    ("tiny-gemma-4", "webgpu", "fp32"): ([*CLEANUP, SPLIT, GQA, LAST_TOKEN, TRUNCATE], ONNX_CAPTURED),
    ("tiny-gemma-4", "webgpu", "int4"): ([*CLEANUP, SPLIT, GQA, LAST_TOKEN, TRUNCATE], ONNX_CAPTURED_FP16 + INT4),
    ("tiny-gemma-4", "webgpu", "int8"): ([*CLEANUP, SPLIT, GQA, LAST_TOKEN, TRUNCATE], ONNX_CAPTURED_FP16 + INT4),
    ("tiny-gemma-4", "trt-rtx", "fp16"): (GEMMA4_FX, ONNX_FP16),
    ("tiny-gemma-4", "trt-rtx", "bf16"): (GEMMA4_FX, ONNX_BF16),
    ("tiny-gemma-4", "trt-rtx", "fp32"): ([*CLEANUP, LAST_TOKEN, TRUNCATE], ONNX),
    ("tiny-gemma-4", "trt-rtx", "int4"): (GEMMA4_FX, ONNX_FP16 + INT4),
    ("tiny-llama", "cpu", "fp32"): (LLAMA_FX, ONNX),
    ("tiny-llama", "cpu", "int4"): (LLAMA_FX, ONNX + INT4),
    ("tiny-llama", "cpu", "int8"): (LLAMA_FX, ONNX + INT4),
    ("tiny-llama", "cuda", "fp16"): (LLAMA_FX, ONNX_FP16),
    ("tiny-llama", "cuda", "bf16"): (LLAMA_FX, ONNX_BF16),
    ("tiny-llama", "cuda", "fp32"): ([*CLEANUP, LAST_TOKEN], ONNX),
    ("tiny-llama", "cuda", "int4"): (LLAMA_FX, ONNX_FP16 + INT4),
    ("tiny-llama", "dml", "fp16"): (LLAMA_FX, ONNX_FP16),
    ("tiny-llama", "dml", "fp32"): (LLAMA_FX, ONNX),
    ("tiny-llama", "dml", "int4"): (LLAMA_FX, ONNX_FP16 + INT4),
    ("tiny-llama", "webgpu", "fp16"): ([*CLEANUP, SPLIT, GQA, LAST_TOKEN], ONNX_CAPTURED_FP16),
    ("tiny-llama", "webgpu", "fp32"): ([*CLEANUP, SPLIT, GQA, LAST_TOKEN], ONNX_CAPTURED),
    ("tiny-llama", "webgpu", "int4"): ([*CLEANUP, SPLIT, GQA, LAST_TOKEN], ONNX_CAPTURED_FP16 + INT4),
    ("tiny-llama", "webgpu", "int8"): ([*CLEANUP, SPLIT, GQA, LAST_TOKEN], ONNX_CAPTURED_FP16 + INT4),
    ("tiny-llama", "trt-rtx", "fp16"): (LLAMA_FX, ONNX_FP16),
    ("tiny-llama", "trt-rtx", "bf16"): (LLAMA_FX, ONNX_BF16),
    ("tiny-llama", "trt-rtx", "fp32"): ([*CLEANUP, LAST_TOKEN], ONNX),
    ("tiny-llama", "trt-rtx", "int4"): (LLAMA_FX, ONNX_FP16 + INT4),
    # Routed experts become ONNX Runtime's MoE where its kernel was run: the CPU's MoE and QMoE, and
    # WebGPU's QMoE (its MoE runs on the CPU, so webgpu fp16 keeps the experts traced).
    ("tiny-qwen3-moe", "cpu", "fp32"): ([*CLEANUP, GQA, MOE, LAST_TOKEN], ONNX),
    ("tiny-qwen3-moe", "cpu", "int4"): ([*CLEANUP, GQA, MOE, LAST_TOKEN], ONNX + INT4),
    ("tiny-qwen3-moe", "cuda", "fp16"): (LLAMA_FX, ONNX_FP16),
    ("tiny-qwen3-moe", "webgpu", "fp16"): ([*CLEANUP, SPLIT, GQA, LAST_TOKEN], ONNX_CAPTURED_FP16),
    ("tiny-qwen3-moe", "webgpu", "int4"): ([*CLEANUP, SPLIT, GQA, MOE, LAST_TOKEN], ONNX_CAPTURED_FP16 + INT4),
}

_LAYOUTS = {}


def _plan(model: str, ep: str, precision: str, **options):
    if model not in _LAYOUTS:
        _LAYOUTS[model] = derive_layout(build_preset(model)[0])
    profile = get_profile(ep)
    settings = export_settings(profile, _LAYOUTS[model], precision, int4=int4_options(profile, precision, None),
                               **options)
    return make_plan(settings)


@pytest.mark.l1
@pytest.mark.parametrize("key", list(GOLDEN), ids=["/".join(k) for k in GOLDEN])
def test_golden_plan(key):
    fx, onnx = GOLDEN[key]
    (session,) = _plan(*key).sessions
    assert session.name == "decoder"
    assert [p.name for p in session.fx_passes] == fx
    assert [p.name for p in session.onnx_passes] == onnx
    assert all(p.why for p in (*session.fx_passes, *session.onnx_passes))


@pytest.mark.l1
def test_every_profile_and_precision_has_a_golden_row():
    from ep_profiles import PROFILES

    assert {(m, name, p) for m in ("tiny-gemma-4", "tiny-llama") for name, profile in PROFILES.items()
            for p in profile.precisions} == {key for key in GOLDEN if key[0] != "tiny-qwen3-moe"}


@pytest.mark.l1
def test_options_change_the_plan():
    full = _plan("tiny-gemma-4", "webgpu", "fp16", full_logits=True, graph_capture=False).sessions[0]
    assert [p.name for p in full.fx_passes] == [*CLEANUP, SPLIT, GQA]
    assert "static_reshape_targets" not in [p.name for p in full.onnx_passes]
    # --full-logits runs every prompt token through the KV-shared layers: they keep GroupQueryAttention.
    full_cpu = _plan("tiny-gemma-4", "cpu", "fp32", full_logits=True).sessions[0]
    assert [p.name for p in full_cpu.onnx_passes] == [*LOWERED, *TIDY_AND_FUSE[:1], "omit_unread_presents",
                                                      *TIDY_AND_FUSE[1:]]


@pytest.mark.l1
def test_plan_command_lists_sessions_and_passes(capsys):
    assert main(["plan", "tiny-gemma-4", "--ep", "webgpu", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["ep"], plan["precision"], plan["graph_capture"]) == ("webgpu", "fp16", True)
    (decoder,) = plan["sessions"]
    assert decoder["name"] == "decoder"
    assert [p["name"] for p in decoder["fx_passes"]] == GOLDEN[("tiny-gemma-4", "webgpu", "fp16")][0]
    assert decoder["onnx_passes"][3] == {"name": "static_reshape_targets",
                                         "why": "a captured graph runs no shape arithmetic on the CPU"}
    assert main(["plan", "tiny-gemma-4", "--ep", "tpu"]) == 2


# The multimodal package: each session's (FX passes, ONNX passes). The decoder gets every decoder
# pass; the encoders none of them; only the decoder is captured; int4 leaves the encoders alone
# unless asked (int4_encoders), and quantizes the embedding session's tables. The towers (vision,
# speech) fold constants but leave nodes that read weights for run time.
ENCODER_FX = [*CLEANUP]
ENCODER_FX_WEBGPU = [*CLEANUP, SPLIT]
TOWER_ONNX = ["inline_functions", "fold_weight_transposes", "fold_tower_constants", "tidy", "fuse_rms_norms",
              "fuse_skip_rms_norms", "fold_tower_fusion_constants"]
SPEECH_ONNX = [TOWER_ONNX[0], "pad_audio_frames", *TOWER_ONNX[1:]]
MULTIMODAL_GOLDEN = {
    ("cpu", "fp32", False): {
        "decoder": (GEMMA4_FX, ONNX_SHARED_KV),
        "embedding": (ENCODER_FX, ONNX),
        "vision": (ENCODER_FX, TOWER_ONNX),
        "speech": (ENCODER_FX, SPEECH_ONNX),
    },
    ("webgpu", "int4", False): {
        "decoder": ([*CLEANUP, SPLIT, GQA, LAST_TOKEN, TRUNCATE], ONNX_CAPTURED_FP16 + INT4),
        "embedding": (ENCODER_FX_WEBGPU, ONNX + INT4),
        "vision": (ENCODER_FX_WEBGPU, TOWER_ONNX),
        "speech": (ENCODER_FX_WEBGPU, SPEECH_ONNX),
    },
    ("cpu", "int4", True): {
        "decoder": (GEMMA4_FX, ONNX_SHARED_KV + INT4),
        "embedding": (ENCODER_FX, ONNX + INT4),
        "vision": (ENCODER_FX, TOWER_ONNX + INT4),
        "speech": (ENCODER_FX, SPEECH_ONNX + INT4),
    },
}


@pytest.mark.l1
@pytest.mark.parametrize("key", list(MULTIMODAL_GOLDEN), ids=["/".join(map(str, k)) for k in MULTIMODAL_GOLDEN])
def test_golden_multimodal_plan(key):
    from exporter.load.multimodal import multimodal_facts
    from exporter.load.presets import PRESETS

    ep, precision, int4_encoders = key
    preset = PRESETS["tiny-gemma-4-multimodal"]
    facts = multimodal_facts(preset.make_config(), preset.processor_settings, "preset")
    plan = _plan("tiny-gemma-4-multimodal", ep, precision, multimodal=facts, int4_encoders=int4_encoders)
    assert {s.name: ([p.name for p in s.fx_passes], [p.name for p in s.onnx_passes]) for s in plan.sessions} == \
        {name: tuple(passes) for name, passes in MULTIMODAL_GOLDEN[key].items()}
