"""Greedy generation with ONNX Runtime GenAI on a package's own providers, in a process of its own
(ONNX Runtime's log level is fixed when its first session starts). Prints the tokens as JSON.

    python genai_greedy.py PACKAGE EP '[[prompt ids], ...]' NEW_TOKENS [batched]

``batched``: the prompts (of one length) go through GenAI as one batch instead of one by one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import onnxruntime_genai as og

from ep_profiles import get_profile
from exporter.ep_runtime import register

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


def batched_greedy(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    import numpy as np

    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompts[0]) + new_tokens, do_sample=False, batch_size=len(prompts))
    generator = og.Generator(model, params)
    generator.append_tokens(np.array(prompts, dtype=np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [generator.get_sequence(row)[len(prompts[0]):].tolist() for row in range(len(prompts))]


def main(package: str, ep: str, prompts: str, new_tokens: str, mode: str = "one by one") -> None:
    register(get_profile(ep), genai=True)
    run = batched_greedy if mode == "batched" else greedy
    print(json.dumps(run(og.Model(package), json.loads(prompts), int(new_tokens))))


if __name__ == "__main__":
    main(*sys.argv[1:])
