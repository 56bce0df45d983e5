"""Scrubbing and garbage collection: re-reading committed checkpoints at a capped rate (``trainguard verify
--max-bandwidth``, the manager's background scrubber) and removing what no checkpoint needs
(``trainguard gc``)."""

from __future__ import annotations

import errno
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("trainguard")

QUARANTINE_MAX_AGE_S = 7 * 86400.0
"""``trainguard gc`` default: quarantined chunks older than this are removed."""
ORPHAN_MAX_AGE_S = 3600.0
"""``trainguard gc`` default: unreferenced chunks older than this are removed (a younger one may belong to a
save of a writer on another machine that has not committed yet)."""
_QUARANTINED = re.compile(r"([0-9a-f]{32})\.corrupt-([0-9]+)")


class RateLimiter:
    """Caps the average read rate: :meth:`consume` sleeps until ``bytes so far / rate`` seconds have passed
    since the first call. Sleeping never ends early, so the measured rate never exceeds the cap."""

    def __init__(self, bytes_per_s: float, *, stop: threading.Event | None = None) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s}")
        self.rate = float(bytes_per_s)
        self.start: float | None = None
        self.bytes = 0
        self.stop = stop

    def consume(self, n: int) -> None:
        now = time.monotonic()
        if self.start is None:
            self.start = now
        self.bytes += n
        wait = self.start + self.bytes / self.rate - now
        if wait > 0:
            if self.stop is not None:
                self.stop.wait(wait)
            else:
                time.sleep(wait)


class Scrubber:
    """The manager's background scrubber (rank 0 of a writer): every ``interval_s`` it re-verifies the
    committed checkpoints (chunks shared by several are read once) with :func:`trainguard.integrity.verify`,
    which records what it finds (``verified.json``, ``corrupt.json``) so the next restore skips a damaged
    checkpoint without reading it; findings are logged as ``scrub`` events. It runs at low CPU priority and
    stops with ``close()``.

    With tiers, each damaged step is repaired (:meth:`repair`): every chunk missing or corrupt on the hot
    root is read from the first tier holding it with the recorded length and CRC32C
    (:func:`trainguard.tiers.repair.fetch_step`) and rewritten atomically (a ``tier_repair`` event per
    chunk); the step is then verified again, which clears its ``corrupt.json`` only when every chunk now
    matches.

    Args:
        root: the run root directory.
        event: writes one event to the run's event log (``event(name, **fields)``).
        interval_s: seconds between passes.
        max_bytes_per_s: read-rate cap in bytes per second (None: uncapped).
        tiers: the manager's :class:`trainguard.tiers.attach.TierSet` (None: report only).
    """

    def __init__(
        self,
        root: Path,
        event: Callable[..., None],
        interval_s: float,
        *,
        max_bytes_per_s: float | None = None,
        tiers: Any = None,
    ):
        self.root = root
        self.interval_s = interval_s
        self.max_bytes_per_s = max_bytes_per_s
        self.tiers = tiers
        self._event = event
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="trainguard-scrub", daemon=True)
        self.passes = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 15)
        except (AttributeError, OSError):
            pass
        while not self._stop.wait(self.interval_s):
            self.scrub_once()

    def scrub_once(self) -> None:
        from ..integrity.verify import verify

        t0 = time.monotonic()
        limiter = RateLimiter(self.max_bytes_per_s, stop=self._stop) if self.max_bytes_per_s else None
        try:
            report = verify(self.root, None, limiter=limiter)
        except Exception as e:  # noqa: BLE001 - a scrub never takes training down
            log.warning("background scrub of %s failed: %s: %s", self.root, type(e).__name__, e)
            return
        self.passes += 1
        bad = sorted({c["step"] for c in report.corrupt})
        if bad:
            log.error(
                "background scrub found damaged checkpoints %s under %s: %s", bad, self.root, report.corrupt
            )
        repaired = [s for s in bad if self.repair(s)] if self.tiers is not None else []
        extra = {"repaired": repaired} if self.tiers is not None else {}
        self._event(
            "scrub",
            checked=report.checked,
            corrupt=bad,
            bytes_read=report.bytes_read,
            seconds=time.monotonic() - t0,
            **extra,
        )

    def repair(self, step: int) -> bool:
        """Make ``step`` intact on the hot root from the tiers, then verify it again.

        Returns:
            True when the step was re-verified intact (its ``corrupt.json`` cleared); False when a chunk is
            intact on no tier, the step was deleted meanwhile, or the re-verification still finds damage.
        """
        from ..errors import TrainguardError
        from ..format import MANIFEST_NAME, step_dir_name
        from ..integrity.verify import verify
        from ..storage.local import atomic_write
        from ..tiers.repair import fetch_step, write_chunk

        tiers = self.tiers
        try:
            got = fetch_step(self.root, tiers.links, step)
            if got is None:
                log.error(
                    "scrub: step %d under %s is intact on no tier; left marked corrupt", step, self.root
                )
                return False
            for key, src in got.sources.items():
                write_chunk(self.root, self._event, tiers.fsync, step, key, got.files[key], src)
            if got.manifest is not None:  # the hot manifest was damaged: the tier's, checked against it
                d = self.root / step_dir_name(step)
                if not d.is_dir():
                    return False  # deleted by retention meanwhile: nothing to repair
                atomic_write(d / MANIFEST_NAME, got.manifest, fsync=tiers.fsync)
            limiter = RateLimiter(self.max_bytes_per_s, stop=self._stop) if self.max_bytes_per_s else None
            ok = verify(self.root, [step], limiter=limiter).ok  # records verified.json / corrupt.json
        except (OSError, TrainguardError) as e:
            log.warning(
                "scrub: repairing step %d under %s failed: %s: %s", step, self.root, type(e).__name__, e
            )
            return False
        if ok:
            log.warning("scrub: step %d under %s repaired from the tiers", step, self.root)
        return ok


@dataclass
class GcReport:
    """What ``trainguard gc`` removed (or would remove with ``dry_run``).

    Attributes:
        quarantined: relative paths of quarantined chunks removed.
        orphans: relative paths of unreferenced chunks removed.
        bytes_freed: bytes of both.
        referenced: how many chunks the readable committed manifests reference (never touched).
        unreadable_manifests: steps whose manifest could not be read: their chunks are unknown, so no orphan
            is removed while there is one.
        writer_active: a dry run found a writer holding the root (it ran without the lock, deleting nothing):
            the job may commit or delete checkpoints meanwhile, so the plan may change by the time gc runs.
    """

    quarantined: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    bytes_freed: int = 0
    referenced: int = 0
    unreadable_manifests: list[int] = field(default_factory=list)
    writer_active: bool = False

    def to_json(self) -> dict[str, Any]:
        return {
            "quarantined": self.quarantined,
            "orphans": self.orphans,
            "bytes_freed": self.bytes_freed,
            "referenced": self.referenced,
            "unreadable_manifests": self.unreadable_manifests,
            "writer_active": self.writer_active,
        }


def gc(
    root: str | os.PathLike[str],
    *,
    quarantine_older_than_s: float = QUARANTINE_MAX_AGE_S,
    orphans_older_than_s: float = ORPHAN_MAX_AGE_S,
    dry_run: bool = False,
    now: float | None = None,
) -> GcReport:
    """Remove quarantined chunks and unreferenced chunks from ``root``'s chunk store, under the root lock.

    A chunk that any committed manifest references is never removed. When a manifest cannot be read, its
    chunks are unknown: no orphan is removed (quarantined chunks still are: no manifest references a
    quarantined file).

    Args:
        root: the run root.
        quarantine_older_than_s: remove ``<hash>.corrupt-<time>`` files moved aside more than this long ago.
        orphans_older_than_s: remove unreferenced chunks last modified more than this long ago.
        dry_run: only report what would be removed, deleting nothing: without the lock on a read-only
            filesystem or while a writer holds the root (``GcReport.writer_active``).
        now: the current time (seconds since the epoch; for tests).

    Returns:
        A :class:`GcReport`.

    Raises:
        RootLockedError: a writer holds the root and this is not a dry run (run gc when the job is stopped, or
            leave it to retention).
        ConfigError: ``root`` is not a run root (no step directories, chunk store or event log); nothing is
            created in it. Or it is on a read-only filesystem or not writable by this user (gc needs write
            access; a dry run on a read-only filesystem does not).
    """
    from .._lock import RootLock
    from ..catalog import is_run_root, read_manifest, step_dirs
    from ..errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, RootLockedError
    from ..format import MANIFEST_NAME

    root = Path(root)
    if not root.is_dir() or not is_run_root(root):  # before the lock: taking it would create root/.lock
        raise ConfigError(
            f"{root} is not a run root (it holds no step-N directories, chunks/ or events/); give the folder a "
            "CheckpointManager writes to (`trainguard ls` lists the run roots inside a folder); nothing was changed"
        )
    now = time.time() if now is None else now
    lock = RootLock(root)
    writer_active = False
    try:
        lock.acquire()
    except ConfigError as e:  # not writable: a dry run lists without the lock (no writer can change the root)
        if not (dry_run and isinstance(e.__cause__, OSError) and e.__cause__.errno == errno.EROFS):
            raise
    except RootLockedError:  # a dry run deletes nothing: it reads the root beside the writer
        if not dry_run:
            raise
        writer_active = True
    try:
        known: set[str] = set()
        unreadable: list[int] = []
        steps, _ = step_dirs(root)
        for s, d in steps.items():
            try:
                known |= set(read_manifest(root, s).chunks)
            except CheckpointNotFoundError:
                continue
            except CorruptCheckpointError:
                if (d / MANIFEST_NAME).exists():
                    unreadable.append(s)
        referenced = None if unreadable else known  # an unreadable manifest's chunks are unknown
        report = GcReport(
            referenced=len(known), unreadable_manifests=sorted(unreadable), writer_active=writer_active
        )
        chunks = root / "chunks"
        if not chunks.is_dir():
            return report
        if referenced is None:
            log.warning(
                "gc: the manifest of step(s) %s under %s cannot be read; no unreferenced chunk is removed",
                ", ".join(map(str, unreadable)),
                root,
            )
        for sub in sorted(chunks.iterdir()):
            if not sub.is_dir() or sub.is_symlink() or len(sub.name) != 2:
                continue
            for f in sorted(sub.iterdir()):
                try:
                    st = f.lstat()
                except OSError:
                    continue
                if not f.is_file() or f.is_symlink():
                    continue
                rel = f"chunks/{sub.name}/{f.name}"
                q = _QUARANTINED.fullmatch(f.name)
                if q is not None:
                    moved_at = min(float(q.group(2)), st.st_mtime) if q.group(2) else st.st_mtime
                    if now - moved_at <= quarantine_older_than_s:
                        continue
                    report.quarantined.append(rel)
                elif len(f.name) == 32 and referenced is not None and f.name not in referenced:
                    if now - st.st_mtime <= orphans_older_than_s:
                        continue
                    report.orphans.append(rel)
                else:
                    continue
                if not dry_run:
                    try:
                        f.unlink()
                    except OSError:
                        continue
                report.bytes_freed += st.st_size
        return report
    finally:
        lock.release()  # a no-op where it was not taken
