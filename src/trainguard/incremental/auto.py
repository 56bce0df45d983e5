"""``compression="auto"``: compress a save only when that lowers its durable time, by measurement.

Model (per save of ``L`` logical bytes, ``n`` encoding threads, storage bandwidth ``bw`` in stored bytes/s,
codec speed ``cs`` in raw bytes/s per thread, stored/raw ratio ``r``)::

    t_off = L / bw
    t_on  = max(L / (cs * n), r * L / bw) + P / cs
    compress  iff  t_on < MARGIN * t_off

The writer's threads encode one piece while others write theirs (and the kernel writes back while encoding
goes on), so encoding and I/O overlap; ``P / cs``, the encoding of the largest piece ``P`` (a tensor, at most
``chunk_size_bytes``), is the pipeline's fill and drain.

``bw`` is measured on saves written uncompressed (stored bytes written / seconds from the first chunk to the
durable sync), and on compressed saves net of the encoding time; ``cs`` and ``r`` come from the last compressed
save, or from compressing a sample of the state (up to ``SAMPLE_BYTES``) while none has been. The first save
is written uncompressed (nothing is known about the storage yet). Each estimate is an exponentially weighted
average (``ALPHA``). The decision and its inputs are logged and put into the save's event.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any

from .codecs import compress

MODES = ("auto", "zstd", "off")
MARGIN = 0.95
ALPHA = 0.5
SAMPLE_BYTES = 4 << 20


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
    """

    def __init__(self, mode: str, *, threads: int) -> None:
        if mode not in MODES:
            raise ValueError(f"compression must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.threads = max(1, min(threads, os.cpu_count() or 1))
        self.bw_Bps: float | None = None
        self.codec_Bps: float | None = None
        self.ratio: float | None = None

    @staticmethod
    def _ewma(old: float | None, new: float) -> float:
        return new if old is None else ALPHA * new + (1 - ALPHA) * old

    def decide(
        self,
        logical_bytes: int,
        sample: list[tuple[memoryview, int]] | None = None,
        *,
        piece_bytes: int = 0,
    ) -> Decision:
        """Decide for a save of ``logical_bytes`` whose largest piece is ``piece_bytes``; ``sample`` ((bytes,
        itemsize) pairs of the state) measures the codec when it has not run yet."""
        if self.mode != "auto":
            return Decision(self.mode == "zstd", f"compression={self.mode!r}")
        if self.codec_Bps is None and sample:
            self._measure_sample(sample)
        inputs = {
            "write_bw_Bps": self.bw_Bps,
            "codec_Bps": self.codec_Bps,
            "ratio": self.ratio,
            "threads": self.threads,
            "logical_bytes": logical_bytes,
        }
        if self.bw_Bps is None or self.codec_Bps is None or self.ratio is None:
            return Decision(
                False, "auto: storage bandwidth not measured yet (first save uncompressed)", inputs
            )
        t_off = logical_bytes / self.bw_Bps
        t_on = max(
            logical_bytes / (self.codec_Bps * self.threads), self.ratio * logical_bytes / self.bw_Bps
        ) + min(piece_bytes, logical_bytes) / self.codec_Bps
        inputs.update(t_off_s=t_off, t_on_s=t_on)
        if t_on < MARGIN * t_off:
            return Decision(True, "auto: compressing lowers the estimated durable time", inputs)
        return Decision(False, "auto: the storage is faster than compressing saves", inputs)

    def _measure_sample(self, sample: list[tuple[memoryview, int]]) -> None:
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
        stored_written: int,
        raw_encoded: int,
        stored_encoded: int,
        encode_s: float,
        write_s: float,
    ) -> None:
        """Record what a committed save measured: stored bytes written and the seconds of its write phase
        (chunks + durable sync), and for a compressed save the raw and stored bytes encoded and the encoding
        CPU seconds (all threads)."""
        if compressed and raw_encoded and encode_s > 0:
            self.codec_Bps = self._ewma(self.codec_Bps, raw_encoded / encode_s)
            self.ratio = self._ewma(self.ratio, stored_encoded / raw_encoded)
        io_s = write_s - (encode_s / self.threads if compressed else 0.0)
        if stored_written >= (1 << 20) and io_s > 0:  # a tiny write measures latency, not bandwidth
            self.bw_Bps = self._ewma(self.bw_Bps, stored_written / io_s)


def state_sample(
    views: list[tuple[memoryview, int]], limit: int = SAMPLE_BYTES
) -> list[tuple[memoryview, int]]:
    """Up to ``limit`` bytes spread over the largest tensors (the codec's speed and ratio on this state)."""
    big = sorted(views, key=lambda v: -len(v[0]))[:8]
    per = max(limit // max(len(big), 1), 4096)
    return [(v[:per], s) for v, s in big if len(v)]
