"""``CheckpointManager``: the one place that wires the pieces together (DESIGN.md section 2).

Typical use (DESIGN.md section 1)::

    mgr = tg.CheckpointManager("ckpts/run1", save_policy=tg.EveryNSteps(100), keep=3)
    state = {"model": model, "optim": optim, "sched": sched, "loader": loader, "rng": tg.RNGState()}
    start = mgr.restore_latest(state)          # newest VALID step loaded in place, or None
    for step in range((start or 0) + 1, total_steps + 1):
        loss = train_step(...)
        mgr.maybe_save(step, state, metrics={"loss": loss})
    mgr.close()
"""

from __future__ import annotations

import contextlib
import logging
import warnings
import os
import secrets
import time
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.storage import WriteResult

from . import _statefn
from ._lock import RootLock
from ._time import iso
from .catalog import CORRUPT_MARKER, CheckpointInfo, inspect_step, read_manifest, scan, step_dirs
from .distributed import TrainguardLoadPlanner, TrainguardReader, TrainguardSavePlanner, TrainguardWriter
from .distributed.writer import WriterOptions
from .errors import (
    CheckpointExistsError,
    ConfigError,
    CorruptCheckpointError,
    NoValidCheckpointError,
    SaveError,
    StorageFullError,
    TrainguardError,
)
from .format import (
    ChunkRecord,
    Manifest,
    Segment,
    ShardRecord,
    TensorEntry,
    ValueEntry,
    chunk_relpath,
    manifest_to_json,
    step_dir_name,
)
from .format.layout import MANIFEST_NAME, partial_dir_name
from .incremental.chunkstore import ChunkStore
from .policies import SavePolicy
from .recovery.events import EventLog
from .retention import RetentionPolicy, as_retention
from .state.dtypes import dtype_name
from .storage.local import atomic_write, fsync_dir, remove_tree

log = logging.getLogger("trainguard")


@dataclass(frozen=True)
class SaveResult:
    """Outcome of one committed save.

    Attributes:
        step: the step saved.
        bytes: bytes of chunk data the checkpoint references.
        bytes_written: bytes actually written (chunks already present are not written again).
        block_s: seconds the caller was blocked.
        persist_s: seconds from the start of the save to the commit.
    """

    step: int
    bytes: int
    bytes_written: int
    block_s: float
    persist_s: float


@dataclass
class RestoreTimings:
    """Phases of the last restore, in seconds (joined into time-to-resume by the supervisor)."""

    scan_s: float = 0.0
    load_s: float = 0.0
    validate_s: float = 0.0
    bytes: int = 0
    skipped: list[dict[str, Any]] = field(default_factory=list)


class CheckpointManager:
    """Saves and restores the whole training state under one run root.

    Args:
        root: the run root directory (created if missing).
        save_policy: decides the steps ``maybe_save`` saves at (default: every 1000 steps).
        keep: retention: an int N keeps the newest N valid checkpoints, a RetentionPolicy, or None to keep all.
            Applied only after a new checkpoint commits; the newest valid checkpoint is never deleted.
        read_only: open without the write lock (list, verify and restore only).
        fsync: make every save durable (default True).
        chunk_size_bytes: largest chunk, in bytes (default 64 MiB).
        save_on_preemption: on SIGTERM, save at the next ``maybe_save`` and exit cleanly.

    Raises:
        RootLockedError: another process holds the write lock of ``root``.
        ConfigError: an invalid argument.

    Not thread-safe: call it from the training loop's thread.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        save_policy: SavePolicy | None = None,
        keep: int | RetentionPolicy | None = None,
        read_only: bool = False,
        fsync: bool = True,
        chunk_size_bytes: int = 64 << 20,
        save_on_preemption: bool = False,
    ) -> None:
        from .policies import EveryNSteps

        if isinstance(root, str) and "://" in root:
            raise ConfigError(f"{root!r}: only local directories are supported as run roots so far")
        self.root = Path(root)
        self.read_only = read_only
        self.save_policy: SavePolicy = save_policy if save_policy is not None else EveryNSteps(1000)
        if not isinstance(self.save_policy, SavePolicy):
            raise ConfigError(f"save_policy must have should_save()/record_save(), got {type(save_policy).__name__}")
        self.retention = as_retention(keep)
        self.options = WriterOptions(chunk_size_bytes=chunk_size_bytes, pack_threshold_bytes=min(1 << 20, chunk_size_bytes))
        self.store = ChunkStore(self.root, fsync=fsync)
        self.fsync = fsync
        self.last_restore = RestoreTimings()
        self.saves: list[SaveResult] = []
        self._closed = False
        self._lock: RootLock | None = None
        self._events: EventLog | None = None
        self._first_step_logged = False
        self._manifest_chunks: dict[int, set[str]] = {}
        if read_only:
            if not self.root.is_dir():
                raise ConfigError(f"run root {self.root} does not exist")
            return
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = RootLock(self.root)
        self._lock.acquire()
        self._events = EventLog(self.root, "manager")
        self._cleanup_after_crash()
        bind = getattr(self.save_policy, "bind", None)
        if callable(bind):
            bind(str(self.root), self._events)
        self._preemption = False
        if save_on_preemption:
            from .recovery.heartbeat import install_preemption_handler

            install_preemption_handler()
            self._preemption = True
        self._events.write("manager_start", root=str(self.root))

    # -- context manager ----------------------------------------------------------------------------------
    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Flush pending work and release the write lock. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._events is not None:
            self._events.close()
        if self._lock is not None:
            self._lock.release()

    def _check_writable(self) -> None:
        if self._closed:
            raise TrainguardError("this CheckpointManager is closed; create a new one")
        if self.read_only:
            raise TrainguardError("this CheckpointManager was opened with read_only=True; it cannot save")

    def _event(self, name: str, **fields: Any) -> None:
        if self._events is not None:
            self._events.write(name, **fields)

    # -- saving -------------------------------------------------------------------------------------------
    def maybe_save(self, step: int, state: Mapping[str, Any], *, metrics: Mapping[str, Any] | None = None) -> SaveResult | None:
        """Beat the heartbeat and save if the save policy says so (or a preemption was requested).

        Returns the SaveResult, or None when no save was due.
        """
        from .recovery.heartbeat import heartbeat, preemption_requested

        heartbeat(step)
        if not self._first_step_logged:
            self._first_step_logged = True
            self._event("first_step", step=step)
        if self._preemption and preemption_requested():
            self._event("preemption", step=step)
            from .recovery.heartbeat import exit_after_preemption_save

            if not (self.root / step_dir_name(step) / MANIFEST_NAME).exists():
                self.save(step, state, metrics=metrics)
            self.close()
            exit_after_preemption_save()
        if self.save_policy.should_save(step, now_s=time.monotonic()):
            return self.save(step, state, metrics=metrics)
        return None

    def save(
        self,
        step: int,
        state: Mapping[str, Any],
        *,
        metrics: Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        overwrite: bool = False,
    ) -> SaveResult:
        """Save ``state`` as the checkpoint of ``step`` and commit it.

        Args:
            step: the training step (int >= 0).
            state: name -> object with state_dict()/load_state_dict(), tensor, or nested dict/list/tuple of
                tensors and plain Python values.
            metrics: numbers recorded in the manifest (e.g. loss).
            metadata: JSON-able user metadata recorded in the manifest.
            overwrite: replace an existing checkpoint of this step.

        Returns:
            SaveResult with sizes and timings.

        Raises:
            CheckpointExistsError: the step is already committed and ``overwrite`` is False.
            StorageFullError: the disk filled up; nothing committed, earlier checkpoints intact.
            SaveError: any other failure; nothing committed, earlier checkpoints intact.
        """
        self._check_writable()
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ConfigError(f"step must be an int >= 0, got {step!r}")
        if (self.root / step_dir_name(step) / MANIFEST_NAME).exists() and not overwrite:
            raise CheckpointExistsError(
                f"step {step} already has a committed checkpoint under {self.root}; pass overwrite=True to replace it"
            )
        t0 = time.perf_counter()
        now0 = time.monotonic()
        flat, paths, top = _statefn.collect(state)
        partial = self.root / partial_dir_name(step, secrets.token_hex(4))
        partial.mkdir()
        manifest_box: list[Manifest] = []

        def commit(md: Metadata, results: list[list[WriteResult]]) -> None:
            m = self._build_manifest(step, md, results, paths, top, metrics, metadata)
            self._publish(m)
            manifest_box.append(m)

        writer = TrainguardWriter(self.store, partial, commit, self.options, step)
        try:
            with _quiet_dcp():
                dcp.save(flat, storage_writer=writer, planner=TrainguardSavePlanner(), no_dist=True)
        except BaseException as e:
            err = _unwrap(e)
            self._event("save_failed", step=step, error=f"{type(err).__name__}: {err}")
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise err from None
            if isinstance(err, TrainguardError) and not isinstance(err, SaveError) and not isinstance(err, OSError):
                raise err from None
            if isinstance(err, SaveError):
                raise err from None
            raise SaveError(
                f"saving step {step} failed: {type(err).__name__}: {err}; nothing was committed and earlier "
                "checkpoints are intact", step=step, rank_errors={0: err},
            ) from err
        finally:
            self.store.unpin(writer.hashes)
            remove_tree(partial)
        m = manifest_box[0]
        self._manifest_chunks[step] = set(m.chunks)
        elapsed = time.perf_counter() - t0
        result = SaveResult(step=step, bytes=m.bytes, bytes_written=writer.bytes_written, block_s=elapsed,
                            persist_s=elapsed)
        self.saves.append(result)
        self._event("save", step=step, bytes=result.bytes, bytes_written=result.bytes_written,
                    block_s=result.block_s, persist_s=result.persist_s, chunks=len(m.chunks))
        self.save_policy.record_save(step, now_s=now0, block_s=elapsed, persist_s=None)
        self.save_policy.record_save(step, now_s=time.monotonic(), block_s=elapsed, persist_s=elapsed)
        self._apply_retention()
        return result

    def _build_manifest(self, step: int, md: Metadata, results: list[list[WriteResult]], paths: Mapping[str, Any],
                        top: dict[str, dict[str, Any]], metrics: Mapping[str, Any] | None,
                        metadata: Mapping[str, Any] | None) -> Manifest:
        by_index: dict[tuple[str, tuple[int, ...]], dict[str, Any]] = {}
        chunks: dict[str, ChunkRecord] = {}
        for rank_results in results:
            for wr in rank_results:
                sd = wr.storage_data
                by_index[(wr.index.fqn, tuple(wr.index.offset or ()))] = sd
                for h, info in sd.get("chunks", {}).items():
                    chunks[h] = ChunkRecord(h, chunk_relpath(h), info["length"], info["crc32c"], info["codec"])
        entries: dict[str, TensorEntry | ValueEntry] = {}
        for fqn, smd in md.state_dict_metadata.items():
            path = tuple(paths[fqn])
            if isinstance(smd, TensorStorageMetadata):
                shards = []
                for c in smd.chunks:
                    sd = by_index[(fqn, tuple(c.offsets))]
                    segs = tuple(Segment(h, o, n) for h, o, n in sd["segments"])
                    shards.append(ShardRecord(tuple(c.offsets), tuple(c.sizes), segs))
                entries[fqn] = TensorEntry(fqn, path, dtype_name(smd.properties.dtype), tuple(smd.size), tuple(shards))
            elif isinstance(smd, BytesStorageMetadata):
                sd = by_index[(fqn, ())]
                if "value" in sd:
                    entries[fqn] = ValueEntry(fqn, path, "json", sd["value"], None)
                else:
                    segs = tuple(Segment(h, o, n) for h, o, n in sd["segments"])
                    entries[fqn] = ValueEntry(fqn, path, sd["codec"], None, segs)
        t = time.time()
        return Manifest(step=step, t=t, time=iso(t), world_size=len(results), entries=entries, chunks=chunks,
                        metrics=dict(metrics or {}), metadata=dict(metadata or {}), top_level=top)

    def _publish(self, m: Manifest) -> None:
        """The commit: chunks are durable already; create the step directory and publish the manifest last."""
        d = self.root / step_dir_name(m.step)
        created = not d.exists()
        d.mkdir(exist_ok=True)
        if created and self.fsync:
            fsync_dir(self.root)
        try:
            (d / CORRUPT_MARKER).unlink()
        except FileNotFoundError:
            pass
        atomic_write(d / MANIFEST_NAME, manifest_to_json(m), fsync=self.fsync)

    # -- retention ----------------------------------------------------------------------------------------
    def _chunks_of(self, step: int) -> set[str] | None:
        if step not in self._manifest_chunks:
            try:
                self._manifest_chunks[step] = set(read_manifest(self.root, step).chunks)
            except TrainguardError:
                return None
        return self._manifest_chunks[step]

    def _apply_retention(self) -> None:
        infos = [i for i in self.checkpoints() if i.status == "valid"]
        valid = [i.step for i in infos]
        if not valid:
            return
        keep = set(self.retention.keep(valid)) | {max(valid)}
        doomed = [s for s in valid if s not in keep]
        if not doomed:
            return
        candidates: set[str] = set()
        for s in doomed:
            candidates |= self._chunks_of(s) or set()
            d = self.root / step_dir_name(s)
            try:
                (d / MANIFEST_NAME).unlink()  # uncommit first: a crash after this leaves garbage, never a half checkpoint
            except FileNotFoundError:
                pass
            remove_tree(d)
            self._manifest_chunks.pop(s, None)
            self._event("retention_delete", step=s)
        referenced: set[str] = set()
        steps, _ = step_dirs(self.root)
        for s in steps:
            referenced |= self._chunks_of(s) or set()
        freed = self.store.collect(candidates, referenced)
        log.info("retention deleted steps %s (%d bytes freed)", doomed, freed)

    def _cleanup_after_crash(self) -> None:
        """With the lock held: remove partial directories of dead writers and the orphan chunks they left."""
        steps, partials = step_dirs(self.root)
        if not partials:
            return
        for ps in partials.values():
            for p in ps:
                remove_tree(p)
        referenced: set[str] = set()
        for s in steps:
            chunks = self._chunks_of(s)
            if chunks is None and (self.root / step_dir_name(s) / MANIFEST_NAME).exists():
                log.warning("manifest of step %s is unreadable; not collecting orphan chunks", s)
                return
            referenced |= chunks or set()
        freed = self.store.collect(self.store.all_hashes(), referenced)
        self._event("cleanup", partials=sum(len(v) for v in partials.values()), orphan_bytes_freed=freed)

    # -- listing ------------------------------------------------------------------------------------------
    def checkpoints(self) -> list[CheckpointInfo]:
        """Every checkpoint under the root with status (valid / corrupt / incomplete), bytes and time,
        ascending by step. Cheap: reads manifests and stats chunks; ``verify`` re-reads data."""
        return scan(self.root, self.store)

    def latest_step(self) -> int | None:
        """The newest step whose checkpoint lists as valid, or None."""
        valid = [i.step for i in self.checkpoints() if i.status == "valid"]
        return max(valid) if valid else None

    # -- restoring ----------------------------------------------------------------------------------------
    def restore(self, step: int, state: MutableMapping[str, Any]) -> int:
        """Load the checkpoint of ``step`` into ``state`` in place and return ``step``.

        Raises:
            CheckpointNotFoundError: no committed checkpoint of that step.
            CorruptCheckpointError: the checkpoint failed an integrity check (nothing handed to load_state_dict;
                tensors loaded in place before the failure may hold partial data).
            StateMismatchError: the state does not match the checkpoint (shapes, missing entries).
        """
        if self._closed:
            raise TrainguardError("this CheckpointManager is closed; create a new one")
        t0 = time.perf_counter()
        self._load(step, state)
        self.last_restore = RestoreTimings(load_s=time.perf_counter() - t0, bytes=self.last_restore.bytes)
        return step

    def _load(self, step: int, state: MutableMapping[str, Any]) -> None:
        m = read_manifest(self.root, step)
        template, paths = _statefn.build_template(m, state)
        reader = TrainguardReader(self.store, m)
        try:
            with _quiet_dcp():
                dcp.load(template, storage_reader=reader, planner=TrainguardLoadPlanner(), no_dist=True)
        except BaseException as e:
            err = _unwrap(e)
            if isinstance(err, CorruptCheckpointError):
                self._mark_corrupt(step, err)
            raise err from None
        _statefn.apply(template, paths, state, step)
        self.last_restore.bytes = reader.bytes_read

    def _mark_corrupt(self, step: int, err: CorruptCheckpointError) -> None:
        if self.read_only:
            return
        import json

        d = self.root / step_dir_name(step)
        if d.is_dir():
            try:
                atomic_write(d / CORRUPT_MARKER, json.dumps({"problem": str(err), "chunk": err.chunk,
                                                            "tensors": err.tensors, "time": iso()}).encode(),
                             fsync=self.fsync)
            except OSError:
                pass

    def restore_latest(self, state: MutableMapping[str, Any]) -> int | None:
        """Load the newest VALID checkpoint into ``state`` in place and return its step.

        A corrupt or incomplete newer checkpoint is skipped with a logged warning (and an event naming the
        corrupt chunk); the next older one is tried.

        Returns:
            The restored step, or None when the root holds no committed checkpoint at all.

        Raises:
            NoValidCheckpointError: checkpoints exist but none is valid (never silently starts from scratch).
            StateMismatchError: the state does not match the checkpoint (not a reason to fall back).
        """
        if self._closed:
            raise TrainguardError("this CheckpointManager is closed; create a new one")
        t0 = time.perf_counter()
        steps, partials = step_dirs(self.root)
        timings = RestoreTimings()
        problems: list[str] = []
        for step in sorted(steps, reverse=True):
            info, _ = inspect_step(self.root, step, steps[step], self.store)
            if info.status != "valid":
                self._skip(step, info.problem or info.status, None, timings, problems)
                continue
            t_chosen = time.perf_counter()
            try:
                self._load(step, state)
            except CorruptCheckpointError as e:
                self._skip(step, str(e), e, timings, problems)
                continue
            t_loaded = time.perf_counter()
            timings.scan_s = t_chosen - t0
            timings.load_s = t_loaded - t_chosen
            timings.validate_s = 0.0
            timings.bytes = self.last_restore.bytes
            self.last_restore = timings
            self._event("restore", step=step, scan_s=timings.scan_s, load_s=timings.load_s,
                        validate_s=timings.validate_s, bytes=timings.bytes, skipped=timings.skipped)
            log.info("restored step %d from %s in %.3f s", step, self.root, t_loaded - t0)
            return step
        if not steps:
            if partials:
                log.warning("%s holds only uncommitted saves (steps %s); starting from scratch", self.root, sorted(partials))
            self._event("restore", step=None, scan_s=time.perf_counter() - t0, load_s=0.0, validate_s=0.0, bytes=0,
                        skipped=[])
            return None
        raise NoValidCheckpointError(
            f"{self.root} holds {len(steps)} checkpoint(s) but none is valid:\n  " + "\n  ".join(problems)
            + "\nRun `trainguard verify " + str(self.root) + " --all` for details; restore a replica or start a new "
            "run root deliberately."
        )

    def _skip(self, step: int, problem: str, err: CorruptCheckpointError | None, timings: RestoreTimings,
              problems: list[str]) -> None:
        log.warning("skipping checkpoint of step %d: %s", step, problem)
        rec = {"step": step, "problem": problem}
        if err is not None:
            rec.update(chunk=err.chunk, tensors=err.tensors)
        timings.skipped.append(rec)
        problems.append(f"step {step}: {problem}")
        self._event("restore_skipped", **rec)


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to save in a single process" warning: single process is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def _unwrap(e: BaseException) -> BaseException:
    """The original exception inside DCP's CheckpointException (single rank)."""
    if isinstance(e, CheckpointException):
        for failure in e.failures.values():
            inner = failure[0] if isinstance(failure, tuple) else failure
            if isinstance(inner, BaseException):
                return inner
    return e


__all__ = ["CheckpointManager", "SaveResult", "RestoreTimings", "StorageFullError"]
