"""Prometheus metrics derived from the run's event log (prometheus-client).

One :class:`RunMetrics` consumes event records, so the numbers move exactly as the event log says (no second
source of truth). The supervisor (``trainguard run --metrics-port PORT``) feeds it its own events and those
of the job it tails, and serves it over HTTP; each :class:`~trainguard.CheckpointManager` feeds the save
metrics of its own events into an in-process registry (``mgr.metrics_registry``).

Metrics (names and labels follow the Prometheus conventions: base units in names, ``_total`` counters):

==================================  =========  ==============================================================
name                                type       from
==================================  =========  ==============================================================
``trainguard_restarts_total``       counter    ``restart`` events
``trainguard_failures_total``       counter    ``failure`` events, label ``cause`` (exit, signal, hang,
                                               preempted)
``trainguard_ttr_seconds``          histogram  ``recovery`` events, label ``phase`` (each TTR phase without
                                               its ``_s`` suffix, and ``total``)
``trainguard_last_valid_step``      gauge      newest committed step not deleted by retention nor found
                                               corrupt at a restore (-1 before the first)
``trainguard_goodput_ratio``        gauge      productive time / wall time (see :mod:`.figures`)
``trainguard_save_block_seconds``   histogram  ``save`` events: ``block_s``
``trainguard_save_persist_seconds`` histogram  ``save`` events: ``persist_s``
``trainguard_checkpoint_bytes``     gauge      ``save`` events: ``bytes`` of the newest checkpoint
``trainguard_save_failures_total``  counter    ``save_failed`` events (the supervisor counts rank 0's: a
                                               failed collective save is logged by every rank)
==================================  =========  ==============================================================

The HTTP endpoint binds to 127.0.0.1 only: metrics describe a run (steps, timings) and the endpoint has no
authentication; Prometheus scrapes through a local agent or a port forward.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from ..errors import ConfigError
from ..recovery.ttr import PHASES

HOST = "127.0.0.1"
"""The only address the metrics endpoint binds to."""

TTR_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
SAVE_BUCKETS_S = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
GOODPUT_EVERY_S = 2.0
"""The goodput gauge is recomputed from the records at most this often (it reads them all), and at most every
20 times its last computation's duration."""
_GOODPUT_FIELDS = (
    "t",
    "event",
    "run_id",
    "restart_count",
    "pid",
    "rank",
    "step",
    "persist_s",
    "block_s",
    "last_step",
    "t_death",
)
"""What :func:`.figures.goodput` reads: the records kept for it are cut down to these fields."""


class SaveMetrics:
    """The manager's save metrics in a prometheus-client registry.

    Args:
        registry: where to register; None: a new private ``CollectorRegistry`` (two managers in one process
            do not clash). Pass ``prometheus_client.REGISTRY`` to export through the default registry.

    With no ``registry`` given, prometheus-client is imported and the metrics registered when first needed:
    the first read of :attr:`registry` or the first save event. A relaunch that restores and trains until its
    next save does not pay for it (importing prometheus-client, with http.server behind it, took 15-20 ms and,
    after ``import torch``, set off a full garbage collection of 0.15-0.2 s on this machine:
    benchmarks/RESULTS.md, "Time to resume").
    """

    def __init__(self, registry: Any = None) -> None:
        self.rank0_only = False  # count every save_failed seen (a manager sees only its own rank's)
        self._registry = registry
        self._made = False
        self._make_lock = threading.Lock()  # events arrive from the training and the persist threads
        if registry is not None:  # the caller imported prometheus-client already: register now
            self._make()

    @property
    def registry(self) -> Any:
        """The prometheus-client registry holding these metrics (made on first use when none was given)."""
        self._make()
        return self._registry

    def _make(self) -> None:
        if self._made:
            return
        with self._make_lock:
            if not self._made:
                self._register()
                self._made = True

    def _register(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        if self._registry is None:
            self._registry = CollectorRegistry(auto_describe=True)
        registry = self._registry
        self.save_block = Histogram(
            "trainguard_save_block_seconds",
            "Seconds each checkpoint save blocked training (staging copy; the whole save if synchronous).",
            buckets=SAVE_BUCKETS_S,
            registry=registry,
        )
        self.save_persist = Histogram(
            "trainguard_save_persist_seconds",
            "Seconds from the start of each save until its checkpoint was committed (durable).",
            buckets=SAVE_BUCKETS_S,
            registry=registry,
        )
        self.checkpoint_bytes = Gauge(
            "trainguard_checkpoint_bytes",
            "Bytes of chunk data referenced by the newest committed checkpoint.",
            registry=registry,
        )
        self.save_failures = Counter(
            "trainguard_save_failures_total",
            "Checkpoint saves that failed (nothing committed).",
            registry=registry,
        )

    def observe(self, rec: dict[str, Any]) -> None:
        """Update from one event record (other events are ignored).

        Args:
            rec: an event record as written by :class:`~trainguard.eventlog.EventLog`.
        """
        name = rec.get("event")
        if name in ("save", "save_failed"):
            self._make()
        if name == "save":
            block, persist, size = (
                _num(rec.get("block_s")),
                _num(rec.get("persist_s")),
                _num(rec.get("bytes")),
            )
            if block is not None:
                self.save_block.observe(block)
            if persist is not None:
                self.save_persist.observe(persist)
            if size is not None:
                self.checkpoint_bytes.set(size)
        elif name == "save_failed" and (not self.rank0_only or rec.get("rank") in (0, None)):
            self.save_failures.inc()


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


class RunMetrics(SaveMetrics):
    """Every trainguard metric of a run (the supervisor's endpoint), fed by event records.

    Args:
        registry: see :class:`SaveMetrics`.

    Thread-safe: ``observe`` may run in the supervisor's loop while the HTTP thread collects.
    """

    def __init__(self, registry: Any = None) -> None:
        from prometheus_client import Counter, Gauge, Histogram

        super().__init__(registry)
        self._make()  # the supervisor serves these: registered at once
        self.rank0_only = True  # one failed collective save is one failure, not one per rank
        self.restarts = Counter(
            "trainguard_restarts_total", "Relaunches of the job by the supervisor.", registry=self.registry
        )
        self.failures = Counter(
            "trainguard_failures_total",
            "Failures of the job by cause (exit, signal, hang, preempted).",
            ["cause"],
            registry=self.registry,
        )
        self.ttr = Histogram(
            "trainguard_ttr_seconds",
            "Time to resume of each recovery, by phase (total: failure to first step after the restore).",
            ["phase"],
            buckets=TTR_BUCKETS_S,
            registry=self.registry,
        )
        self.last_valid_step = Gauge(
            "trainguard_last_valid_step",
            "Newest committed checkpoint step not deleted nor found corrupt (-1: none yet).",
            registry=self.registry,
        )
        self.goodput = Gauge(
            "trainguard_goodput_ratio",
            "Productive training time over wall time of the run so far (0 to 1).",
            registry=self.registry,
        )
        self.last_valid_step.set(-1)
        self._lock = threading.Lock()
        self._records: list[dict[str, Any]] = []
        self._valid: set[int] = set()
        self._goodput_t = 0.0
        self._goodput_cost_s = 0.0  # seconds the last goodput recomputation took
        self._stale = False  # records arrived since the goodput gauge was last computed

    def observe(self, rec: dict[str, Any]) -> None:
        with self._lock:
            self._observe(rec)
            self._stale = True

    def observe_all(self, records: list[dict[str, Any]]) -> None:
        """Update from several records (possibly none), then refresh the goodput gauge if records arrived
        since it was computed (at most every :data:`GOODPUT_EVERY_S`)."""
        with self._lock:
            for rec in records:
                self._observe(rec)
            self._stale = self._stale or bool(records)
            now = time.monotonic()
            # A long run's log makes the recomputation slower: keep it under ~5% of one core.
            if self._stale and now - self._goodput_t >= max(GOODPUT_EVERY_S, 20 * self._goodput_cost_s):
                self._refresh_goodput()
                self._goodput_t = now

    def refresh(self) -> None:
        """Recompute the goodput gauge now (e.g. at the end of a run)."""
        with self._lock:
            self._refresh_goodput()

    def _refresh_goodput(self) -> None:
        from .figures import goodput

        self._stale = False
        t0 = time.perf_counter()
        value, _ = goodput(sorted(self._records, key=lambda r: float(r.get("t", 0.0))), samples=1)
        self._goodput_cost_s = time.perf_counter() - t0
        if value is not None:
            self.goodput.set(value)

    def _observe(self, rec: dict[str, Any]) -> None:
        super().observe(rec)
        self._records.append({k: rec[k] for k in _GOODPUT_FIELDS if k in rec})
        name, step = rec.get("event"), rec.get("step")
        if name == "restart":
            self.restarts.inc()
        elif name == "failure":
            self.failures.labels(cause=str(rec.get("cause") or "unknown")).inc()
        elif name == "recovery":
            phases = rec.get("phases")
            for phase in PHASES:
                v = _num(phases.get(phase)) if isinstance(phases, dict) else None
                if v is not None:
                    self.ttr.labels(phase=phase[:-2]).observe(v)
            ttr = _num(rec.get("ttr_s"))
            if ttr is not None:
                self.ttr.labels(phase="total").observe(ttr)
        elif name in ("save", "restore") and isinstance(step, int) and rec.get("rank") in (0, None):
            self._valid.add(step)
        elif name in ("retention_delete", "restore_skipped") and isinstance(step, int):
            self._valid.discard(step)
        else:
            return
        self.last_valid_step.set(max(self._valid) if self._valid else -1)


def check_port(port: object) -> None:
    """Raise :class:`~trainguard.errors.ConfigError` unless ``port`` is a TCP port number (0: any free port)."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ConfigError(f"metrics port must be an int in 0..65535 (0: any free port), got {port!r}")


class MetricsServer:
    """An HTTP endpoint serving a registry in the Prometheus text format at ``/metrics`` (any path works).

    Args:
        registry: the prometheus-client registry to serve.
        port: TCP port (0: any free port; see :attr:`port`).

    Raises:
        ConfigError: the port is out of range or cannot be bound (in use, no permission).
    """

    def __init__(self, registry: Any, port: int) -> None:
        from prometheus_client import start_http_server

        check_port(port)
        try:
            self._server, self._thread = start_http_server(port, addr=HOST, registry=registry)
        except OSError as e:
            raise ConfigError(
                f"cannot serve metrics on {HOST}:{port}: {e}; pick a free port (or 0 for any free port)"
            ) from e
        self.host = HOST
        self.port = int(self._server.server_address[1])

    @property
    def url(self) -> str:
        """The scrape URL."""
        return f"http://{self.host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()
