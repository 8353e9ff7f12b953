"""The Gemma 4 multimodal package: decoder, embedding, vision and speech sessions.

The checkpoint is tiny-gemma-4-multimodal (every constant saved tensor already moved by the preset,
clip bounds finite), saved by ``save_pretrained`` with the processor settings laid out like Google's
(one ``processor_config.json`` with ``image_processor`` and ``feature_extractor`` sections), and
exported from that folder with its weights streamed. ONNX Runtime GenAI's own processor turns a PNG
and a 16 kHz WAV written here into the package's inputs; transformers' ``from_pretrained`` of the
folder, fed the very tensors GenAI's processor made, is the reference.

Tolerance: 1e-4 on the prefill logits of an fp32 package (measured ~6e-7: the same fp32 math in a
different order; logits here are O(1)), and the 16 greedy tokens equal.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
import transformers

from ep_profiles import get_profile
from exporter import export
from exporter.load.layout import derive_layout
from exporter.load.multimodal import read_processor_settings
from exporter.load.presets import PRESETS, build_preset, train_tokenizer
from exporter.verify.check import check_package
from exporter.verify.ep_runtime import genai_config
from exporter.verify.sample_media import gradient_image, tone, write_png, write_wav
from tests.helpers.checkpoints import (
    MULTIMODAL_PRESET,
    constant_saved_tensors,
    save_checkpoint,
    save_multimodal_checkpoint,
)
from tests.helpers.webgpu import WEBGPU, require_webgpu

pytestmark = pytest.mark.xdist_group("multimodal")

PRESET = MULTIMODAL_PRESET
NEW_TOKENS = 16
LOGITS_TOLERANCE = 1e-4
CASES = {  # prompt, images (how many), audio?
    "text": ("Alice was beginning to get very tired", 0, False),
    "image": ("<|image|> What is in the picture?", 1, False),
    "audio": ("<|audio|> What is said?", 0, True),
    "image_audio": ("<|image|><|audio|> Describe both.", 1, True),
    "two_images": ("<|image|> or <|image|>: which is darker?", 2, False),
}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return save_multimodal_checkpoint(tmp_path_factory.mktemp("multimodal") / "checkpoint")


@pytest.fixture(scope="module")
def reference(checkpoint):
    return transformers.Gemma4ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def package(checkpoint, tmp_path_factory):
    return export(str(checkpoint), ep="cpu", precision="fp32", strict=True,
                  output_dir=tmp_path_factory.mktemp("multimodal") / "package")


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("media")
    return {"image": write_png(folder / "image.png", gradient_image()),
            "other_image": write_png(folder / "other.png", 255 - gradient_image(seed=1)),
            "tall_image": write_png(folder / "tall.png", gradient_image(200, 90, seed=2)),
            "audio": write_wav(folder / "audio.wav", tone())}


def genai_run(package_path: Path, prompt: str, image: Path | list[Path] | None, audio: Path | None,
              on_cpu: bool = True):
    """GenAI's processor and greedy generation: (the processor's tensors, prefill logits, new tokens)."""
    import onnxruntime_genai as og

    images = [image] if isinstance(image, Path) else list(image or [])
    model = og.Model(genai_config(package_path, on_cpu))
    processor = model.create_multimodal_processor()
    inputs = processor(prompt, images=og.Images.open(*map(str, images)) if images else None,
                       audios=og.Audios.open(str(audio)) if audio else None)
    tensors = {name: inputs[name].as_numpy() for name in ("input_ids", "pixel_values", "pixel_position_ids",
                                                          "audio_embeds") if _has(inputs, name)}
    length = tensors["input_ids"].shape[-1]
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=length + NEW_TOKENS, do_sample=False, repetition_penalty=1.0, min_length=0)
    generator = og.Generator(model, params)
    generator.set_inputs(inputs)
    generator.generate_next_token()
    prefill = np.array(generator.get_output("logits"), dtype=np.float32).reshape(-1)
    while not generator.is_done():
        generator.generate_next_token()
    return tensors, prefill, generator.get_sequence(0)[length:].tolist()


def _has(inputs, name: str) -> bool:
    try:
        inputs[name]
    except Exception:
        return False
    return True


def transformers_run(model, tensors: dict[str, np.ndarray]):
    """transformers fed GenAI's tensors: (prefill logits of the last token, greedy new tokens)."""
    kwargs = {"input_ids": torch.from_numpy(tensors["input_ids"]).long()}
    if "pixel_values" in tensors:
        kwargs["pixel_values"] = torch.from_numpy(tensors["pixel_values"]).float()
        kwargs["image_position_ids"] = torch.from_numpy(tensors["pixel_position_ids"]).long()
    if "audio_embeds" in tensors:
        features = torch.from_numpy(tensors["audio_embeds"]).float()
        kwargs["input_features"] = features
        kwargs["input_features_mask"] = torch.ones(features.shape[:2], dtype=torch.bool)
    with torch.no_grad():
        logits = model(**kwargs).logits[0, -1].numpy()
        generated = model.generate(**kwargs, max_new_tokens=NEW_TOKENS, do_sample=False)
    return logits, generated[0, kwargs["input_ids"].shape[1]:].tolist()


@pytest.mark.l1
def test_the_preset_checkpoint_moves_every_constant(reference):
    """Every saved tensor init leaves constant (scalars such as ``layer_scalar`` included) differs
    from its init value in the saved checkpoint, and the clip bounds are finite."""
    fresh = transformers.Gemma4ForConditionalGeneration(reference.config).state_dict()
    saved = reference.state_dict()
    constants = constant_saved_tensors(transformers.Gemma4ForConditionalGeneration(reference.config))
    assert any(name.endswith("layer_scalar") for name in constants)
    assert [name for name in constants if bool((saved[name] == fresh[name]).any())] == []
    clip_bounds = [t for name, t in saved.items() if name.endswith(("_min", "_max"))]
    assert clip_bounds and all(bool(torch.isfinite(t).all()) for t in clip_bounds)


@pytest.mark.l1
def test_package_has_four_sessions_and_gemma4_config(package):
    config = json.loads((package.path / "genai_config.json").read_text())["model"]
    assert config["type"] == "gemma4"
    assert [s for s in ("decoder", "embedding", "vision", "speech") if s in config] == [
        "decoder", "embedding", "vision", "speech"]
    assert list(package.report.sessions) == ["decoder", "embedding", "vision", "speech"]
    assert config["decoder"]["inputs"]["per_layer_inputs"] == "per_layer_inputs"
    assert config["embedding"]["outputs"]["per_layer_inputs"] == "per_layer_inputs"
    for name in ("decoder", "embedding", "vision", "speech"):
        assert (package.path / config[name]["filename"]).is_file()
    vision = onnx.load(str(package.path / config["vision"]["filename"]), load_external_data=False)
    pixel_values = next(i for i in vision.graph.input if i.name == "pixel_values")
    assert pixel_values.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    # Every tensor of the checkpoint is read by some session (the export ran with strict=True).
    assert not any("not read" in note or "no tensor of the model" in note for note in package.report.notes)


@pytest.mark.l1
def test_processor_configs_come_from_the_checkpoint(checkpoint, tmp_path):
    folder = tmp_path / "checkpoint"
    shutil.copytree(checkpoint, folder)
    settings = json.loads((folder / "processor_config.json").read_text())
    settings["image_processor"]["max_soft_tokens"] = 140
    settings["feature_extractor"]["mel_floor"] = 0.01
    settings["feature_extractor"]["max_frequency"] = 7600
    (folder / "processor_config.json").write_text(json.dumps(settings))
    from exporter.load.multimodal import multimodal_facts, speech_processor_json, vision_processor_json

    facts = multimodal_facts(transformers.AutoConfig.from_pretrained(folder), read_processor_settings(folder), "test")
    vision = vision_processor_json(facts)["processor"]["transforms"][1]["operation"]["attrs"]
    assert vision == {"patch_size": 16, "max_soft_tokens": 140, "pooling_kernel_size": 3}
    log_mel = speech_processor_json(facts)["feature_extraction"]["sequence"][1]["operation"]["attrs"]
    assert log_mel["mel_floor"] == 0.01 and log_mel["max_frequency"] == 7600.0
    assert isinstance(log_mel["max_frequency"], float) and isinstance(log_mel["feature_size"], int)


@pytest.mark.l1
def test_tokenizer_without_gemma4_markers_is_refused(tmp_path):
    folder = save_multimodal_checkpoint(tmp_path / "checkpoint", tokenizer=train_tokenizer(512))
    result = subprocess.run([sys.executable, "-m", "exporter", str(folder), "-o", str(tmp_path / "out")], check=False,
                            capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 2, result.stderr
    assert "the tokenizer splits '<|image>'" in result.stderr and "--text-only" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.l1
def test_speech_keeps_bias_add_out_of_skip_norms(package):
    """The audio tower ends in ``output_proj`` (a MatMul with a 1-D bias) and the audio embedder's
    RMSNorm reads it: the skip-norm fusion must not take the bias for a residual (its rank guard;
    ``test_onnx_fusions`` tests the guard itself). Here: the Add stays and feeds the norm, and no
    skip norm anywhere reads a 1-D input. The audio cases of ``test_genai_matches_transformers``
    run this graph."""
    graph = onnx.load(str(package.session_path("speech")), load_external_data=False).graph
    ranks = {i.name: len(i.dims) for i in graph.initializer}
    producers = {output: node for node in graph.node for output in node.output}
    bias_adds = [n for n in graph.node if n.op_type == "Add" and any(ranks.get(x) == 1 for x in n.input)
                 and any(producers.get(x) is not None and producers[x].op_type in ("MatMul", "FusedMatMul")
                         for x in n.input)]
    assert bias_adds, "the audio tower's output_proj (MatMul + bias Add) was not found"
    readers = {node.op_type for node in graph.node for add in bias_adds if add.output[0] in node.input}
    assert readers & {"Pow", "SimplifiedLayerNormalization"}, readers  # the embedder's RMSNorm
    for node in graph.node:
        if node.op_type == "SkipSimplifiedLayerNormalization":
            assert all(ranks.get(x) != 1 for x in node.input[:2]), node.name


@pytest.mark.l1
def test_a_package_without_audio_keeps_an_empty_speech_section():
    """ONNX Runtime GenAI 0.18 refuses a gemma4 package without a speech section (measured)."""
    from exporter.load.multimodal import multimodal_facts
    from exporter.package.genai_config import build_genai_config
    from exporter.plan import export_settings

    preset = PRESETS[PRESET]
    config = preset.make_config()
    facts = multimodal_facts(config, preset.processor_settings, "test")
    facts = dataclasses.replace(facts, log_mel=None)
    model, _ = build_preset("tiny-gemma-4")
    layout = derive_layout(model)
    settings = export_settings(get_profile("cpu"), layout, "fp32", multimodal=facts)
    built = build_genai_config(settings, model.generation_config, {"decoder": {}})
    assert built["model"]["speech"] == {"config_filename": ""} and built["model"]["type"] == "gemma4"


@pytest.mark.l3
@pytest.mark.l4
@pytest.mark.parametrize("case", list(CASES))
def test_genai_matches_transformers(package, reference, media, case):
    prompt, images, with_audio = CASES[case]
    tensors, prefill, tokens = genai_run(package.path, prompt, [media["image"], media["tall_image"]][:images],
                                         media["audio"] if with_audio else None)
    assert ("pixel_values" in tensors) == bool(images) and ("audio_embeds" in tensors) == with_audio
    if images > 1:  # one row of patches per image (GenAI's processor resizes both to as many patches)
        assert tensors["pixel_values"].shape[0] == images
    expected_logits, expected_tokens = transformers_run(reference, tensors)
    assert np.abs(prefill - expected_logits).max() < LOGITS_TOLERANCE
    assert tokens == expected_tokens


@pytest.mark.l3
def test_vision_ignores_padding_patches(package, media):
    """Patches at position (-1, -1) (what a batch of images of different sizes is padded with)
    change no image feature."""
    import onnxruntime as ort

    tensors, _, _ = genai_run(package.path, CASES["image"][0], media["image"], None)
    session = ort.InferenceSession(str(package.session_path("vision")), providers=["CPUExecutionProvider"])
    pixels, positions = tensors["pixel_values"], tensors["pixel_position_ids"]
    padding = 27
    padded_pixels = np.concatenate([pixels, np.full((1, padding, pixels.shape[-1]), 0.5, np.float32)], axis=1)
    padded_positions = np.concatenate([positions, np.full((1, padding, 2), -1, positions.dtype)], axis=1)
    plain = session.run(None, {"pixel_values": pixels, "pixel_position_ids": positions})[0]
    padded = session.run(None, {"pixel_values": padded_pixels, "pixel_position_ids": padded_positions})[0]
    assert padded.shape == plain.shape
    np.testing.assert_allclose(padded, plain, atol=1e-5, equal_nan=False)


@pytest.mark.l4
def test_the_image_changes_the_logits(package, media):
    """A package that ignored its image (or fed the decoder no image features) would pass a
    comparison on one image by luck no more than once: two images must give different logits."""
    prompt = CASES["image"][0]
    _, first, _ = genai_run(package.path, prompt, media["image"], None)
    _, second, _ = genai_run(package.path, prompt, media["other_image"], None)
    assert np.abs(first - second).max() > 100 * LOGITS_TOLERANCE


@pytest.mark.l3
def test_a_placeholder_token_without_features_keeps_the_pad_embedding(package, reference):
    """A decode step whose token is an image or audio placeholder (the model generated it) comes
    with 0 feature rows: the embedding session gives the pad token's embeddings there, as
    transformers does without pixel values or audio (it used to fail in ScatterND)."""
    import onnxruntime as ort

    config = reference.config
    session = ort.InferenceSession(str(package.path / "embedding" / "model.onnx"), providers=["CPUExecutionProvider"])
    hidden = config.text_config.hidden_size
    no_rows = np.zeros((0, hidden), dtype=np.float32)
    image, audio, pad = config.image_token_id, config.audio_token_id, config.text_config.pad_token_id
    ids = np.array([[image, 42, audio]], dtype=np.int64)
    embeds, per_layer = session.run(None, {"input_ids": ids, "image_features": no_rows, "audio_features": no_rows})
    with torch.no_grad():
        want = reference.model(input_ids=torch.from_numpy(ids), inputs_embeds=None, attention_mask=None,
                               use_cache=False, output_hidden_states=True)
    padded = np.array([[pad, 42, pad]], dtype=np.int64)
    pad_embeds, pad_per_layer = session.run(None, {"input_ids": padded, "image_features": no_rows,
                                                   "audio_features": no_rows})
    np.testing.assert_array_equal(embeds, pad_embeds)
    np.testing.assert_array_equal(per_layer, pad_per_layer)
    np.testing.assert_allclose(embeds, want.hidden_states[0].numpy(), rtol=0, atol=1e-6, equal_nan=False)


@pytest.mark.l4
def test_check_passes_and_catches_a_missing_per_layer_mapping(package, tmp_path):
    findings = {f.check: f for f in check_package(package.path, get_profile("cpu"))}
    assert all(f.passed for f in findings.values()), [f for f in findings.values() if not f.passed]
    assert {"multimodal_config", "session_vision", "session_speech", "multimodal_generation"} <= set(findings)
    broken = tmp_path / "broken"
    shutil.copytree(package.path, broken)
    config = json.loads((broken / "genai_config.json").read_text())
    del config["model"]["embedding"]["outputs"]["per_layer_inputs"]
    (broken / "genai_config.json").write_text(json.dumps(config))
    finding = next(f for f in check_package(broken, get_profile("cpu")) if f.check == "multimodal_config")
    assert not finding.passed and "per_layer_inputs" in finding.detail


@pytest.mark.l1
def test_int4_encoders_quantizes_the_towers_and_every_session_loads(checkpoint, tmp_path):
    """``int4_encoders``: the towers' MatMuls become MatMulNBits too (the audio tower's output
    projection, a Linear with a bias lowered as an inlined function, left its MatMul untyped, and
    the writer failed on it), and ONNX Runtime loads every session."""
    import onnxruntime

    package = export(str(checkpoint), ep="cpu", precision="int4", int4_encoders=True, output_dir=tmp_path / "int4")
    for session in ("decoder", "embedding", "vision", "speech"):
        path = package.path / session / "model.onnx"
        if session in ("vision", "speech"):
            assert "MatMulNBits" in {node.op_type for node in onnx.load(path, load_external_data=False).graph.node}
        onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])


@pytest.mark.l1
def test_bf16_sessions_give_every_op_a_type_its_schema_allows(checkpoint, tmp_path):
    """A cuda bf16 package: the speech tower's Conv and Softplus, which ONNX has no bf16 for at
    opset 21 (ONNX Runtime refused the session on every EP, and the export said nothing), compute
    in float32 between Casts; every session's ops have types their schemas allow, as ``check``
    finds too, and ONNX Runtime resolves every graph (here its CPU EP then lacks bf16 kernels:
    NOT_IMPLEMENTED, never a type error)."""
    import onnx_ir as ir
    import onnxruntime

    from exporter.onnx_passes.schema_types import dtype_refusals

    package = export(str(checkpoint), ep="cuda", precision="bf16", output_dir=tmp_path / "bf16")
    widened = {p["name"]: p["changes"] for p in package.report.sessions["speech"].onnx_passes}["widen_unsupported_dtypes"]
    assert widened["nodes_widened"] > 0
    for session in ("decoder", "embedding", "vision", "speech"):
        path = package.path / session / "model.onnx"
        assert dtype_refusals(ir.load(path)) == [], session
        with pytest.raises(Exception, match="NOT_IMPLEMENTED"):
            onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    speech = ir.load(package.path / "speech" / "model.onnx")
    convs = [node for node in speech.graph if node.op_type == "Conv"]
    assert convs and all(node.inputs[0].dtype == ir.DataType.FLOAT for node in convs)
    # ``check`` agrees, and skips the CPU generations (no bf16 kernels there) instead of failing them.
    findings = {f.check: f for f in check_package(package.path, get_profile("cuda"))}
    assert all(f.passed for f in findings.values()) and findings["types"].skipped is False
    assert findings["smoke_generation"].skipped and findings["multimodal_generation"].skipped


@pytest.mark.l1
def test_text_only_gives_the_language_model_package(checkpoint, tmp_path):
    """``--text-only`` of the multimodal folder is byte for byte the package of a text checkpoint
    holding the same language model (what the exporter wrote for such a folder before it made
    multimodal packages)."""
    full = transformers.Gemma4ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    text_config = full.config.get_text_config()
    text_config.tie_word_embeddings = full.config.tie_word_embeddings
    text_model = transformers.Gemma4ForCausalLM(text_config)
    text_model.model.load_state_dict(full.model.language_model.state_dict())
    text_model.tie_weights()
    text_model.generation_config = full.generation_config
    text_folder = save_checkpoint(text_model, transformers.AutoTokenizer.from_pretrained(checkpoint), tmp_path / "text")
    text_only = export(str(checkpoint), text_only=True, output_dir=tmp_path / "text_only")
    plain = export(str(text_folder), output_dir=tmp_path / "plain")
    assert list(text_only.report.sessions) == ["decoder"]
    for name in ("model.onnx", "model.onnx.data", "genai_config.json"):
        assert (text_only.path / name).read_bytes() == (plain.path / name).read_bytes(), name


@pytest.mark.l5
def test_webgpu_captures_the_decoder_only_and_matches_cpu(checkpoint, media, tmp_path):
    require_webgpu()
    package = export(str(checkpoint), ep="webgpu", precision="fp32", output_dir=tmp_path / "webgpu")
    config = json.loads((package.path / "genai_config.json").read_text())["model"]
    options = {name: config[name]["session_options"]["provider_options"][0][WEBGPU.genai_provider]
               for name in ("decoder", "embedding", "vision", "speech")}
    assert options["decoder"].get(WEBGPU.graph_capture_option) == "1"
    assert all(options[name].get(WEBGPU.graph_capture_option) != "1" for name in ("embedding", "vision", "speech"))
    findings = {f.check: f for f in check_package(package.path, WEBGPU)}
    assert all(f.passed and not f.skipped for f in findings.values()), [f for f in findings.values() if not f.passed]
    # Placement is reported per session; the captured decoder runs all on the EP.
    assert findings["session"].detail.startswith("all ")
    assert {"session_embedding", "session_vision", "session_speech"} <= set(findings)
    # Where check finds a session's nodes on the CPU, the export's report said so too.
    for name in ("embedding", "vision", "speech"):
        if "CPUExecutionProvider" in findings[f"session_{name}"].detail:
            assert any(note.startswith(f"{name} session:") for note in package.report.notes), name
    for case in ("image", "audio"):
        prompt, with_image, with_audio = CASES[case]
        image, audio = (media["image"] if with_image else None), (media["audio"] if with_audio else None)
        _, _, on_cpu = genai_run(package.path, prompt, image, audio, on_cpu=True)
        _, _, on_ep = genai_run(package.path, prompt, image, audio, on_cpu=False)
        assert on_ep == on_cpu, case
