"""``ExportOnSave``: a transformers ``TrainerCallback`` that exports an ONNX Runtime GenAI package
each time the ``Trainer`` saves a checkpoint (or every N saves).

A full checkpoint is exported from the folder the Trainer has just written, through the same
streamed path as ``python -m exporter FOLDER``: the trainer's model is not touched, wherever it
lives (CPU or GPU). A checkpoint that holds adapters only (a ``PeftModel`` being trained) is
exported from the model in memory: the adapters are merged into a copy on the CPU, so the
trainer's model and adapters stay as they are.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from exporter.errors import ExporterError
from exporter.load.peft_models import is_peft_model
from exporter.pipeline import ExportedPackage, export
from exporter.options import ExportOptions

_OPTION_NAMES = set(ExportOptions.__dataclass_fields__)  # what resolve() checks at construction
# What ExportOnSave may pass on to export() (it sets the model, tokenizer and output itself).
_EXPORT_KEYWORDS = set(inspect.signature(export).parameters) - {"model", "tokenizer", "output_dir", "ep", "precision",
                                                                 "overwrite"}

logger = logging.getLogger(__name__)

DEFAULT_FOLDER = "{output_dir}/onnx/{checkpoint}-{ep}-{precision}"


class ExportOnSave(transformers.TrainerCallback):
    """Exports a package when the Trainer saves a checkpoint.

    ``ep`` and ``precision`` are as for ``export()``. ``every``: export on every N-th save (1: all).
    ``folder``: where each package goes, a template of ``{output_dir}`` (the Trainer's),
    ``{checkpoint}`` (``checkpoint-<step>``), ``{step}``, ``{ep}`` and ``{precision}``; by default
    beside the checkpoints rather than in them, so that ``save_total_limit`` does not rotate the
    packages away. ``tokenizer``: the tokenizer to package when the Trainer has no
    ``processing_class``. ``on_error``: ``"raise"`` (default) stops training on a failed export;
    ``"warn"`` logs it and goes on (``failures`` keeps the messages). Further keyword arguments go
    to ``export()`` (e.g. ``text_only=True``, ``int4=...``). ``exported`` lists the packages made.
    """

    def __init__(self, ep: str = "cpu", precision: str | None = None, *, every: int = 1,
                 folder: str = DEFAULT_FOLDER, tokenizer: Any = None, on_error: str = "raise",
                 overwrite: bool = True, **export_options: Any):
        if every < 1:
            raise ValueError(f"every must be 1 or more, not {every}")
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', not {on_error!r}")
        # Checked and resolved at construction, not at the first save hours into training.
        unknown = sorted(set(export_options) - _EXPORT_KEYWORDS)
        if unknown:
            raise TypeError(f"ExportOnSave got options export() does not take: {', '.join(unknown)}")
        known = {name: value for name, value in export_options.items() if name in _OPTION_NAMES}
        self.precision = ExportOptions(ep=ep, precision=precision, **known).resolve().precision
        self.ep, self.every, self.folder = ep, every, folder
        self.tokenizer, self.on_error, self.overwrite = tokenizer, on_error, overwrite
        self.export_options = export_options
        self.exported: list[ExportedPackage] = []
        self.failures: list[str] = []
        self._saves = 0

    def on_save(self, args, state, control, model=None, processing_class=None, **kwargs):
        self._saves += 1
        # Counted from the step where saves come every save_steps, so that a run resumed from a
        # checkpoint exports at the same saves as one that was not interrupted.
        steps = args.save_steps if args.save_strategy == "steps" else None
        save_number = state.global_step // int(steps) if steps and steps >= 1 and steps == int(steps) else self._saves
        if save_number % self.every or not state.is_world_process_zero:
            return
        checkpoint = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
        try:
            # The trainer's random state is left as it was: tracing draws sample inputs.
            with torch.random.fork_rng(devices=[]):
                self.exported.append(self._export(checkpoint, state.global_step, model, processing_class))
        except ExporterError as error:
            if self.on_error == "raise":
                raise
            self.failures.append(f"{checkpoint.name}: {error}")
            logger.warning("ExportOnSave: %s not exported: %s", checkpoint.name, error)

    def _export(self, checkpoint: Path, step: int, model, processing_class) -> ExportedPackage:
        precision = self.precision
        output = Path(self.folder.format(output_dir=checkpoint.parent, checkpoint=checkpoint.name, step=step,
                                         ep=self.ep, precision=precision))
        tokenizer = processing_class if processing_class is not None else self.tokenizer
        options = dict(ep=self.ep, precision=precision, output_dir=output, overwrite=self.overwrite,
                       **self.export_options)
        # model.safetensors or model-00001-of-0000N.safetensors: adapter_model.safetensors is not one.
        if (checkpoint / "config.json").is_file() and any(checkpoint.glob("model*.safetensors")):
            # The folder the Trainer wrote, with its tokenizer if it saved one.
            has_tokenizer = any((checkpoint / name).is_file() for name in ("tokenizer.json", "tokenizer.model"))
            return export(str(checkpoint), None if has_tokenizer else tokenizer, **options)
        if model is None or tokenizer is None:
            raise ExporterError(f"{checkpoint} holds no full model (adapters only?) and the Trainer gave no "
                                "model or tokenizer to export in memory; pass ExportOnSave(tokenizer=...)")
        if not is_peft_model(model) and any(p.device.type != "cpu" for p in model.parameters()):
            raise ExporterError(f"{checkpoint} holds no full model, and the model in memory is not on the CPU, "
                                "where the export traces: save full checkpoints (safetensors)")
        return export(model, tokenizer, **options)

