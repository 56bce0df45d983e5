"""``compression="auto"``: compress a save only when that lowers its durable time, by measurement.

Two sources, in this order:

1. **Measured** (once both ways were seen): the seconds per logical byte of the write phase (chunks written
   and durable) of the manager's own saves, the best of the last ``WINDOW`` saves per way (interference from
   other work on a shared machine only ever slows a save down, so the best recent save is the least noisy
   estimate of what the storage and codec can do). Compress iff ``measured_on < MARGIN * measured_off``. The way not taken is tried again every ``EXPLORE`` saves, so a
   change of storage speed or machine load is followed. This catches what no model does: other processes on
   the cores, the page cache, the storage's own latency.
2. **Model** (before compression was ever measured), per save of ``L`` logical bytes, ``n`` encoding
   threads, storage bandwidth ``bw`` (stored bytes/s, the best of this manager's recent uncompressed saves), codec
   speed ``cs`` (raw bytes/s per thread) and stored/raw ratio ``r`` (both from compressing a sample of the
   state, up to ``SAMPLE_BYTES``)::

       t_off = L / bw
       t_on  = max(L / (cs * n), r * L / bw) + P / cs        (encoding overlaps I/O; P: largest piece)
       compress (once, to measure it)  iff  t_on < MARGIN * t_off

The first save is written uncompressed (nothing is known about the storage yet). The decision and its inputs
are logged and put into the save's event.
"""

from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from .codecs import compress

MODES = ("auto", "zstd", "off")
MARGIN = 0.95
ALPHA = 0.5
WINDOW = 5
EXPLORE = 16
SAMPLE_BYTES = 4 << 20
SAMPLE_TENSORS = 8
"""The codec sample takes ``SAMPLE_BYTES`` in all from this many of the largest tensors (:func:`state_sample`)."""
MIN_MEASURED_BYTES = 1 << 20  # a smaller save measures latency, not bandwidth
AUTO_MIN_BYTES = 64 << 20
"""``compression="auto"`` leaves a save of fewer tensor bytes than this (64 MiB) uncompressed: its durable time
is dominated by fixed costs (planning, fsync, manifest), so compressing cannot pay, and a decision from timings
that small would follow the machine's noise. ``compression="zstd"`` compresses any size."""


@dataclass
class Decision:
    """Whether this save compresses, why, and the measurements behind it (units in the names)."""

    compress: bool
    reason: str
    inputs: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"compress": self.compress, "reason": self.reason, **self.inputs}


class CompressionChooser:
    """Per-manager state of the ``compression`` option.

    Args:
        mode: ``"auto"``, ``"zstd"`` (always compress: space over time) or ``"off"``.
        threads: encoding threads per rank (the writer's).

    Raises:
        ValueError: an unknown ``mode``.
    """

    def __init__(self, mode: str, *, threads: int) -> None:
        if mode not in MODES:
            raise ValueError(f"compression must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.threads = max(1, min(threads, os.cpu_count() or 1))
        self.bw_Bps: float | None = None
        self.codec_Bps: float | None = None
        self.ratio: float | None = None
        self._s_per_GB: dict[bool, deque[float]] = {}  # write-phase seconds per logical GB, recent, per way
        self._bw: deque[float] = deque(maxlen=WINDOW)
        self.saves = 0
        self.last_tried: dict[bool, int] = {}  # save index at which each way last ran

    @property
    def s_per_GB(self) -> dict[bool, float]:
        """Measured write-phase seconds per logical GB per way (compressed or not): the best recent save."""
        return {k: min(v) for k, v in self._s_per_GB.items() if v}

    @staticmethod
    def _ewma(old: float | None, new: float) -> float:
        return new if old is None else ALPHA * new + (1 - ALPHA) * old

    def decide(
        self,
        logical_bytes: int,
        sample: list[tuple[memoryview, int]] | None = None,
        *,
        piece_bytes: int = 0,
        threads: int | None = None,
    ) -> Decision:
        """Decide for a save of ``logical_bytes`` whose largest piece is ``piece_bytes``; ``sample`` ((bytes,
        itemsize) pairs of the state) measures the codec when it has not run yet. ``threads``: the encoding
        threads this save's writer runs (default: the manager's; an async save's background writer runs fewer
        on few CPUs, :meth:`~trainguard.distributed.options.WriterOptions.background`), the model's ``n``."""
        if self.mode != "auto":
            return Decision(self.mode == "zstd", f"compression={self.mode!r}")
        if self.codec_Bps is None and sample:
            self.measure_sample(sample)
        n = self.threads if threads is None else max(1, min(threads, self.threads))
        measured = self.s_per_GB
        inputs: dict[str, Any] = {
            "write_bw_Bps": self.bw_Bps,
            "codec_Bps": self.codec_Bps,
            "ratio": self.ratio,
            "threads": n,
            "logical_bytes": logical_bytes,
            "measured_off_s_per_GB": measured.get(False),
            "measured_on_s_per_GB": measured.get(True),
        }
        if True in measured and False in measured:
            on, off = measured[True], measured[False]
            better = on < MARGIN * off
            other = not better
            if self.saves - self.last_tried.get(other, 0) >= EXPLORE:
                return Decision(
                    other, "auto: trying the other way again (measurements may have changed)", inputs
                )
            why = "measured faster" if better else "measured not faster"
            return Decision(better, f"auto: compressing {why} on this storage", inputs)
        if self.bw_Bps is None or self.codec_Bps is None or self.ratio is None:
            return Decision(
                False, "auto: storage bandwidth not measured yet (first save uncompressed)", inputs
            )
        t_off = logical_bytes / self.bw_Bps
        t_on = (
            max(logical_bytes / (self.codec_Bps * n), self.ratio * logical_bytes / self.bw_Bps)
            + min(piece_bytes, logical_bytes) / self.codec_Bps
        )
        inputs.update(t_off_s=t_off, t_on_s=t_on)
        if logical_bytes < AUTO_MIN_BYTES:
            return Decision(
                False, "auto: a state under 64 MiB is not compressed (fixed costs dominate)", inputs
            )
        if t_on < MARGIN * t_off:
            return Decision(
                True, "auto: the model says compressing lowers the durable time (measuring it)", inputs
            )
        return Decision(False, "auto: the model says the storage is faster than compressing", inputs)

    def needs_sample(self) -> bool:
        """Whether :meth:`decide` would compress a sample of the state now (``"auto"``, codec not measured)."""
        return self.mode == "auto" and self.codec_Bps is None

    def sample_can_wait(self) -> bool:
        """Whether this save's decision is the same without the sample (the storage bandwidth is not known
        yet, so the save is uncompressed whatever the codec does): the sample can then be measured beside the
        save's writes (:meth:`measure_sample`) instead of before them."""
        return self.needs_sample() and self.bw_Bps is None

    def measure_sample(self, sample: list[tuple[memoryview, int]]) -> None:
        """Compress ``sample`` ((bytes, itemsize) pairs, up to ``SAMPLE_BYTES``) to measure the codec's speed
        (bytes/s, one thread) and ratio on this state."""
        raw = stored = 0
        t0 = time.perf_counter()
        for view, itemsize in sample:
            take = view[: max(0, SAMPLE_BYTES - raw)]
            if not len(take):
                break
            stored += len(compress(take, itemsize))
            raw += len(take)
        dt = time.perf_counter() - t0
        if raw and dt > 0:
            self.codec_Bps = raw / dt
            self.ratio = stored / raw

    def observe(
        self,
        *,
        compressed: bool,
        logical_bytes: int,
        stored_written: int,
        raw_encoded: int,
        stored_encoded: int,
        encode_s: float,
        write_s: float,
    ) -> None:
        """Record what a committed save measured: its logical bytes, the stored bytes it wrote and the seconds
        of its write phase (chunks + durable sync), and for a compressed save the raw and stored bytes encoded
        and the encoding seconds (all threads)."""
        self.saves += 1
        self.last_tried[compressed] = self.saves
        if compressed and raw_encoded and encode_s > 0:
            self.codec_Bps = self._ewma(self.codec_Bps, raw_encoded / encode_s)
            self.ratio = self._ewma(self.ratio, stored_encoded / raw_encoded)
        if logical_bytes >= MIN_MEASURED_BYTES and write_s > 0:
            self._s_per_GB.setdefault(compressed, deque(maxlen=WINDOW)).append(write_s / logical_bytes * 1e9)
        if not compressed and stored_written >= MIN_MEASURED_BYTES and write_s > 0:
            self._bw.append(stored_written / write_s)
            self.bw_Bps = max(self._bw)


def state_sample(
    views: list[tuple[memoryview, int]], limit: int = SAMPLE_BYTES
) -> list[tuple[memoryview, int]]:
    """Up to ``limit`` bytes spread over the ``SAMPLE_TENSORS`` largest tensors (the codec's speed and ratio
    on this state)."""
    big = sorted(views, key=lambda v: -len(v[0]))[:SAMPLE_TENSORS]
    per = max(limit // max(len(big), 1), 4096)
    return [(v[:per], s) for v, s in big if len(v)]
