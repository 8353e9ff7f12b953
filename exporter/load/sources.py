"""Model sources behind one function: a built-in preset, a local Hugging Face folder, a hub id or
alias (through the normal Hugging Face cache), or an in-memory ``PreTrainedModel``.

Loading is safe by default: weights come from safetensors; pickled ``.bin`` weights (which can run
code when loaded) need an explicit opt-in, and so does a checkpoint's own Python code.

A safetensors folder is not loaded into memory: the model is built with empty parameters and its
weights are streamed into the package as it is written (``exporter.weights``). ``random_weights``
builds any source's architecture from its config alone, with random weights drawn the same way:
for aliases whose config ships with the exporter (``configs/``), nothing is downloaded.
"""

from __future__ import annotations

import copy
import difflib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from exporter.errors import ExporterError
from exporter.load.gguf_files import gguf_file, load_gguf
from exporter.load.multimodal import (
    MultimodalFacts,
    is_multimodal,
    multimodal_facts,
    read_processor_settings,
    require_special_strings,
)
from exporter.load.peft_models import is_peft_model, merged_copy
from exporter.load.presets import MULTIMODAL_TOKENS, PRESETS, build_preset, marker_ids, train_tokenizer
from exporter.weights.meta_model import build_on_meta, tied_aliases
from exporter.weights.stores import RandomWeights, SafetensorsWeights, UnreadTensors, WeightStore

ALIASES: dict[str, str] = {
    "gemma-4-e2b": "google/gemma-4-E2B-it",
}

_HUB_FILE_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja"]
# Configs shipped with the exporter, for aliases: `--random-weights` builds them offline.
SHIPPED_CONFIGS = Path(__file__).parents[1] / "configs"
_CAUSAL_LM_CLASSES = frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


@dataclass
class LoadedModel:
    model: transformers.PreTrainedModel
    tokenizer: Any
    source: str
    notes: list[str] = field(default_factory=list)
    # Where the weights come from when the model's parameters are empty (meta); None: in the model.
    weights: WeightStore | None = None
    # Set where the package is multimodal: ``model`` is then the whole multimodal model.
    multimodal: MultimodalFacts | None = None

    @property
    def generation_config(self):
        return self.model.generation_config


@dataclass(frozen=True)
class LoadOptions:
    allow_pickled_weights: bool = False
    trust_remote_code: bool = False
    random_weights: bool = False
    # A checkpoint tensor the export would not read is an error, not a note.
    strict: bool = False
    # A multimodal checkpoint gives its language model only (ONNX Runtime GenAI's text package).
    text_only: bool = False


def load(source: Any, tokenizer: Any = None, options: LoadOptions = LoadOptions(), processor: Any = None) -> LoadedModel:
    """``processor``: an in-memory multimodal model's processor (or its folder), for the image and
    audio settings of its package."""
    if is_peft_model(source):
        merged, note = merged_copy(source)
        loaded = _from_memory(merged, tokenizer, options, processor)
        loaded.notes.insert(0, note)
        return loaded
    if isinstance(source, transformers.PreTrainedModel):
        return _from_memory(source, tokenizer, options, processor)
    if not isinstance(source, (str, Path)):
        raise ExporterError(
            f"cannot export a {type(source).__name__}; pass a preset name, a folder, a hub id or a PreTrainedModel"
        )
    name = str(source)
    if name in PRESETS:
        preset = PRESETS[name]
        if options.random_weights:
            return _random(preset.make_config(), tokenizer, f"preset {name}", options, preset.processor_settings)
        model, built_tokenizer = build_preset(name)
        loaded = LoadedModel(model, tokenizer or built_tokenizer, f"preset {name} (random weights)")
        return _multimodal_or_text(loaded, model.config, options, preset.processor_settings)
    path = Path(name).expanduser()
    if path.exists():
        if (gguf := gguf_file(path)) is not None:
            return _from_gguf(gguf, tokenizer, options)
        return _from_folder(path, tokenizer, options, f"folder {path}")
    if _looks_like_path(name):
        raise ExporterError(f"path '{name}' does not exist; check the path or run `python -m exporter list`")
    if options.random_weights and (shipped := SHIPPED_CONFIGS / f"{name}.json").is_file():
        config, processor_settings = _shipped_config(shipped)
        return _random(config, tokenizer, f"{name} (shipped config)", options, processor_settings)
    if name in ALIASES or "/" in name:
        repo_id = ALIASES.get(name, name)
        folder = _download(repo_id, weights=not options.random_weights)
        return _from_folder(folder, tokenizer, options, f"hub {repo_id}")
    close = difflib.get_close_matches(name, [*PRESETS, *ALIASES], n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    raise ExporterError(
        f"unknown model '{name}': not a preset, alias, folder or hub id (owner/name); "
        f"{hint}run `python -m exporter list` for presets and aliases"
    )


def _looks_like_path(name: str) -> bool:
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or "\\" in name


def _from_memory(model: transformers.PreTrainedModel, tokenizer: Any, options: LoadOptions, processor: Any) -> LoadedModel:
    if tokenizer is None:
        raise ExporterError("export(model, tokenizer, ...) needs the model's tokenizer for the package")
    _require_causal_lm(type(model).__name__, model.config)
    loaded = LoadedModel(model, tokenizer, f"in-memory {type(model).__name__}")
    if not is_multimodal(model.config) or options.text_only:
        return _multimodal_or_text(loaded, model.config, options, {})
    if processor is None:
        raise ExporterError(
            f"{type(model).__name__} is multimodal: pass its processor (export(..., processor=...)) for the "
            "image and audio settings, or text_only=True for a text-only package"
        )
    return _multimodal_or_text(loaded, model.config, options, _processor_settings(processor))


def _processor_settings(processor: Any) -> dict[str, dict[str, Any]]:
    if isinstance(processor, (str, Path)):
        return read_processor_settings(Path(processor))
    sections = {}
    for section in ("image_processor", "feature_extractor"):
        if (part := getattr(processor, section, None)) is not None:
            sections[section] = part.to_dict()
    if hasattr(processor, "image_seq_length"):
        sections.setdefault("image_processor", {}).setdefault("image_seq_length", processor.image_seq_length)
    return sections


def _multimodal_or_text(loaded: LoadedModel, config, options: LoadOptions, processor_settings) -> LoadedModel:
    """Set the multimodal facts where the package is multimodal; for a model that stays text-only
    although it is multimodal, say so."""
    if is_multimodal(config) and not options.text_only:
        loaded.multimodal = multimodal_facts(config, processor_settings, loaded.source)
        require_special_strings(loaded.tokenizer, loaded.multimodal)
    elif config.get_text_config(decoder=True) is not config:
        why = "as asked (--text-only)" if options.text_only else "(multimodal packages: Gemma 4 only)"
        loaded.notes.append(f"{config.model_type} is multimodal: exported its language model as a text-only package {why}")
    return loaded


def _download(repo_id: str, weights: bool = True) -> Path:
    patterns = _HUB_FILE_PATTERNS if weights else [p for p in _HUB_FILE_PATTERNS if p != "*.safetensors"]
    try:
        import huggingface_hub

        return Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=patterns))
    except Exception as error:  # offline, unreachable, gated or unknown repo: all end the same way
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ExporterError(
            f"cannot fetch '{repo_id}' from the Hugging Face hub ({reason}); download it elsewhere and "
            "pass its folder, or use a built-in preset (`python -m exporter list`)"
        ) from error


def _from_folder(path: Path, tokenizer: Any, options: LoadOptions, source: str) -> LoadedModel:
    if not path.is_dir():
        raise ExporterError(f"'{path}' is not a folder or a .gguf file; pass a Hugging Face model folder "
                            "(config.json + weights) or a GGUF file")
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
        raise ExporterError(f"cannot read {config_file}: {str(error).splitlines()[0]}{hint}") from error
    architectures = list(getattr(config, "architectures", None) or [])
    _require_causal_lm(architectures[0] if architectures else None, config)

    processor_settings = read_processor_settings(path) if is_multimodal(config) and not options.text_only else {}
    if options.random_weights:
        loaded = _random(config, tokenizer or _folder_tokenizer(path, options), source, options, processor_settings)
        loaded.model.generation_config = _generation_config(path, config)
        return loaded
    has_safetensors = any(path.glob("*.safetensors"))
    has_pickle = any(path.glob("*.bin")) or any(path.glob("*.pt"))
    if has_safetensors:
        return _streamed(path, config, tokenizer, options, source, processor_settings)
    if not has_pickle:
        raise ExporterError(f"'{path}' has no weights (*.safetensors); pass a folder with the model's weights")
    if not options.allow_pickled_weights:
        raise ExporterError(
            f"'{path}' has only pickled .bin weights, which can run arbitrary code when loaded; "
            "convert them to safetensors, or pass --allow-pickled-weights if you trust the source"
        )

    # Pickled weights cannot be read one tensor at a time: the model is loaded whole.
    if is_multimodal(config) and not options.text_only:
        raise ExporterError(f"'{path}' has only pickled .bin weights: a multimodal package needs safetensors "
                            "(or export with --text-only)")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path,
            use_safetensors=False,
            trust_remote_code=options.trust_remote_code,
            dtype="float32",
        )
    except Exception as error:
        raise ExporterError(f"cannot load the model from '{path}': {str(error).splitlines()[0]}") from error
    loaded = LoadedModel(model.eval(), tokenizer or _folder_tokenizer(path, options), source)
    return _multimodal_or_text(loaded, config, options, {})


def _from_gguf(path: Path, tokenizer: Any, options: LoadOptions) -> LoadedModel:
    """A GGUF file, loaded whole by transformers (``exporter.load.gguf_files``)."""
    if options.random_weights:
        raise ExporterError(f"--random-weights takes a config; '{path}' is a GGUF file: pass its weights or a preset")
    model, file_tokenizer, note = load_gguf(path, options.trust_remote_code)
    _require_causal_lm(type(model).__name__, model.config)
    loaded = LoadedModel(model, tokenizer or file_tokenizer, f"GGUF file {path}", notes=[note])
    return _multimodal_or_text(loaded, model.config, options, {})


def _folder_tokenizer(path: Path, options: LoadOptions):
    try:
        return transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=options.trust_remote_code)
    except Exception as error:
        raise ExporterError(
            f"cannot load a tokenizer from '{path}' ({str(error).splitlines()[0]}); add its tokenizer files"
        ) from error


def _empty_model(config, options: LoadOptions) -> transformers.PreTrainedModel:
    """The model of ``config`` with parameters on meta: the whole model for a multimodal package,
    else the decoder (a multimodal config's language model)."""
    if is_multimodal(config) and not options.text_only:
        return _whole_model(config, options)
    text = config.get_text_config(decoder=True)
    if text is not config:
        # transformers ties a multimodal model's LM head by the top-level flag, whatever the text
        # config says; the text model alone must tie (or not) the same way.
        text = copy.deepcopy(text)
        text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
    try:
        model = build_on_meta(lambda: transformers.AutoModelForCausalLM.from_config(
            text, trust_remote_code=options.trust_remote_code))
    except Exception as error:
        raise ExporterError(f"cannot build a {text.model_type} model from its config: {_first_line(error)}") from error
    return model.eval()


def _whole_model(config, options: LoadOptions) -> transformers.PreTrainedModel:
    architectures = list(getattr(config, "architectures", None) or [])
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    try:
        model = build_on_meta(lambda: model_class(config) if model_class is not None
                              else transformers.AutoModelForImageTextToText.from_config(config))
    except Exception as error:
        raise ExporterError(f"cannot build a {config.model_type} model from its config: {_first_line(error)}") from error
    return model.eval()


def _random(config, tokenizer: Any, source: str, options: LoadOptions, processor_settings=None) -> LoadedModel:
    model = _empty_model(config, options)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    weights = RandomWeights(shapes, std=getattr(config.get_text_config(decoder=True), "initializer_range", 0.02))
    notes = []
    if tokenizer is None:
        multimodal = is_multimodal(config) and not options.text_only
        # A multimodal package needs the image and audio markers, at the config's ids.
        tokenizer = train_tokenizer(512, MULTIMODAL_TOKENS, marker_ids(config)) if multimodal else train_tokenizer(512)
        notes.append("tokenizer: the built-in 512-token BPE (the real tokenizer is not shipped)"
                     + (", with Gemma 4's image and audio markers at the config's ids" if multimodal else ""))
    loaded = LoadedModel(model, tokenizer, f"{source} ({weights.description})", notes, weights)
    return _multimodal_or_text(loaded, config, options, processor_settings or {})


def _streamed(path: Path, config, tokenizer: Any, options: LoadOptions, source: str,
              processor_settings) -> LoadedModel:
    model = _empty_model(config, options)
    notes = []
    model.generation_config = _generation_config(path, config)
    aliases = tied_aliases(model)
    if getattr(config, "tie_word_embeddings", False):
        # A multimodal checkpoint ties at its top level; its text model alone may not say so.
        names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
        head, table = model.get_output_embeddings(), model.get_input_embeddings()
        if head is not None and table is not None and head.weight is not table.weight:
            aliases[names[id(head.weight)]].append(names[id(table.weight)])
    weights = SafetensorsWeights(path, aliases)
    # Every saved tensor, parameters and persistent buffers alike, is in the checkpoint with its
    # shape, or a clear error now.
    weights.match(model)
    if config.get_text_config(decoder=True) is not config and (options.text_only or not is_multimodal(config)):
        weights.left_out = frozenset(_full_model_keys(config, options)) & set(weights.unmatched_keys())
        weights.left_out_why = "the multimodal model's other parts, which a text-only package does not use"
    if options.strict and (unmatched := weights.unmatched_keys()):
        raise ExporterError(f"--strict: {UnreadTensors(unmatched=tuple(unmatched)).notes()[0]} (in {path})")
    loaded = LoadedModel(model, tokenizer or _folder_tokenizer(path, options), source, notes, weights)
    return _multimodal_or_text(loaded, config, options, processor_settings)


def _full_model_keys(config, options: LoadOptions) -> list[str]:
    """The saved tensor names of the checkpoint's whole architecture (a multimodal one's towers
    too), from a model with every tensor on meta."""
    from transformers import initialization

    architectures = list(getattr(config, "architectures", None) or [])
    model_class = getattr(transformers, architectures[0], None) if architectures else None
    try:
        with torch.device("meta"), initialization.meta_device_safe_creation_ops():
            if model_class is not None:
                full = model_class(config)
            else:
                full = transformers.AutoModel.from_config(config, trust_remote_code=options.trust_remote_code)
    except Exception:  # cannot build it: every unread tensor stays unexplained
        return []
    return list(full.state_dict().keys())


def _generation_config(path: Path, config):
    """The folder's generation_config.json, else what transformers derives from its whole config
    (a multimodal one's top-level eos ids, not its text model's defaults)."""
    if not (path / "generation_config.json").is_file():
        return transformers.GenerationConfig.from_model_config(config)
    try:
        return transformers.GenerationConfig.from_pretrained(path)
    except Exception as error:
        raise ExporterError(f"cannot read {path / 'generation_config.json'}: {_first_line(error)}") from error


def _shipped_config(path: Path):
    """A shipped config and its processor settings (a ``processor`` entry, for a multimodal one)."""
    values = {k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("_")}
    processor_settings = values.pop("processor", {})
    return transformers.AutoConfig.for_model(values.pop("model_type"), **values), processor_settings


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


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

