"""`python -m exporter check`: passes a good package, fails a broken one with a readable reason."""

from __future__ import annotations

import json
import shutil

import pytest

from exporter.cli import main

pytestmark = pytest.mark.l1


def _broken_copy(preset_exports, tmp_path, edit, plain_attention=False):
    package = tmp_path / "package"
    shutil.copytree(preset_exports.get("tiny-llama", plain_attention=plain_attention).package.path, package)
    config_path = package / "genai_config.json"
    config = json.loads(config_path.read_text())
    edit(config)
    config_path.write_text(json.dumps(config))
    return package


def test_good_package_passes(preset_exports, capsys):
    package = preset_exports.get("tiny-gemma-4").package.path
    assert main(["check", str(package), "--ep", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is True
    assert [f["check"] for f in report["findings"]] == [
        "files", "domains", "types", "buffer_limit", "genai_config", "graph_capture", "session", "smoke_generation"
    ]


def test_wrong_head_size_fails(preset_exports, tmp_path, capsys):
    def edit(config):
        config["model"]["decoder"]["head_size"] = 7

    package = _broken_copy(preset_exports, tmp_path, edit)
    assert main(["check", str(package)]) == 1
    out = capsys.readouterr().out
    assert "FAIL  genai_config" in out and "genai_config says 2 x 7" in out
    assert out.strip().endswith("7 passed, 1 failed")


def test_missing_kv_names_fail(preset_exports, tmp_path, capsys):
    def edit(config):
        config["model"]["decoder"]["outputs"]["present_key_names"] = "present_key.%d"

    package = _broken_copy(preset_exports, tmp_path, edit)
    assert main(["check", str(package)]) == 1
    assert "past KV layers [0, 1, 2, 3] and present KV layers [] differ" in capsys.readouterr().out


def test_not_a_package(tmp_path, capsys):
    assert main(["check", str(tmp_path)]) == 1
    assert "is not a package folder" in capsys.readouterr().out
    assert main(["check", str(tmp_path), "--ep", "tpu"]) == 2


def test_shared_kv_buffer_without_group_query_attention_fails(preset_exports, tmp_path, capsys):
    """Plain attention appends to its past; a shared buffer would make it read the whole buffer."""
    def edit(config):
        config["search"]["past_present_share_buffer"] = True

    package = _broken_copy(preset_exports, tmp_path, edit, plain_attention=True)
    assert main(["check", str(package)]) == 1
    assert "past_present_share_buffer is on but 8 present outputs (e.g. present.0.key) are not written by GroupQueryAttention" in capsys.readouterr().out


@pytest.mark.l1
def test_ep_generation_may_part_only_at_a_near_tie():
    import numpy as np

    from exporter.verify.check import _compare_generations

    logits = [np.array([0.0, 5.0, 4.9, 1.0]), np.array([3.0, 0.0, 0.0, 2.0])]
    agree, why = _compare_generations([1, 0], logits, [1, 0], logits, "fp32")
    assert agree and "logits within 0 of the CPU's over 2 steps" in why
    agree, why = _compare_generations([1, 0], logits, [2, 3], logits, "fp16")  # step 0: 5.0 vs 4.9
    assert agree and "near tie" in why
    agree, why = _compare_generations([1, 0], logits, [1, 3], logits, "fp16")  # step 1: 3.0 vs 2.0
    assert not agree and "from step 1" in why
    assert not _compare_generations([1, 0], logits, [2, 3], logits, "fp32")[0]


@pytest.mark.l1
def test_ep_logits_must_match_the_cpu_while_tokens_agree():
    """Same tokens are not enough: an EP kernel that drops a softcap or a window moves the logits
    long before it flips a greedy token. The failure names the step."""
    import numpy as np

    from exporter.verify.check import _compare_generations

    cpu = [np.array([0.0, 5.0, 1.0]), np.array([3.0, 0.0, 2.0])]
    drifted = [cpu[0] + 0.0005, cpu[1] + np.array([0.0, 0.0, 0.012])]
    agree, why = _compare_generations([1, 0], cpu, [1, 0], drifted, "fp32")
    assert not agree and "logits at step 1 differ from the CPU's by 0.012, over 0.001 for fp32" in why
    assert _compare_generations([1, 0], cpu, [1, 0], drifted, "fp16")[0]
    # Past the step where the tokens part the contexts differ: those logits are not compared.
    tie = [cpu[0], np.array([0.0, 5.0, 4.9]), np.array([3.0, 0.0, 2.0])]
    far = [*tie[:2], tie[2] + np.array([9.0, 0.0, 0.0])]  # step 2 follows another token: not comparable
    agree, why = _compare_generations([1, 1, 0], tie, [1, 2, 0], far, "fp16")
    assert agree and "from step 1 on, a near tie" in why and "over 2 steps" in why
    # Tokens only (a multimodal prompt on a software adapter): the logits are not read.
    assert _compare_generations([1, 0], cpu, [1, 0], None, "fp32") == (True, "")


def test_an_op_on_a_type_its_schema_refuses_fails(preset_exports, tmp_path, capsys):
    """An fp32 Mul's output declared bf16: one type parameter bound to two dtypes, a graph ONNX
    Runtime refuses on every EP."""
    import onnx

    package = tmp_path / "package"
    shutil.copytree(preset_exports.get("tiny-llama").package.path, package)
    graph = onnx.load(str(package / "model.onnx"), load_external_data=False)
    mul = next(n for n in graph.graph.node if n.op_type == "Mul" and n.domain == "")
    graph.graph.value_info.append(onnx.helper.make_tensor_value_info(mul.output[0], onnx.TensorProto.BFLOAT16, None))
    onnx.save(graph, str(package / "model.onnx"))
    (package / "export_report.json").unlink()  # as another exporter's package: no sha256 to refuse the edit
    assert main(["check", str(package)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL  types             ops on types their ONNX schema does not allow: decoder: Mul {mul.name} with T " \
           "bound to tensor(float) and tensor(bfloat16)" in out, out


@pytest.mark.l3
def test_a_prompt_fed_in_chunks_gives_the_whole_prompts_logits(preset_exports):
    """What ``check`` does on a software adapter (prompts 31 tokens at a time) computes what the
    whole prompt does, here on the CPU EP past Gemma 2's window of 8: chunks of 5 over 24 tokens."""
    import numpy as np

    from exporter.verify.check_against import greedy_with_logits

    package = preset_exports.get("tiny-gemma2").package.path
    prompt = [(7 * i + 3) % 500 + 5 for i in range(24)]
    whole = greedy_with_logits(package, [prompt], 6)[0]
    chunked = greedy_with_logits(package, [prompt], 6, chunk=5)[0]
    assert chunked.tokens == whole.tokens
    for got, want in zip(chunked.logits, whole.logits, strict=True):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5, equal_nan=False)


@pytest.mark.l1
def test_check_against_prompts_run_past_every_window(preset_exports):
    """The long prompt runs 16 tokens past the source's window (and past 64 tokens), read from the
    source's config without its weights."""
    import transformers

    from exporter.verify.check_against import LONG_PROMPT_MIN, PAST_THE_WINDOW, attention_windows, prompt_ids

    package = preset_exports.get("tiny-gemma2").package.path
    assert attention_windows(package, "tiny-gemma2") == (8,)
    tokenizer = transformers.AutoTokenizer.from_pretrained(package)
    assert len(prompt_ids(tokenizer, 2048, 16, (8,))[-1]) == LONG_PROMPT_MIN
    assert len(prompt_ids(tokenizer, 2048, 16, (200,))[-1]) == 200 + PAST_THE_WINDOW
    assert len(prompt_ids(tokenizer, 100, 16, (200,))[-1]) == 84  # no further than the context leaves room


@pytest.mark.unit
@pytest.mark.parametrize(("providers", "profile"), [([{"webgpu": {}}], "webgpu"), ([], "cpu"), (None, "cpu")])
def test_check_takes_the_ep_the_package_names_by_default(tmp_path, providers, profile):
    """``check PACKAGE`` without ``--ep`` checks against the profile whose provider the package's
    genai_config.json names (cpu where it names none or cannot be read)."""
    from exporter.cli import _named_ep

    if providers is not None:
        options = {"provider_options": providers}
        (tmp_path / "genai_config.json").write_text(json.dumps({"model": {"decoder": {"session_options": options}}}))
    assert _named_ep(tmp_path) == profile
