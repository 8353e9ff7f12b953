"""Wall time of export commands (this project's and other exporters', each a shell command),
taking turns in one run: one discarded warm-up each, then --repeats rounds with the order flipped
every round; prints the median seconds of each and its ratio to the first.

    python scripts/compare_export_times.py \\
        "mobius=/path/to/venv/bin/python -m mobius build --config CKPT_MOBIUS out/m --ep cpu --dtype f32 --runtime ort-genai" \\
        "ours=python -m exporter CKPT -o out/o --overwrite --no-cache" \\
        "ours, cached=python -m exporter CKPT -o out/c --overwrite --cache-dir CACHE"

Other exporters stay outside this project's dependencies: give their commands as they are
installed. A command that fails stops the run with its output.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("commands", nargs="+", metavar="NAME=COMMAND", help="a shell command to time, named")
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args()


def run(name: str, command: str) -> float:
    print(f"  {name} ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    done = subprocess.run(command, shell=True, capture_output=True, text=True, check=False)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{name} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return seconds


def main() -> None:
    args = parse_args()
    commands = dict(item.split("=", 1) for item in args.commands)
    for name, command in commands.items():
        run(f"{name} (warm-up)", command)
    times: dict[str, list[float]] = {name: [] for name in commands}
    for repeat in range(args.repeats):
        order = list(commands) if repeat % 2 == 0 else list(reversed(commands))
        for name in order:
            times[name].append(run(name, commands[name]))
    first = statistics.median(times[next(iter(commands))])
    print(f"\n## Export wall time (median of {args.repeats}, taking turns, after a warm-up each)\n")
    print(f"| command | seconds | runs | / {next(iter(commands))} |\n|---|---:|---|---:|")
    for name, values in times.items():
        median = statistics.median(values)
        print(f"| {name} | {median:.1f} | {', '.join(f'{v:.1f}' for v in values)} | {median / first:.2f} |")


if __name__ == "__main__":
    main()
