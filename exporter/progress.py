"""What the command line (and ``export(progress=True)``) shows while an export runs: one line per
stage on stderr, and while the weights are written, a tqdm bar of bytes and tensors written with
throughput and time left. On a terminal the stage line counts seconds; elsewhere (a CI log, a pipe)
there is one line per stage start and end, and no bar. In a Jupyter notebook the bar is tqdm's
widget."""

from __future__ import annotations

import contextlib
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator

from exporter.stages import StageRecord

STAGE_TITLES = {
    "load": "loading the model",
    "trace": "tracing with torch.export",
    "fx_passes": "running FX passes",
    "lower": "lowering to ONNX",
    "onnx_passes": "running ONNX passes",
    "package": "writing the package",
    "sample_prefill": "running a sample prefill on the CPU",
}

# The stage whose time is the weights' write, shown as a bar rather than a counting line.
_WRITING = "package"


def stage_title(name: str) -> str:
    step, _, session = name.partition(":")
    return STAGE_TITLES.get(step, step) + (f" ({session} session)" if session else "")


def _in_notebook() -> bool:
    return "ipykernel" in sys.modules


class ProgressDisplay:
    """Called as ``on_stage(name, record)``; ``writing(tensors, total_bytes)`` gives the callback
    the package writer calls with each tensor's size."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr  # looked up now: sys.stderr may have been replaced since import
        self.live = self.stream.isatty()
        self._ticker: threading.Thread | None = None
        self._stop = threading.Event()

    def __call__(self, name: str, record: StageRecord | None) -> None:
        title = stage_title(name)
        if record is None:
            self._start(title, ticking=self.live and name != _WRITING)
        else:
            self._finish(title, record)

    @contextlib.contextmanager
    def writing(self, tensors: int, total_bytes: int) -> Iterator[Callable[[int], None]]:
        if not (self.live or _in_notebook()):
            yield lambda size: None
            return
        from tqdm.auto import tqdm

        # A terminal that reports no size (0 x 0, as some CI ptys do) would hide tqdm's bar; in a
        # notebook tqdm's widget sizes itself (ncols there would be pixels).
        size = shutil.get_terminal_size((100, 24))
        shape = {} if _in_notebook() else {"ncols": min(size.columns, 120), "nrows": size.lines}
        with tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, file=self.stream,
                  desc="    weights", leave=False, mininterval=0.25, **shape) as bar:
            written = 0

            def tensor_written(size: int) -> None:
                nonlocal written
                written += 1
                bar.set_postfix_str(f"{written}/{tensors} tensors", refresh=False)
                bar.update(size)

            yield tensor_written
            bar.refresh()  # the last count, whatever mininterval skipped

    def _start(self, title: str, ticking: bool) -> None:
        if not ticking:
            print(f"  {title} ...", file=self.stream, flush=True)
            return
        self._stop.clear()
        started = time.perf_counter()

        def tick():
            while not self._stop.wait(0.5):
                print(f"\r  {title} ... {time.perf_counter() - started:.0f} s", end="", file=self.stream, flush=True)

        self._ticker = threading.Thread(target=tick, daemon=True)
        self._ticker.start()

    def _finish(self, title: str, record: StageRecord) -> None:
        if self._ticker is not None:
            self._stop.set()
            self._ticker.join()
            self._ticker = None
        if record.failed:
            line = f"  {title}: failed after {record.seconds:.1f} s"
        else:
            line = f"  {title}: {record.seconds:.1f} s, peak memory {record.peak_rss_bytes / 2**30:.2f} GiB"
        # On a terminal the line overwrites the ticker's "... N s", so it is padded over it.
        print(f"\r{line:<70}" if self.live else line, file=self.stream, flush=True)
