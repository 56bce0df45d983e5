"""The tiers of one manager: opening and checking them, the hot root's record of them, the hooks the manager
calls (after a commit, before retention, for listing, before a restore, at close), and the lock object of a
URL run root."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, RootLockedError, SaveError, TierUploadError, TrainguardError
from ..format.layout import CHUNKS_DIR
from ..retention import KeepAll, select
from ..storage.local import atomic_write
from ..storage.objects import ObjectStore, _classify, is_url, nonce, open_objects
from ..storage.objectstorage import StorageObjects
from . import intent
from .config import Tier
from .repair import fetch_step, materialize, write_hot
from .upload import TierLink, Uploader

log = logging.getLogger("trainguard")
TIERS_RECORD = "tiers.json"
LOCK_OBJECT = ".lock"


def check_writable(store: ObjectStore, key: str) -> None:
    """A writing manager's construction check of a reachable tier: PUT and DELETE a small probe object, so that
    credentials that may read but not write fail now, not in a background upload.

    Raises:
        ConfigError: the store refused the PUT (access denied); names the permissions needed.
    """
    name = f".trainguard-write-probe-{nonce()}"
    try:
        store.put(name, b"")
    except OSError as e:  # TransientStorageError included: a store that stalls now is retried later
        cause = e.__cause__ or e
        if _classify(cause) == "denied":
            raise ConfigError(
                f"tier {key!r}: access denied for writing ({cause}): the credentials may list the bucket but "
                "not write to it; a writing manager needs s3:PutObject, s3:GetObject and s3:DeleteObject on "
                "the prefix (or open the manager with read_only=True)"
            ) from None
        return
    try:
        store.delete(name)
    except OSError as e:
        log.warning(
            "tier %s: could not delete the probe object %s (%s); retention there will fail", key, name, e
        )


def open_links(
    hot: Path, tiers: list[Tier], event: Any, *, fsync: bool = True, writer: bool = False
) -> list[TierLink]:
    """Open every tier's store (configuration errors raise here, at construction); for a ``writer``, also
    check that each reachable tier accepts writes (:func:`check_writable`).

    Raises:
        ConfigError: a bad Tier, a duplicate tier, a tier that is the hot root, or what the store reports
            (unknown scheme, missing package, credentials, bucket, access).
    """
    links: list[TierLink] = []
    seen: set[str] = set()
    for t in tiers:
        if not isinstance(t, Tier):
            raise ConfigError(f"tiers must be tg.Tier(...) objects, got {type(t).__name__}")
        if t.key in seen:
            raise ConfigError(f"tier {t.key!r} is given twice")
        seen.add(t.key)
        store: ObjectStore
        if not isinstance(t.url, str):  # a Storage (tg.Tier(FaultyStorage(...))): driven through the protocol
            if t.url.local_path is not None and Path(t.url.local_path).resolve() == hot.resolve():
                raise ConfigError(f"tier {t.key!r} is the hot root itself: give a different path")
            store = StorageObjects(t.url)
        else:
            if not is_url(t.url) and Path(t.url).resolve() == hot.resolve():
                raise ConfigError(f"tier {t.key!r} is the hot root itself: give a different path")
            store = open_objects(t.url, t.storage_options, stall_timeout_s=t.stall_timeout_s, fsync=fsync)
        unreachable = getattr(store, "unreachable", None)
        if unreachable:
            msg = f"tier {t.key} cannot be reached now ({unreachable}); uploads are retried in the background"
            warnings.warn(msg, RuntimeWarning, stacklevel=3)
            event("tier_unreachable", tier=t.key, error=str(unreachable))
        elif writer:
            check_writable(store, t.key)
        links.append(TierLink(t, store))
    return links


@dataclass
class RestoreSession:
    """One restore through the tiers (:meth:`TierSet.restoring`); the caller sets ``step`` to the step it
    restored."""

    step: int | None = None


def committed_steps_of(storage: Any) -> list[int]:
    from ..catalog import committed_split

    try:
        return committed_split(storage)[0]
    except OSError:
        return []


class TierSet:
    """The tiers of a manager and their background uploads.

    Args:
        hot: the hot run root (local).
        links: the opened tiers, in restore order.
        event: the manager's ``_event``.
        fsync: make chunks written to the hot root by a repair durable.
    """

    def __init__(self, hot: Path, links: list[TierLink], event: Any, *, fsync: bool = True) -> None:
        self.hot = hot
        self.links = links
        self.event = event
        self.fsync = fsync
        self.uploader = Uploader(hot, links, event, fsync=fsync)
        self.store_lock: ObjectStore | None = None  # the URL root's lock object, held by this writer
        self._resume: threading.Thread | None = None
        self._hot_write: threading.Thread | None = None  # a restore's chunks going to the hot root

    # -- writer hooks ------------------------------------------------------------------------------------
    def record(self) -> None:
        """Record the tiers (URLs, options without secrets) in ``<hot>/tiers.json`` for ``trainguard ls``."""
        body = {"tiers": [link.tier.record() for link in self.links]}
        atomic_write(self.hot / TIERS_RECORD, json.dumps(body, indent=1).encode(), fsync=False)

    def resume(self, hot_steps: list[int]) -> None:
        """In the background: queue the committed hot steps a tier is missing (those its ``keep`` would keep)."""

        def run() -> None:
            for link in self.links:
                try:
                    have = set(link.remote.committed_steps())
                    broken = self._held_corrupt(link, have & set(hot_steps))
                except (OSError, TrainguardError) as e:
                    log.warning(
                        "cannot list tier %s: %s; its missing steps are sent after the next save", link.key, e
                    )
                    with self.uploader.cond:
                        link.failed.update({s: "tier unreachable at start" for s in hot_steps})
                    continue
                policy = link.tier.retention
                wanted = set(hot_steps)
                if policy is not None and not isinstance(policy, KeepAll):
                    wanted = select(policy, sorted(have | wanted), {}) & wanted
                missing = sorted((wanted - have) | (wanted & broken))
                if missing:
                    with self.uploader.cond:
                        link.failed.update({s: "missing at start" for s in missing})
            self.uploader.submit(None)

        self._resume = threading.Thread(target=run, name="trainguard-tier-resume", daemon=True)
        self._resume.start()

    @staticmethod
    def _held_corrupt(link: TierLink, steps: set[int]) -> set[int]:
        """Of ``steps`` (committed on the tier), those the tier holds corrupt (a manifest that does not parse,
        a chunk missing or of the wrong length, e.g. a torn PUT): sent again like missing ones."""
        if not steps:
            return set()
        chunks = link.store.list(CHUNKS_DIR + "/")
        return {s for s in steps if link.remote.status(s, chunks).status != "valid"}

    def after_commit(self, step: int) -> SaveError | None:
        return self.uploader.after_commit(step)

    def staging(self) -> AbstractContextManager[None]:
        """Hold while the training thread is inside ``save()``: async uploads pause meanwhile
        (:class:`~trainguard.tiers.upload.StagingGate`)."""
        return self.uploader.gate.staging()

    def protected(self) -> set[int]:
        """Hot steps retention must keep: still to be sent to some tier. Waits for a restore's background
        write to the hot root first (retention must see its manifest, or it would free its chunks)."""
        self.settle()
        return self.uploader.pending()

    # -- listing -----------------------------------------------------------------------------------------
    def status(self, steps: list[int], links: list[TierLink] | None = None) -> dict[int, dict[str, str]]:
        """step -> {tier url: "valid" | "uploading" | "missing" | "corrupt"} over ``links`` (default: every
        tier); does not wait for uploads."""
        out: dict[int, dict[str, str]] = {s: {} for s in steps}
        for link in self.links if links is None else links:
            busy = self.uploader.uploading(link)
            try:
                chunks = link.store.list(CHUNKS_DIR + "/")
                committed = set(link.remote.committed_steps())
            except (OSError, TrainguardError) as e:
                log.warning("cannot list tier %s: %s", link.key, e)
                chunks, committed = {}, set()
            busy |= intent.uploading(self.hot, link.key) - committed  # another process's uploads too
            for s in steps:
                if s in busy:
                    out[s][link.key] = "uploading"
                elif s in committed:
                    st = link.remote.status(s, chunks).status
                    out[s][link.key] = (
                        "valid" if st == "valid" else ("missing" if st == "missing" else "corrupt")
                    )
                else:
                    out[s][link.key] = "missing"
        return out

    def tier_only_steps(self, hot_steps: set[int]) -> dict[int, Any]:
        """Steps committed on some tier but not on the hot root -> their RemoteStep on the first such tier."""
        found: dict[int, Any] = {}
        for link in self.links:
            try:
                for st in link.remote.scan():
                    if st.step not in hot_steps and st.step not in found:
                        found[st.step] = (link, st)
            except (OSError, TrainguardError) as e:
                log.warning("cannot list tier %s: %s", link.key, e)
        return found

    # -- restore -----------------------------------------------------------------------------------------
    def materialize(self, step: int | None = None) -> int | None:
        """Make ``step`` (default: the newest restorable one) intact on the hot root, repairing from tiers."""
        self.settle()
        return materialize(self.hot, self.links, self.event, step=step, fsync=self.fsync)

    @contextmanager
    def restoring(self, ctx: Any) -> Iterator[RestoreSession]:
        """Around a restore: the loader reads through the tiers (a :class:`~trainguard.tiers.overlay.TierOverlay`
        as ``ctx.storage`` listing the steps the tiers hold, a :class:`~trainguard.tiers.overlay.TierChunkStore`
        as ``ctx.store`` reading each chunk the hot root lacks, or holds corrupt, from the first tier holding it
        intact, straight into its tensor, CRC32C checked once); ``ctx``: the manager's RootContext. The caller
        sets ``session.step`` to the step it restored; afterwards a background thread makes that step intact on
        the hot root (the chunks read from tiers, any other chunk it lacks, then the manifest), so the hot root
        is repaired without its disk on the restore's critical path.

        Yields:
            The session (``step``: set by the caller to the step restored, None when none was).
        """
        self.settle()
        from .overlay import TierChunkStore, TierOverlay

        hot_steps = set(committed_steps_of(ctx.storage))
        tier_steps: dict[int, list[tuple[TierLink, int]]] = {}
        for link in self.links:
            try:
                sizes = link.remote.committed_sizes()
            except (OSError, TrainguardError) as e:
                log.warning("cannot list tier %s: %s", link.key, e)
                continue
            for s, size in sizes.items():
                if s not in hot_steps:
                    tier_steps.setdefault(s, []).append((link, size))
        saved = ctx.storage, ctx.store
        overlay = TierOverlay(saved[0], tier_steps)
        store = TierChunkStore(overlay, self.links)
        ctx.storage, ctx.store = overlay, store
        session = RestoreSession()
        t0 = time.perf_counter()
        try:
            yield session
        finally:
            ctx.storage, ctx.store = saved
            step = session.step
            if step is not None:
                fetched, hot_ok = store.taken()
                if fetched or step in tier_steps:
                    self.event(
                        "tier_restore",
                        step=step,
                        bytes=sum(len(d) for d, _ in fetched.values()),
                        chunks=len(fetched),
                        seconds=round(time.perf_counter() - t0, 6),
                    )
                    manifest = overlay.manifests.get(step) if step in tier_steps else None
                    self._write_behind(step, fetched, hot_ok, manifest)

    def _write_behind(
        self, step: int, fetched: dict[str, tuple[bytes, str]], hot_ok: set[str], manifest: bytes | None
    ) -> None:
        def run() -> None:
            try:
                got = fetch_step(self.hot, self.links, step, have=fetched, hot_ok=hot_ok, manifest=manifest)
                if got is None:
                    log.warning("step %d could not be made intact on the hot root %s", step, self.hot)
                    return
                write_hot(self.hot, got, self.event, self.fsync)
            except (OSError, TrainguardError) as e:  # the hot copy is a cache: the tiers still hold the step
                log.warning("writing step %d to the hot root %s failed: %s", step, self.hot, e)
                self.event("tier_repair_failed", step=step, error=f"{type(e).__name__}: {e}")

        self._hot_write = threading.Thread(target=run, name="trainguard-hot-write", daemon=True)
        self._hot_write.start()

    def settle(self) -> None:
        """Wait for a restore's background write to the hot root (if any)."""
        t = self._hot_write
        if t is not None:
            t.join()
            self._hot_write = None

    # -- close -------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Wait up to the largest ``upload_timeout_s`` for uploads, then stop.

        Releases the URL root's lock object (if held) in any case.

        Raises:
            TierUploadError: naming the steps and tiers not uploaded (the hot checkpoints are intact).
        """
        try:
            self.settle()
            timeout = max([link.tier.upload_timeout_s for link in self.links] or [0.0])
            t0 = time.monotonic()
            if self._resume is not None:
                self._resume.join(timeout)  # the steps a tier missed at start are queued by now
            missing = self.uploader.wait(max(0.0, timeout - (time.monotonic() - t0)))
            self.uploader.close()
        finally:
            if self.store_lock is not None:
                release_store_lock(self.store_lock)
                self.store_lock = None
        if missing:
            detail = "; ".join(f"{url}: steps {steps}" for url, steps in missing.items())
            self.event("tier_upload_incomplete", missing=missing)
            raise TierUploadError(
                f"checkpoints not uploaded within upload_timeout_s ({timeout:g} s): {detail}; the hot checkpoints "
                "are intact and a new manager with the same tiers uploads what is missing",
                missing=missing,
            )


def url_root(
    root: Any, keep: Any, tiers: list[Any], storage_options: dict[str, Any] | None
) -> tuple[Any, Any, list[Any], str | None]:
    """Resolve a manager's ``root`` argument: an object-store URL becomes a local cache as the hot root (see
    :func:`cache_root`) with the URL as its first tier, a sync replica keeping ``keep`` (the cache keeps the
    newest only).

    Returns:
        (hot root, the hot root's keep, the tiers, the URL or None).

    Raises:
        ConfigError: ``storage_options`` given with a local root.
    """
    if not is_url(root):
        if storage_options is not None:
            raise ConfigError(
                "storage_options applies to a URL run root; give a tier's options in tg.Tier(...)"
            )
        return root, keep, tiers, None
    url = str(root).rstrip("/")
    tiers = [Tier(url, keep=keep, sync=True, storage_options=storage_options), *tiers]
    return cache_root(url), (1 if keep is not None else None), tiers, url


def cache_root(url: str) -> Path:
    """The local hot root of a URL run root: ``$TRAINGUARD_CACHE_DIR`` (default ``~/.cache/trainguard``) /
    ``roots/<hash of the URL>``."""
    import hashlib

    base = os.environ.get("TRAINGUARD_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "trainguard"
    )
    return Path(base) / "roots" / hashlib.sha256(url.encode()).hexdigest()[:16]


def open_tiers(
    hot: Path,
    tiers: list[Tier],
    event: Any,
    *,
    fsync: bool,
    writer: bool,
    coordinator: bool,
    url: str | None = None,
) -> TierSet:
    """Open and check the tiers of a manager (configuration errors raise here); for a writer's rank 0 also
    lock a URL root (pruning its cache), record the tiers in the hot root and queue the committed steps a
    tier is missing.

    Args:
        hot: the hot run root.
        tiers: the tiers, in restore order (a URL root's store first).
        event: writes one event to the run's event log.
        fsync: make what is written to the hot root durable.
        writer: the manager writes (not ``read_only``).
        coordinator: this process is rank 0 (or alone).
        url: the URL of a URL run root, else None.

    Returns:
        The opened :class:`TierSet` (its ``store_lock`` set when this writer locked the URL root).

    Raises:
        ConfigError: a bad tier (see :func:`open_links`).
        RootLockedError: another writer holds the URL root's lock.
    """
    from ..catalog import stable_committed_steps

    links = open_links(hot, tiers, event, fsync=fsync, writer=writer)
    ts = TierSet(hot, links, event, fsync=fsync)
    if not (writer and coordinator):
        return ts
    if url is not None:
        acquire_store_lock(links[0].store, url)
        ts.store_lock = links[0].store
        prune_cache(hot, links[0])
    ts.record()
    ts.resume(stable_committed_steps(hot))
    return ts


def prune_cache(hot: Path, link: TierLink) -> list[int]:
    """A URL root's local cache may hold steps the store no longer has (deleted there, or a cache left by an
    earlier run): remove them, so that listing, lineage and restore follow the store. Returns the steps
    removed (none when the store cannot be listed)."""
    from ..catalog import step_dirs
    from ..format import MANIFEST_NAME
    from ..storage.local import remove_tree

    try:
        on_store = set(link.remote.committed_steps())
    except (OSError, TrainguardError):
        return []
    steps, _ = step_dirs(hot)
    gone = sorted(s for s in steps if s not in on_store)
    for s in gone:
        (steps[s] / MANIFEST_NAME).unlink(missing_ok=True)  # uncommit first
        remove_tree(steps[s])
    return gone


def read_record(hot: Path) -> list[dict[str, Any]]:
    """The tiers recorded in ``<hot>/tiers.json`` (empty when none)."""
    try:
        body = json.loads((hot / TIERS_RECORD).read_text())
    except (OSError, ValueError):
        return []
    tiers = body.get("tiers") if isinstance(body, dict) else None
    return [t for t in tiers or [] if isinstance(t, dict) and isinstance(t.get("url"), str)]


# -- the lock object of a URL run root -------------------------------------------------------------------------
def _holder() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}


def acquire_store_lock(store: ObjectStore, url: str) -> None:
    """One writer per object-store run root: create ``<url>/.lock`` only if absent (If-None-Match).

    A lock left by a dead process on this host (pid gone) is taken over. Where the store has no conditional
    create, a warning says that two writers are not excluded.

    Raises:
        RootLockedError: another writer holds it (the message names the object to delete if none runs).
    """
    if not store.supports_conditional_create:
        warnings.warn(
            f"{url}: this store has no conditional create (If-None-Match); a second writer on this run root is "
            "not refused: run one writer per run root",
            RuntimeWarning,
            stacklevel=3,
        )
    me = json.dumps(_holder()).encode()
    for _ in range(2):
        if store.create(LOCK_OBJECT, me):
            return
        try:
            held = json.loads(store.get(LOCK_OBJECT))
        except (OSError, ValueError):
            held = {}
        if held.get("host") == socket.gethostname() and isinstance(held.get("pid"), int):
            from .._lock import _alive

            if not _alive(held["pid"]):
                store.delete(LOCK_OBJECT)  # a writer on this host that died (SIGKILL) left it
                continue
        raise RootLockedError(
            f"{url} is locked by another writer (pid {held.get('pid')} on {held.get('host')}, since "
            f"{held.get('time')}); if no writer runs, delete {url}/{LOCK_OBJECT}"
        )
    raise RootLockedError(f"{url}: could not take the lock object {LOCK_OBJECT}")


def release_store_lock(store: ObjectStore) -> None:
    try:
        store.delete(LOCK_OBJECT)
    except OSError as e:
        log.warning("could not delete the lock object of %s: %s", store.url, e)


def listing(tierset: TierSet, hot_scan: Any, *, url: str | None = None) -> list[Any]:
    """``checkpoints()`` with tiers: the hot root's checkpoints (for a URL root: the URL's) with each step's
    ``tiers`` mapping, plus the steps held only by a tier (status from that tier, path = its URL)."""
    from dataclasses import replace

    from .._time import iso
    from ..catalog import CheckpointInfo
    from ..format import step_dir_name

    links = tierset.links
    if url is not None:  # the URL is the run root: list it; the other tiers are the mapping
        first = links[0]
        infos = [
            CheckpointInfo(
                r.step,
                r.status if r.status != "missing" else "incomplete",
                r.bytes,
                r.time or (iso(r.t) if r.t else None),
                r.t,
                r.problem,
                f"{first.key}/{step_dir_name(r.step)}",
                r.chunk,
            )
            for r in first.remote.scan()
        ]
        busy = tierset.uploader.uploading(first)
        rest = links[1:]
        mapping = tierset.status([i.step for i in infos], rest) if rest else {}
        out = [replace(i, tiers=mapping.get(i.step) if rest else None) for i in infos if i.step not in busy]
        return out
    infos = list(hot_scan())
    mapping = tierset.status([i.step for i in infos])
    out = [replace(i, tiers=mapping.get(i.step, {})) for i in infos]
    hot_steps = {i.step for i in infos}
    only = tierset.tier_only_steps(hot_steps)
    if only:
        extra = tierset.status(sorted(only))
        for step, (link, r) in only.items():
            out.append(
                CheckpointInfo(
                    step,
                    r.status if r.status != "missing" else "incomplete",
                    r.bytes,
                    r.time,
                    r.t,
                    r.problem or "only on tiers (restore copies it to the hot root)",
                    f"{link.key}/{step_dir_name(step)}",
                    chunk=r.chunk,
                    tiers=extra.get(step, {}),
                )
            )
    return sorted(out, key=lambda i: i.step)
