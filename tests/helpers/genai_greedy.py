"""Greedy generation with ONNX Runtime GenAI on a package's own providers, in a process of its own
(ONNX Runtime's log level is fixed when its first session starts). Prints the tokens as JSON.

    python genai_greedy.py PACKAGE EP '[[prompt ids], ...]' NEW_TOKENS [batched]

``batched``: the prompts go through GenAI as one batch instead of one by one, shorter ones padded
on the right with the package's pad token.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import onnxruntime_genai as og

from ep_profiles import get_profile
from exporter.verify.ep_runtime import register

GREEDY_SCRIPT = Path(__file__)  # run as a script: a process of its own


def greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    results = []
    for prompt in prompts:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + new_tokens, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens([prompt])
        while not generator.is_done():
            generator.generate_next_token()
        results.append(generator.get_sequence(0)[len(prompt):].tolist())
        del generator
    return results


def batched_greedy(model, prompts: list[list[int]], new_tokens: int, pad_token_id: int = 0) -> list[list[int]]:
    """The prompts as one batch, shorter ones padded on the right with ``pad_token_id`` (as
    GenAI's own tokenizer pads a batch); each row's new tokens."""
    import numpy as np

    width = max(len(prompt) for prompt in prompts)
    rows = [prompt + [pad_token_id] * (width - len(prompt)) for prompt in prompts]
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=width + new_tokens, do_sample=False, batch_size=len(prompts))
    generator = og.Generator(model, params)
    generator.append_tokens(np.array(rows, dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [generator.get_sequence(row)[width:].tolist() for row in range(len(prompts))]


def package_pad_token_id(package: str | Path) -> int:
    return json.loads((Path(package) / "genai_config.json").read_text())["model"]["pad_token_id"]


def main(package: str, ep: str, prompts: str, new_tokens: str, mode: str = "one by one") -> None:
    register(get_profile(ep), genai=True)
    model, prompts, new_tokens = og.Model(package), json.loads(prompts), int(new_tokens)
    if mode == "batched":
        print(json.dumps(batched_greedy(model, prompts, new_tokens, package_pad_token_id(package))))
    else:
        print(json.dumps(greedy(model, prompts, new_tokens)))


if __name__ == "__main__":
    main(*sys.argv[1:])
