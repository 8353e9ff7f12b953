"""EP profiles are data the pipeline can rely on."""

from __future__ import annotations

import dataclasses

import pytest

from ep_profiles import PROFILES, EpProfile, get_profile
from ep_profiles.profile import GROUP_QUERY_ATTENTION, PLAIN_ATTENTION
from ep_profiles.registry import UnknownProfileError
from exporter.errors import ExporterError
from exporter.onnx_passes.norm_fusions import KNOWN_NORM_FUSIONS
from exporter.precisions import PRECISIONS

pytestmark = pytest.mark.l1


def test_every_ep_the_issue_names_has_a_profile():
    assert set(PROFILES) == {"cpu", "cuda", "dml", "webgpu", "trt-rtx"}


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_profile_is_consistent(name):
    profile = get_profile(name)
    assert profile.name == name
    assert profile.precisions and set(profile.precisions) <= set(PRECISIONS)
    assert profile.attention_op in (GROUP_QUERY_ATTENTION, PLAIN_ATTENTION)
    assert set(profile.attention_op_precisions) <= set(profile.precisions)
    assert set(profile.norm_fusions) <= set(KNOWN_NORM_FUSIONS)
    assert bool(profile.genai_provider) == (name != "cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        profile.name = "other"  # type: ignore[misc]


def test_attention_op_follows_the_precision():
    cuda = get_profile("cuda")
    assert not cuda.runs_attention_op_at("fp32")
    assert cuda.runs_attention_op_at("fp16")
    assert get_profile("cpu").runs_attention_op_at("fp32")
    assert not get_profile("cpu").with_plain_attention().runs_attention_op_at("fp32")


def test_webgpu_profile_states_its_limits_as_data():
    webgpu = get_profile("webgpu")
    assert webgpu.max_buffer_size == 256 * 2**20
    assert webgpu.graph_capture and webgpu.genai_provider_options()["enableGraphCapture"] == "1"
    # What scripts/probe_attention_kernels.py measured on lavapipe: the window and the softcap are
    # dropped (so the plan routes those layers into the graph), the rest honoured.
    kernel = webgpu.attention_kernel
    assert (kernel.window_in_every_call, kernel.softcap, kernel.head_sink, kernel.fused_qk_norm) == (False, False, True, True)
    assert kernel.kv_cache_bit_widths == () and kernel.multi_head_attention_rows == 31 and "lavapipe" in kernel.measured
    assert webgpu.genai_provider_options(graph_capture=False) == {"enableGraphCapture": "0"}  # validation stays
    assert get_profile("cpu").genai_provider_options() == {}


def test_bad_profiles_are_refused():
    with pytest.raises(ValueError, match="graph_capture_option"):
        EpProfile("x", "", "CPUExecutionProvider", ("fp32",), "x", graph_capture=True)


def test_unknown_eps_are_named():
    with pytest.raises(UnknownProfileError, match="unknown EP 'tpu'; use one of: cpu, cuda, dml, webgpu, trt-rtx"):
        get_profile("tpu")


def test_genai_config_follows_the_profile(preset_exports):
    """Provider options (graph capture included) and a profile's max_length cap reach genai_config."""
    from exporter.package.genai_config import build_genai_config
    from exporter.plan import export_settings
    from exporter.sessions import DecoderSession

    exported = preset_exports.get("tiny-gemma-4")
    layout, generation = exported.package.layout, exported.model.generation_config
    capped = dataclasses.replace(get_profile("webgpu"), max_length=64)
    decoder = DecoderSession()

    def genai_config(profile, graph_capture=True, max_length=None):
        settings = export_settings(profile, layout, "fp32", graph_capture=graph_capture, max_length=max_length)
        sections = {"decoder": decoder.genai_section(settings, ["input_ids", "attention_mask"])}
        return build_genai_config(settings, generation, sections)

    config = genai_config(capped)
    assert config["model"]["context_length"] == config["search"]["max_length"] == 64 < layout.context_length
    assert config["model"]["decoder"]["session_options"]["provider_options"] == [
        {"webgpu": {"enableGraphCapture": "1", "validationMode": "disabled"}}]
    assert config["search"]["past_present_share_buffer"] is True
    cuda = genai_config(get_profile("cuda"))
    assert cuda["model"]["decoder"]["session_options"]["provider_options"] == [{"cuda": {"enable_cuda_graph": "0"}}]
    assert cuda["model"]["context_length"] == layout.context_length
    uncaptured = genai_config(capped, graph_capture=False)
    assert uncaptured["model"]["decoder"]["session_options"]["provider_options"] == [
        {"webgpu": {"enableGraphCapture": "0"}}]
    # The caller's max_length replaces the profile's default cap, up to the model's own.
    assert genai_config(capped, max_length=96)["model"]["context_length"] == 96
    with pytest.raises(ExporterError, match="over the model's context length"):
        genai_config(capped, max_length=layout.context_length + 1)


def test_generation_settings_keep_a_set_zero(preset_exports):
    """transformers' top_k 0 means no top-k filter, and an explicit 0 is not "unset"."""
    import transformers

    from exporter.package.genai_config import build_genai_config
    from exporter.plan import export_settings

    layout = preset_exports.get("tiny-gemma-4").package.layout
    generation = transformers.GenerationConfig(top_k=0, top_p=0.9, temperature=0.7, do_sample=True, eos_token_id=[1, 106])
    config = build_genai_config(export_settings(get_profile("cpu"), layout, "fp32"), generation, {})
    assert config["search"]["top_k"] == layout.vocab_size
    assert (config["search"]["top_p"], config["search"]["temperature"]) == (0.9, 0.7)
    assert config["model"]["eos_token_id"] == [1, 106]


def test_a_model_without_a_bos_token_leaves_it_out(preset_exports):
    """ONNX Runtime GenAI 0.18 refuses a null bos_token_id ("Expected a number but saw a null") and
    loads a config without one (measured on a gpt-oss package); a model without one omits it."""
    import transformers

    from exporter.package.genai_config import build_genai_config
    from exporter.plan import export_settings

    layout = preset_exports.get("tiny-gemma-4").package.layout
    settings = export_settings(get_profile("cpu"), layout, "fp32")
    without = build_genai_config(settings, transformers.GenerationConfig(eos_token_id=1), {})
    assert "bos_token_id" not in without["model"]
    with_bos = build_genai_config(settings, transformers.GenerationConfig(eos_token_id=1, bos_token_id=2), {})
    assert with_bos["model"]["bos_token_id"] == 2
