"""``python -m exporter check PACKAGE --against SOURCE``: the package against transformers itself.

For a few fixed prompts, and a long one that runs past every attention window of the model (and
past 64 tokens), the package generates greedily with ONNX Runtime GenAI, keeping the logits each
token was picked from: on the CPU EP, and with ``--ep X`` also on X where it is installed (an EP
whose kernel drops a window or a softcap shows here, not on the CPU). Then transformers runs the source on the same prompt and the
package's tokens (teacher forcing: one forward pass, so after a near tie both still see the same
text) and the two are compared step by step, with the tolerances of the package's precision
(``exporter.precisions``):

- ``source_logits`` (``ep_source_logits`` on the EP): max |package logit - transformers logit| at
  every step, the first failing one named by prompt, generated token and position;
- ``source_tokens`` (``ep_source_tokens``): the package's token must be transformers' best, or part from it at a near tie
  (its transformers logit at most ``near_tie`` below the best); and a package that picks one token at
  every step from the first, where transformers picks it at most at half of them, fails whatever the
  margins (a degenerate repeat, such as ``<pad>`` forever, that near-tie bounds wide enough for a tiny
  model's flat logits would let through).

A quantized package (int4, int8) is judged by its distribution instead of step by step: its
weights differ from the source's, so a real model's logits part by several units and its tokens at
steps that are no near tie, whether the quantization is good or broken. ``source_distribution``
teacher-forces a passage of real prose (and the generations' steps) through the package one token
at a time and bounds the mean KL(transformers || package), the top-1 agreement (a pick within the
near-tie bound of transformers' best agreeing) and the prose's perplexity against transformers'
(``Precision.distribution``; ``exporter.verify.distribution``); ``source_tokens`` then fails only a
degenerate repeat.

Logits that are not finite, the package's or transformers', fail both at the first such step
(NaN compares false with any bound: all-NaN logits differed by "0").

The reference is loaded by transformers' own ``from_pretrained`` (in fp32), never by the
exporter's streaming loader, so a tensor the export drops or misreads shows up here. The package
runs first and is released before the reference is loaded: the two never share the memory.
"""

from __future__ import annotations

import copy
import gc
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers

from ep_profiles import EpProfile
from exporter.errors import ExporterError
from exporter.load.layout import eval_mode
from exporter.precisions import PRECISIONS
from exporter.verify.distribution import DistributionTotals, nonfinite

# Fixed prompts: plain text, so a real checkpoint's tokenizer gives real tokens.
PROMPTS = (
    "Alice was beginning to get very tired of sitting by her sister on the bank,",
    "The capital of France is",
    "def fibonacci(n):\n    ",
)
NEW_TOKENS = 16


@dataclass(frozen=True)
class Generation:
    prompt: list[int]
    tokens: list[int]  # the package's greedy tokens, the end-of-sequence included if it ended
    logits: list[np.ndarray]  # the logits each token was picked from


def greedy_with_logits(package: Path, prompts: list[list[int]], new_tokens: int, on_cpu: bool = True,
                       chunk: int | None = None) -> list[Generation]:
    """ONNX Runtime GenAI's greedy generation of each prompt, with the logits of every step;
    ``chunk``: the prompt appended in pieces of at most that many tokens (as a chat appends turns),
    for an adapter whose attention kernel is wrong on more query rows at once."""
    import onnxruntime_genai as og

    from exporter.verify.ep_runtime import genai_config

    model = og.Model(genai_config(package, on_cpu))
    vocab = json.loads((package / "genai_config.json").read_text())["model"]["vocab_size"]
    generations = []
    for prompt in prompts:
        params = og.GeneratorParams(model)
        # Plain greedy: no penalty the package's search settings might add, so each token is the
        # best of the logits it is compared by.
        params.set_search_options(max_length=len(prompt) + new_tokens, do_sample=False, repetition_penalty=1.0,
                                  min_length=0)
        generator = og.Generator(model, params)
        step = chunk or len(prompt)
        for start in range(0, len(prompt), step):
            generator.append_tokens(np.array([prompt[start:start + step]], dtype=np.int32))
        logits = []
        while not generator.is_done():
            generator.generate_next_token()  # runs the model on the last token, then picks from its logits
            logits.append(np.array(generator.get_output("logits"), dtype=np.float32).reshape(-1)[-vocab:])
        tokens = generator.get_sequence(0)[len(prompt):].tolist()
        if len(logits) == len(tokens) + 1:  # a lone sequence that ends leaves its end-of-sequence out
            tokens.append(int(logits[-1].argmax()))
        generations.append(Generation(prompt, tokens, logits))
        del generator
    return generations


def teacher_forced_package_logits(package: Path, ids: list[int], on_cpu: bool = True) -> np.ndarray:
    """The package's logits [len(ids) - 1, vocab] after each of ``ids[:-1]``, fed one token at a
    time through GenAI's decode path (each predicts the next token of ``ids``)."""
    import onnxruntime_genai as og

    from exporter.verify.ep_runtime import genai_config

    model = og.Model(genai_config(package, on_cpu))
    vocab = json.loads((package / "genai_config.json").read_text())["model"]["vocab_size"]
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(ids), do_sample=False)
    generator = og.Generator(model, params)
    rows = []
    for token in ids[:-1]:
        generator.append_tokens(np.array([[token]], dtype=np.int32))
        rows.append(np.array(generator.get_output("logits"), dtype=np.float32).reshape(-1)[-vocab:])
    del generator, model
    return np.stack(rows)


def reference_model(source: Any, trust_remote_code: bool = False) -> transformers.PreTrainedModel:
    """transformers' own fp32 model of ``source``: an in-memory model (an fp32 copy if it is in
    another dtype), a preset as ``build_preset`` makes it (what a preset export reads), a folder, hub
    id or alias through ``from_pretrained``, a GGUF file through its ``gguf_file=`` loader."""
    from exporter.load.gguf_files import gguf_file, load_gguf
    from exporter.load.presets import PRESETS, build_preset
    from exporter.load.sources import ALIASES, _download

    if isinstance(source, transformers.PreTrainedModel):
        if any(p.dtype != torch.float32 for p in source.parameters()):
            return copy.deepcopy(source).float()
        return source
    name = str(source)
    if name in PRESETS:
        return build_preset(name)[0]
    path = Path(name).expanduser()
    if not path.exists():
        if name not in ALIASES and "/" not in name:
            raise ExporterError(f"--against '{name}' is not a preset, folder, hub id or alias")
        path = _download(ALIASES.get(name, name))
    if (gguf := gguf_file(path)) is not None:
        return load_gguf(gguf, trust_remote_code)[0]
    if not any(path.glob("*.safetensors")):
        raise ExporterError(f"--against '{path}' has no *.safetensors weights to compare with")
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, use_safetensors=True, trust_remote_code=trust_remote_code
        )
    except Exception as error:
        raise ExporterError(f"transformers cannot load --against '{path}': {str(error).strip().splitlines()[0]}") from error
    return model.eval()


# Prose for the long prompt, repeated until it is long enough.
LONG_TEXT = ("It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
             "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, "
             "it was the season of Darkness, it was the spring of hope, it was the winter of despair. ")
# The long prompt runs past every window of the model by this many tokens, and is at least
# LONG_PROMPT_MIN tokens: past the 32-row tiles attention kernels switch to (WebGPU's was wrong there).
PAST_THE_WINDOW = 16
LONG_PROMPT_MIN = 64
# Real prose, not repeated (a repeat is copied, which flatters any package): the opening of Jane
# Austen's Pride and Prejudice (1813), ~330 tokens in most tokenizers. Quantized packages are
# measured on it token by token.
PROSE = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
    "of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered "
    "the rightful property of some one or other of their daughters. \"My dear Mr. Bennet,\" said his lady to him "
    "one day, \"have you heard that Netherfield Park is let at last?\" Mr. Bennet replied that he had not. \"But it "
    "is,\" returned she; \"for Mrs. Long has just been here, and she told me all about it.\" Mr. Bennet made no "
    "answer. \"Do you not want to know who has taken it?\" cried his wife impatiently. \"You want to tell me, and I "
    "have no objection to hearing it.\" This was invitation enough. \"Why, my dear, you must know, Mrs. Long says "
    "that Netherfield is taken by a young man of large fortune from the north of England; that he came down on "
    "Monday in a chaise and four to see the place, and was so much delighted with it, that he agreed with Mr. "
    "Morris immediately; that he is to take possession before Michaelmas, and some of his servants are to be in "
    "the house by the end of next week.\" \"What is his name?\" \"Bingley.\" \"Is he married or single?\" \"Oh! "
    "Single, my dear, to be sure! A single man of large fortune; four or five thousand a year. What a fine thing "
    "for our girls!\" \"How so? How can it affect them?\" \"My dear Mr. Bennet,\" replied his wife, \"how can you "
    "be so tiresome! You must know that I am thinking of his marrying one of them.\""
)


def prompt_ids(tokenizer, context_length: int, new_tokens: int, windows: tuple[int, ...] = ()) -> list[list[int]]:
    """The fixed prompts in the package's tokenizer, then a long prompt of prose that runs
    ``PAST_THE_WINDOW`` tokens past the largest of ``windows`` (sliding windows, attention chunks),
    each cut to leave room for the new tokens."""
    room = max(1, context_length - new_tokens)
    prompts = [list(tokenizer(text)["input_ids"])[:room] for text in PROMPTS]
    length = min(room, max((*windows, LONG_PROMPT_MIN - PAST_THE_WINDOW)) + PAST_THE_WINDOW)
    text = LONG_TEXT
    while len(ids := list(tokenizer(text)["input_ids"])) < length:
        text += LONG_TEXT
    return [*prompts, ids[:length]]


def attention_windows(package: Path, source: Any, trust_remote_code: bool = False) -> tuple[int, ...]:
    """The model's attention windows: the sliding window and attention chunk of the source's
    config (read without its weights), and the ``sliding_window`` section of the package's
    genai_config (other exporters write one)."""
    from exporter.load.layout import text_config
    from exporter.load.presets import PRESETS

    windows = []
    decoder = json.loads((package / "genai_config.json").read_text())["model"]["decoder"]
    windows.append((decoder.get("sliding_window") or {}).get("window_size"))
    config = None
    if isinstance(source, transformers.PreTrainedModel):
        config = source.config
    elif str(source) in PRESETS:
        config = PRESETS[str(source)].make_config()
    elif (gguf := _gguf_of(source)) is not None:
        try:
            config = transformers.AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        except Exception:  # reference_model says what is wrong with the file
            config = None
    elif Path(str(source)).expanduser().is_dir():
        try:
            config = transformers.AutoConfig.from_pretrained(Path(str(source)).expanduser(),
                                                             trust_remote_code=trust_remote_code)
        except Exception:  # reference_model says what is wrong with the folder
            config = None
    if config is not None:
        config = text_config(config)
        windows += [getattr(config, "sliding_window", None), getattr(config, "attention_chunk_size", None)]
    return tuple(int(w) for w in windows if isinstance(w, int) and w > 0)


def _gguf_of(source: Any) -> Path | None:
    from exporter.load.gguf_files import gguf_file

    path = Path(str(source)).expanduser()
    try:
        return gguf_file(path) if path.exists() else None
    except ExporterError:  # several GGUF files: reference_model says so
        return None


def compare_with_source(package: Path, source: Any, precision: str, new_tokens: int = NEW_TOKENS,
                        trust_remote_code: bool = False, profile: EpProfile | None = None) -> list[tuple[str, bool, str]]:
    """(check, passed, detail) for ``source_logits`` and ``source_tokens`` (the package on the CPU
    EP); with a ``profile`` whose EP is not the CPU, also ``ep_source_logits`` and
    ``ep_source_tokens`` (the package on that EP, where it is installed; skipped where not: the
    detail then starts with "not run")."""
    from exporter.verify.ep_runtime import EpUnavailable, prompt_chunk, register

    package = Path(package)
    config = json.loads((package / "genai_config.json").read_text())
    tokenizer = _package_tokenizer(package)
    windows = attention_windows(package, source, trust_remote_code)
    prompts = prompt_ids(tokenizer, config["model"]["context_length"], new_tokens, windows)
    tolerance = PRECISIONS.get(precision, PRECISIONS["fp32"])
    prose = list(tokenizer(PROSE)["input_ids"])[:config["model"]["context_length"]] if tolerance.distribution else None
    runs = {"": greedy_with_logits(package, prompts, new_tokens)}
    prose_logits = {"": teacher_forced_package_logits(package, prose)} if prose else {}
    skipped = chunk = None
    if profile is not None and profile.genai_provider:
        try:
            register(profile, genai=True)
            chunk = prompt_chunk(profile)
            runs["ep_"] = greedy_with_logits(package, prompts, new_tokens, on_cpu=False, chunk=chunk)
            if prose:
                prose_logits["ep_"] = teacher_forced_package_logits(package, prose, on_cpu=False)
        except EpUnavailable as error:
            skipped = f"not run: {error}"
    gc.collect()  # the package's sessions go before the reference comes

    model = reference_model(source, trust_remote_code)
    results = []
    for prefix, generations in runs.items():
        where = f" on {profile.ort_provider}" if prefix else ""
        if prefix and chunk:
            where += f" (a software adapter: prompts fed {chunk} tokens at a time)"
        if prose:
            results += _distribution_against_reference(model, generations, prose, prose_logits[prefix], tokenizer,
                                                       tolerance, precision, source, where, prefix)
        else:
            results += _against_reference(model, generations, tokenizer, tolerance, precision, source, where, prefix)
    if skipped:
        names = ("ep_source_distribution", "ep_source_tokens") if prose else ("ep_source_logits", "ep_source_tokens")
        results += [(name, True, skipped) for name in names]
    return results


def _against_reference(model, generations: list[Generation], tokenizer, tolerance, precision: str, source: Any,
                         where_run: str, prefix: str) -> list[tuple[str, bool, str]]:
    worst, logit_failure, token_failure, near_ties = 0.0, None, None, 0
    for number, generation in enumerate(generations, start=1):
        reference = teacher_forced_logits(model, generation.prompt, generation.tokens)
        for step, (got, want) in enumerate(zip(generation.logits, reference, strict=True)):
            where = f"prompt {number}, generated token {step} (position {len(generation.prompt) + step})"
            if want.shape != got.shape:
                return [(f"{prefix}source_logits", False, (f"the package has {got.shape[-1]} logits, "
                                                           f"transformers {want.shape[-1]}: not the same vocabulary"))]
            unusable = [f"{whose} logits are not finite: {counts}"
                        for whose, values in (("the package's", got), ("transformers'", want)) if (counts := nonfinite(values))]
            if unusable:  # nothing to compare, and the token was picked from them
                failure = f"at {where}{where_run} {'; '.join(unusable)}"
                logit_failure, token_failure = logit_failure or failure, token_failure or failure
                continue
            difference = float(np.abs(got - want).max())
            worst = max(worst, difference)
            if difference > (bound := tolerance.logit_bound(tolerance.source_logits, want)) and logit_failure is None:
                logit_failure = (f"at {where}{where_run} the logits differ from transformers' by {difference:.3g} "
                                 f"(tolerance {bound:.3g} for {precision})")
        if token_failure is None and (repeat := degenerate_repeat(reference, generation.tokens)):
            token, picked = repeat
            token_failure = (f"at prompt {number}{where_run} the package picks {token} {tokenizer.decode([token])!r} at "
                             f"every step from generated token 0 ({len(generation.tokens)} steps), transformers at "
                             f"{picked} of them: a degenerate repeat")
        for departure in departures(reference, generation.tokens):
            where = f"prompt {number}, generated token {departure.step} (position {len(generation.prompt) + departure.step})"
            if departure.margin <= tolerance.source_near_tie:
                near_ties += 1
            elif token_failure is None:
                token, best = departure.token, departure.best
                token_failure = (f"at {where}{where_run} the package picks {token} {tokenizer.decode([token])!r} where "
                                 f"transformers picks {best} {tokenizer.decode([best])!r}, {departure.margin:.3g} apart "
                                 f"(near-tie bound {tolerance.source_near_tie} for {precision})")
    steps = sum(len(g.tokens) for g in generations)
    longest = max(len(g.prompt) for g in generations)
    checked = (f"{len(generations)} prompts (the longest {longest} tokens), {steps} greedy steps{where_run} "
               f"against {_describe(source)}")
    tie_note = f"; {near_ties} near ties within {tolerance.source_near_tie}" if near_ties else ""
    return [
        (f"{prefix}source_logits", logit_failure is None,
         logit_failure or f"{checked}: max |logit difference| {worst:.3g} (tolerance {tolerance.source_logits}"
                          f"{f' or {tolerance.relative_logits:.1%} of the largest |logit|' if tolerance.relative_logits else ''}"
                          f" for {precision})"),
        (f"{prefix}source_tokens", token_failure is None,
         token_failure or f"{checked}: the package's greedy tokens are transformers'{tie_note}"),
    ]


def _distribution_against_reference(model, generations: list[Generation], prose: list[int], prose_logits: np.ndarray,
                                    tokenizer, tolerance, precision: str, source: Any, where_run: str,
                                    prefix: str) -> list[tuple[str, bool, str]]:
    """``source_distribution`` and ``source_tokens`` of a quantized package: the prose's positions
    and the generations' steps, pooled, against ``tolerance.distribution``."""
    totals, unusable, token_failure = DistributionTotals(), None, None
    texts = [("the prose", teacher_forced_logits(model, prose[:1], prose[1:]), list(prose_logits), prose[1:])]
    texts += [(f"prompt {number}", teacher_forced_logits(model, g.prompt, g.tokens), g.logits, None)
              for number, g in enumerate(generations, start=1)]
    for name, reference, got, targets in texts:
        want = np.stack(reference)
        if want.shape[-1] != np.shape(got)[-1]:
            return [(f"{prefix}source_distribution", False, (f"the package has {np.shape(got)[-1]} logits, "
                                                             f"transformers {want.shape[-1]}: not the same vocabulary"))]
        bad = [f"{whose} logits are not finite: {counts}"
               for whose, values in (("the package's", np.stack(got)), ("transformers'", want)) if (counts := nonfinite(values))]
        if bad:
            unusable = unusable or f"on {name}{where_run} {'; '.join(bad)}"
            continue
        totals.add(want, np.stack(got), None if targets is None else np.array(targets), tolerance.source_near_tie)
    for number, generation in enumerate(generations, start=1):
        reference = texts[number][1]
        if token_failure is None and (repeat := degenerate_repeat(reference, generation.tokens)):
            token, picked = repeat
            token_failure = (f"at prompt {number}{where_run} the package picks {token} {tokenizer.decode([token])!r} at "
                             f"every step from generated token 0 ({len(generation.tokens)} steps), transformers at "
                             f"{picked} of them: a degenerate repeat")
    bounds = tolerance.distribution
    checked = (f"{len(prose) - 1} positions of prose and {sum(len(g.tokens) for g in generations)} greedy steps of "
               f"{len(generations)} prompts{where_run} against {_describe(source)}")
    if unusable:
        return [(f"{prefix}source_distribution", False, unusable), (f"{prefix}source_tokens", False, unusable)]
    measured = (f"mean KL {totals.mean_kl:.3g} (bound {bounds.mean_kl}), top-1 {totals.top1_near_tie_share:.1%} with "
                f"near ties within {tolerance.source_near_tie} ({totals.top1_share:.1%} exact; bound {bounds.top1:.0%}), "
                f"prose perplexity {totals.perplexity_ratio:.3f}x transformers' (bound {bounds.perplexity_ratio}x)")
    failures = bounds.failures(totals)
    return [
        (f"{prefix}source_distribution", not failures,
         f"{checked}: {'; '.join(failures) + ' for ' + precision + ' (' + measured + ')' if failures else measured}"),
        (f"{prefix}source_tokens", token_failure is None,
         token_failure or f"{checked}: no degenerate repeat (a quantized package's tokens may part from "
                          "transformers' anywhere; its distribution is what is bounded)"),
    ]


@dataclass(frozen=True)
class Departure:
    """A step where the package's token is not transformers' best: how far below the best it is."""
    step: int
    token: int
    best: int
    margin: float


def departures(reference: list[np.ndarray], tokens: list[int]) -> list[Departure]:
    """Each step whose token is not the best of transformers' logits there (``teacher_forced_logits``)."""
    found = []
    for step, (want, token) in enumerate(zip(reference, tokens, strict=True)):
        best = int(want.argmax())
        if token != best:
            found.append(Departure(step, token, best, float(want[best] - want[token])))
    return found


def degenerate_repeat(reference: list[np.ndarray], tokens: list[int]) -> tuple[int, int] | None:
    """(token, at how many steps transformers picks it) where the package picks one token at every
    step from the first and transformers (``teacher_forced_logits``) picks it at most at half of
    them; None otherwise. Not at every step fewer: a model that itself repeats a token may part from
    it once at a near tie."""
    if len(tokens) < 2 or len(set(tokens)) > 1:
        return None
    picked = sum(int(want.argmax()) == tokens[0] for want in reference)
    return (tokens[0], picked) if 2 * picked <= len(tokens) else None


@torch.no_grad()
def teacher_forced_logits(model, prompt: list[int], tokens: list[int]) -> list[np.ndarray]:
    """transformers' logits for each generated step, fed the prompt and the package's own tokens
    (one forward pass, so after a near tie both still see the same text)."""
    ids = torch.tensor([prompt + tokens[:-1]])
    with eval_mode(model):
        try:  # only the steps' logits: a long prompt's full logits would be prompt x vocabulary floats
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=len(tokens)).logits
        except TypeError:  # a model (remote code) without logits_to_keep
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    return [row.numpy() for row in logits[0, -len(tokens):].float()]


def _package_tokenizer(package: Path):
    try:
        return transformers.AutoTokenizer.from_pretrained(package)
    except Exception as error:
        raise ExporterError(f"cannot load the tokenizer of {package}: {str(error).strip().splitlines()[0]}") from error


def _describe(source: Any) -> str:
    return f"an in-memory {type(source).__name__}" if isinstance(source, transformers.PreTrainedModel) else f"'{source}'"
