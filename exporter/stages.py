"""Wall time and resident memory of each pipeline stage, for the report and the benchmark."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int:
    """This process's resident set size, from /proc (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * _PAGE_SIZE
    except OSError:
        return 0


@dataclass(frozen=True)
class StageRecord:
    name: str
    seconds: float
    peak_rss_bytes: int
    end_rss_bytes: int
    failed: bool = False  # the stage raised (listeners hear of it too; the report holds only finished stages)

    def to_dict(self) -> dict:
        return {key: value for key, value in asdict(self).items() if key != "failed"}


class _PeakSampler(threading.Thread):
    """Samples RSS every 20 ms: the kernel keeps only the process-lifetime peak, not a stage's."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = resident_bytes()
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.wait(0.02):
            self.peak = max(self.peak, resident_bytes())

    def stop(self) -> int:
        self._stop_event.set()
        self.join()
        self.peak = max(self.peak, resident_bytes())
        return self.peak


class StageLog:
    """Runs named stages, records each, and tells its listeners when one starts and when it ends,
    by finishing or by raising (``record.failed``)."""

    def __init__(self, *listeners: Callable[[str, StageRecord | None], None]):
        self.records: list[StageRecord] = []
        self._listeners = listeners

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        for listener in self._listeners:
            listener(name, None)
        sampler = _PeakSampler()
        sampler.start()
        start = time.perf_counter()
        failed = True
        try:
            yield
            failed = False
        finally:
            record = StageRecord(name, time.perf_counter() - start, sampler.stop(), resident_bytes(), failed)
            if not failed:
                self.records.append(record)
            for listener in self._listeners:
                listener(name, record)
