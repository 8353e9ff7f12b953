"""Model sources behind one function: a built-in preset, a local Hugging Face folder, a hub id or
alias (through the normal Hugging Face cache), or an in-memory ``PreTrainedModel``.

Loading is safe by default: weights come from safetensors; pickled ``.bin`` weights (which can run
code when loaded) need an explicit opt-in, and so does a checkpoint's own Python code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from exporter.errors import ExporterError
from exporter.presets import PRESETS, build_preset

ALIASES: dict[str, str] = {
    "gemma-4-e2b": "google/gemma-4-E2B-it",
}

_HUB_FILE_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
_CAUSAL_LM_CLASSES = frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


@dataclass
class LoadedModel:
    model: transformers.PreTrainedModel
    tokenizer: Any
    source: str
    notes: list[str] = field(default_factory=list)

    @property
    def generation_config(self):
        return self.model.generation_config


@dataclass(frozen=True)
class LoadOptions:
    allow_pickled_weights: bool = False
    trust_remote_code: bool = False


def load(source: Any, tokenizer: Any = None, options: LoadOptions = LoadOptions()) -> LoadedModel:
    if isinstance(source, transformers.PreTrainedModel):
        return _from_memory(source, tokenizer)
    if not isinstance(source, (str, Path)):
        raise ExporterError(
            f"cannot export a {type(source).__name__}; pass a preset name, a folder, a hub id or a PreTrainedModel"
        )
    name = str(source)
    if name in PRESETS:
        model, preset_tokenizer = build_preset(name)
        return LoadedModel(model, tokenizer or preset_tokenizer, f"preset {name} (random weights)")
    path = Path(name).expanduser()
    if path.exists():
        return _from_folder(path, tokenizer, options, f"folder {path}")
    if _looks_like_path(name):
        raise ExporterError(f"path '{name}' does not exist; check the path or run `python -m exporter list`")
    if name in ALIASES or "/" in name:
        repo_id = ALIASES.get(name, name)
        folder = _download(repo_id)
        return _from_folder(folder, tokenizer, options, f"hub {repo_id}")
    raise ExporterError(
        f"unknown model '{name}': not a preset, alias, folder or hub id (owner/name); "
        "run `python -m exporter list` for presets and aliases"
    )


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name


def _from_memory(model: transformers.PreTrainedModel, tokenizer: Any) -> LoadedModel:
    if tokenizer is None:
        raise ExporterError("export(model, tokenizer, ...) needs the model's tokenizer for the package")
    _require_causal_lm(type(model).__name__, model.config)
    return LoadedModel(model, tokenizer, f"in-memory {type(model).__name__}")


def _download(repo_id: str) -> Path:
    try:
        import huggingface_hub

        return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=_HUB_FILE_PATTERNS))
    except Exception as error:  # offline, unreachable, gated or unknown repo: all end the same way
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ExporterError(
            f"cannot fetch '{repo_id}' from the Hugging Face hub ({reason}); download it elsewhere and "
            "pass its folder, or use a built-in preset (`python -m exporter list`)"
        ) from None


def _from_folder(path: Path, tokenizer: Any, options: LoadOptions, source: str) -> LoadedModel:
    if not path.is_dir():
        raise ExporterError(f"'{path}' is not a folder; pass a Hugging Face model folder (config.json + weights)")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ExporterError(f"'{path}' has no config.json; pass a Hugging Face model folder")
    try:
        config = transformers.AutoConfig.from_pretrained(path, trust_remote_code=options.trust_remote_code)
    except Exception as error:
        hint = (
            "; it needs the checkpoint's own code: pass --trust-remote-code if you trust the source"
            if "trust_remote_code" in str(error)
            else ""
        )
        raise ExporterError(f"cannot read {config_file}: {str(error).splitlines()[0]}{hint}") from None
    architectures = list(getattr(config, "architectures", None) or [])
    _require_causal_lm(architectures[0] if architectures else None, config)

    has_safetensors = any(path.glob("*.safetensors"))
    has_pickle = any(path.glob("*.bin")) or any(path.glob("*.pt"))
    if not has_safetensors:
        if not has_pickle:
            raise ExporterError(f"'{path}' has no weights (*.safetensors); pass a folder with the model's weights")
        if not options.allow_pickled_weights:
            raise ExporterError(
                f"'{path}' has only pickled .bin weights, which can run arbitrary code when loaded; "
                "convert them to safetensors, or pass --allow-pickled-weights if you trust the source"
            )

    notes = []
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path,
            use_safetensors=has_safetensors,
            trust_remote_code=options.trust_remote_code,
            dtype="float32",
        )
    except Exception as error:
        raise ExporterError(f"cannot load the model from '{path}': {str(error).splitlines()[0]}") from None
    if config.get_text_config(decoder=True) is not config:
        notes.append(
            f"{type(model).__name__} is multimodal: exported its language model as a text-only package"
        )
    if tokenizer is None:
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=options.trust_remote_code)
        except Exception as error:
            raise ExporterError(
                f"cannot load a tokenizer from '{path}' ({str(error).splitlines()[0]}); add its tokenizer files"
            ) from None
    return LoadedModel(model.eval(), tokenizer, source, notes)


def _require_causal_lm(architecture: str | None, config: Any) -> None:
    text_config = config.get_text_config(decoder=True)
    known_causal_lm = (
        architecture in _CAUSAL_LM_CLASSES or text_config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    )
    lm_head_class = not architecture or architecture.endswith(
        ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel")
    )
    if getattr(config, "is_encoder_decoder", False) or not known_causal_lm or not lm_head_class:
        raise ExporterError(
            f"{architecture or config.model_type} is not a decoder language model; "
            "this exporter takes causal LMs (…ForCausalLM, or a multimodal model's language model)"
        )


def describe_sources() -> list[tuple[str, str]]:
    rows = [(name, preset.description) for name, preset in PRESETS.items()]
    rows += [(alias, f"alias for {repo_id} (downloads through the Hugging Face cache)") for alias, repo_id in ALIASES.items()]
    return rows

