"""Finding checkpoints under a run root and judging their status without reading chunk data.

Status (docs/FORMAT.md "Validity"), always in agreement with the last full read of the checkpoint's bytes:
- ``valid``: the manifest parses, its CRC32C matches, every chunk it lists exists with the right length, and
  the last full check of its bytes passed (``step-N/verified.json``: the save that wrote it, ``verify``).
- ``unverified``: as valid, but no full check of its bytes is recorded (a checkpoint written by an older
  trainguard or copied in), or the last one could not read a chunk (an I/O error: never recorded as
  corruption). Restore still uses it (and reads every byte it loads).
- ``corrupt``: the manifest does not parse, a chunk is missing or has the wrong length, or a full read found a
  CRC32C or length mismatch, confirmed by a second read (recorded in ``step-N/corrupt.json``).
- ``suspect``: the bytes are intact but the content failed validation after a load (NaN/Inf in a restored
  tensor, a probe fingerprint that differs, a loss that diverged after resuming from it), or an operator
  marked it (``step-N/suspect.json``, ``trainguard mark``). Restore skips it; a corrupt finding wins.
- ``incomplete``: a step directory without a manifest, or a save still in progress / killed
  (``step-N.partial-*``) with no committed checkpoint of that step.

Ordering is always by the step number, never by mtime or by name as text.

Readers race writers: a writer's retention deletes a checkpoint (manifest first, then its directory, then its
chunks) at any moment, and a new one commits. A read-only reader in another process therefore treats a step
whose manifest vanished while it was being read as gone, not as corrupt or missing, and only reports a listing
once it is stable: the directory listing taken after judging every step equals the one it judged
(:func:`scan`). ``restore_latest`` and ``trainguard info``/``verify`` follow the same rule.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import crc32c

from ._gc import paused_gc
from ._text import error_field_text
from ._time import iso
from .errors import CheckpointNotFoundError, CorruptCheckpointError, TransientStorageError, UnsafeFileError
from .format import MANIFEST_NAME, Manifest, TensorEntry, manifest_from_json, parse_step_dir, step_dir_name
from .format.layout import LinkCheck
from .format.manifest import DTYPE_ITEMSIZE
from .incremental.chunkstore import MOVED_ASIDE, ChunkStore
from .storage.base import Storage, as_storage
from .storage.retry import READ_ATTEMPTS, retry_transient
from .storage.safeio import MAX_MANIFEST_BYTES, MAX_MARKER_BYTES
from .validation.suspect import suspect_reason

CORRUPT_MARKER = "corrupt.json"
CHECK_RECORD = "verified.json"
STABLE_SCAN_S = 30.0  # a reader gives up waiting for a listing that stays the same after this long
GONE = "deleted while being read (retention by a writer)"
USABLE = ("valid", "unverified")  # statuses restore may load (it checks every byte it reads)


@dataclass(frozen=True)
class CheckpointInfo:
    """One checkpoint as listed by ``CheckpointManager.checkpoints()`` and ``trainguard ls``.

    Attributes:
        step: the training step.
        status: ``"valid"``, ``"unverified"``, ``"corrupt"``, ``"suspect"`` or ``"incomplete"`` (module
            docstring).
        bytes: bytes of chunk data it references (for incomplete ones: bytes written so far).
        time: commit time, ISO 8601 UTC (for incomplete ones: directory mtime); None if unknown.
        t: the same as seconds since the epoch.
        problem: why it is not valid, or why it is unverified (None when valid).
        path: the step directory.
        chunk: the chunk found missing or of the wrong length, when that is the problem.
        new_bytes: stored bytes the save that wrote it added (fixed at save time; None for checkpoints of
            older trainguard versions and for corrupt or incomplete ones).
        logical_bytes: bytes of its tensors and stored values as in memory (None when its manifest is not
            readable).
        tiers: with tiers configured, tier URL -> ``"valid"``, ``"uploading"``, ``"missing"`` or ``"corrupt"``
            (None without tiers).
    """

    step: int
    status: str
    bytes: int
    time: str | None
    t: float | None
    problem: str | None
    path: str
    chunk: str | None = None
    new_bytes: int | None = None
    logical_bytes: int | None = None
    tiers: dict[str, str] | None = None

    @property
    def reason(self) -> str | None:
        """Why it is ``suspect`` or ``corrupt`` (None for every other status)."""
        return self.problem if self.status in ("suspect", "corrupt") else None

    @property
    def usable(self) -> bool:
        """True when restore may load it (``valid`` or ``unverified``)."""
        return self.status in USABLE

    def to_json(self) -> dict[str, object]:
        out: dict[str, object] = {
            "step": self.step,
            "status": self.status,
            "bytes": self.bytes,
            "new_bytes": self.new_bytes,
            "logical_bytes": self.logical_bytes,
            "time": self.time,
            "problem": self.problem,
            "reason": self.reason,
        }
        if self.tiers is not None:
            out["tiers"] = dict(self.tiers)
        return out


def step_keys(root: str | os.PathLike[str] | Storage) -> tuple[dict[int, str], dict[int, list[str]]]:
    """Step directories (committed or not) and partial directories, keyed by step, as storage keys (cheap: one
    listing of the root)."""
    steps: dict[int, str] = {}
    partials: dict[int, list[str]] = {}
    for entry in as_storage(root).list(""):
        parsed = parse_step_dir(entry.name)
        if parsed is None or not entry.is_dir:
            continue
        step, is_partial = parsed
        if is_partial:
            partials.setdefault(step, []).append(entry.name)
        else:
            steps[step] = entry.name
    return steps, partials


def step_dirs(root: str | os.PathLike[str] | Storage) -> tuple[dict[int, Path], dict[int, list[Path]]]:
    """:func:`step_keys` as local paths (cheap: one listdir); only for storage with a local directory."""
    storage = as_storage(root)
    base = storage.local_path
    if base is None:
        raise TypeError(f"{storage.url} is not a local directory: use step_keys()")
    steps, partials = step_keys(storage)
    return {s: base / k for s, k in steps.items()}, {s: [base / k for k in ks] for s, ks in partials.items()}


def listing(root: str | os.PathLike[str] | Storage) -> frozenset[tuple[int, bool]]:
    """``(step, committed)`` for every step directory: what a stable scan compares (cheap: listdir + stats)."""
    committed, uncommitted = committed_split(root)
    return frozenset([(s, True) for s in committed] + [(s, False) for s in uncommitted])


def stable_committed_steps(
    root: str | os.PathLike[str] | Storage, *, stable_s: float = STABLE_SCAN_S
) -> list[int]:
    """Steps with a manifest, ascending, from a stable listing: two listings in a row agree (a single one can
    miss every checkpoint while a writer commits one and deletes the previous one)."""
    deadline = time.monotonic() + stable_s
    before = listing(root)
    while True:
        after = listing(root)
        if after == before or time.monotonic() > deadline:
            return sorted(s for s, committed in after if committed)
        before = after


def committed_split(root: str | os.PathLike[str] | Storage) -> tuple[list[int], list[int]]:
    """``(committed, uncommitted)``: the steps whose directory holds a manifest and those whose directory does
    not (a commit killed midway), both ascending. One listing plus one existence check per step; the one
    answer to "which steps are committed?" (status beyond that: :func:`inspect_step`, :func:`scan`)."""
    storage = as_storage(root)
    steps, _ = step_keys(storage)
    committed: list[int] = []
    uncommitted: list[int] = []
    for s in sorted(steps):
        (committed if storage.exists(f"{steps[s]}/{MANIFEST_NAME}") else uncommitted).append(s)
    return committed, uncommitted


def is_committed(root: str | os.PathLike[str] | Storage, step: int) -> bool:
    """True while the manifest of ``step`` exists (False once retention or a crash cleanup removed it)."""
    return as_storage(root).exists(f"{step_dir_name(step)}/{MANIFEST_NAME}")


@dataclass(frozen=True)
class ParsedManifest:
    """A manifest as :func:`read_parsed` parsed it, with the size and CRC32C of the bytes it was parsed from:
    pass it to :func:`read_manifest` (``reuse``) to skip a second parse of the same bytes."""

    step: int
    size: int
    crc32c: int
    manifest: Manifest


def read_manifest(
    root: str | os.PathLike[str] | Storage, step: int, *, reuse: ParsedManifest | None = None
) -> Manifest:
    """Parse and validate the manifest of ``step``.

    The file is opened without following a symlink and without blocking, and read only if it is a regular
    file of at most ``MAX_MANIFEST_BYTES``.

    Args:
        reuse: a manifest parsed before (:func:`read_parsed`): returned instead of parsing again when it is of
            ``step`` and the file read now has the same size and CRC32C (the file is still read and checked as
            above, and the chunk paths are checked against the root's links again). A 32,000-tensor manifest
            (6 MB) takes 0.6-0.7 s to parse on 2 cores (1.9 s with Python's collector running).

    Raises:
        CheckpointNotFoundError: no committed checkpoint of that step.
        CorruptCheckpointError / UnsafeCheckpointError: the manifest is damaged, unsafe, not a regular file
            (a symlink, a directory, a named pipe) or cannot be read (permissions, I/O error).
    """
    return _read(as_storage(root), step, reuse).manifest


def read_parsed(
    root: str | os.PathLike[str] | Storage, step: int, *, reuse: ParsedManifest | None = None
) -> ParsedManifest:
    """:func:`read_manifest`, with the size and CRC32C of the bytes it parsed (to pass as its ``reuse`` later).

    Raises:
        as :func:`read_manifest`.
    """
    return _read(as_storage(root), step, reuse)


def _read(storage: Storage, step: int, reuse: ParsedManifest | None) -> ParsedManifest:
    key = f"{step_dir_name(step)}/{MANIFEST_NAME}"
    p = storage.location(key)
    try:
        info = retry_transient(lambda: storage.stat(key))
    except OSError:
        info = None
    if info is not None and info.kind == "symlink":
        raise CorruptCheckpointError(
            f"manifest of step {step} is a symlink; refusing to follow it", step=step
        )
    try:
        data = retry_transient(lambda: storage.read(key, limit_bytes=MAX_MANIFEST_BYTES, what="manifest"))
    except (FileNotFoundError, NotADirectoryError):  # one open: a manifest deleted later still reads whole
        raise CheckpointNotFoundError(
            f"no committed checkpoint of step {step} under {storage.url} (run `trainguard ls {storage.url}` to "
            "list them)"
        ) from None
    except UnsafeFileError as e:
        raise CorruptCheckpointError(f"manifest of step {step} refused: {e}", step=step) from None
    except TransientStorageError as e:
        raise CorruptCheckpointError(
            f"manifest of step {step} cannot be read ({e.strerror or e}; {READ_ATTEMPTS} attempts): {p}",
            step=step,
        ) from None
    except OSError as e:
        raise CorruptCheckpointError(
            f"manifest of step {step} cannot be read ({e.strerror or e}): {p}", step=step
        ) from None
    local = storage.local_path
    digest = crc32c.crc32c(data)
    if reuse is not None and reuse.step == step and reuse.size == len(data) and reuse.crc32c == digest:
        if local is not None:  # the bytes are the same; the directories they name may not be
            links = LinkCheck(local, [c.path for c in reuse.manifest.chunks.values()])
            links.join()
            links.raise_first()
        return reuse
    with paused_gc(limit_s=None):  # CPU-bound; many small objects for a large manifest (see trainguard._gc)
        m = manifest_from_json(data, root=str(local) if local is not None else None, expect_step=step)
    return ParsedManifest(step, len(data), digest, m)


def corrupt_marker(root: str | os.PathLike[str] | Storage, step: int) -> dict[str, object] | None:
    """The ``corrupt.json`` marker of ``step`` (None when absent). A marker that is not a regular file, is
    larger than ``MAX_MARKER_BYTES`` or does not parse counts as a marker (the step is not valid)."""
    key = f"{step_dir_name(step)}/{CORRUPT_MARKER}"
    try:
        storage = as_storage(root)
        data = json.loads(
            retry_transient(lambda: storage.read(key, limit_bytes=MAX_MARKER_BYTES, what="corrupt marker"))
        )
        return data if isinstance(data, dict) else {"problem": "corrupt"}
    except FileNotFoundError:
        return None
    except UnsafeFileError as e:
        return {"problem": f"corrupt (unreadable marker: {e})"}
    except (OSError, ValueError, RecursionError):
        return {"problem": "corrupt (unreadable marker)"}


def check_record(root: str | os.PathLike[str] | Storage, step: int) -> dict[str, object] | None:
    """The last full check of ``step``'s bytes (``verified.json``), or None when none is recorded."""
    key = f"{step_dir_name(step)}/{CHECK_RECORD}"
    try:  # a symlink, a named pipe or an oversized file is refused, never followed or read whole
        storage = as_storage(root)
        data = json.loads(
            retry_transient(lambda: storage.read(key, limit_bytes=MAX_MARKER_BYTES, what="check record"))
        )
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_record(storage: Storage, key: str, body: dict[str, object], fsync: bool) -> bool:
    d = key.rsplit("/", 1)[0]
    try:
        info = storage.stat(d)
    except OSError:
        info = None
    if storage.local_path is not None and (info is None or info.kind != "dir"):
        return False  # deleted meanwhile (retention): nothing to record
    try:
        storage.publish(key, json.dumps(body).encode(), durable=fsync)
    except OSError:  # a read-only root or a step deleted meanwhile: the record is advisory
        return False
    return True


def record_check(
    root: str | os.PathLike[str] | Storage,
    step: int,
    *,
    by: str,
    ok: bool = True,
    problem: str | None = None,
    chunk: str | None = None,
    fsync: bool = False,
) -> bool:
    """Record the outcome of a full check of ``step``'s bytes that found no mismatch: ``ok`` (every chunk
    read and matched, or written by the save from the bytes whose CRC32C it records) or not ok (a chunk could
    not be read: an I/O error, which is never corruption). A passing check also clears a stale
    ``corrupt.json``. Returns False when the record could not be written (read-only root)."""
    storage = as_storage(root)
    d = step_dir_name(step)
    body: dict[str, object] = {"ok": ok, "by": by, "time": iso(), "problem": problem, "chunk": chunk}
    if not _write_record(storage, f"{d}/{CHECK_RECORD}", body, fsync):
        return False
    if ok:
        try:
            storage.delete(f"{d}/{CORRUPT_MARKER}")
        except OSError:
            return False
    return True


def record_corrupt(
    root: str | os.PathLike[str] | Storage,
    step: int,
    problem: str,
    *,
    chunk: str | None = None,
    tensors: list[str] | None = None,
    moved_to: str | None = None,
    fsync: bool = True,
) -> bool:
    """Condemn ``step`` (``corrupt.json``) after a confirmed mismatch; ``moved_to``: where the chunk's bytes
    were quarantined. Returns False when it could not be written (read-only root)."""
    body: dict[str, object] = {
        "problem": problem,
        "chunk": chunk,
        "tensors": list(tensors or []),
        "time": iso(),
    }
    if moved_to is not None:
        body["moved_to"] = moved_to
    return _write_record(as_storage(root), f"{step_dir_name(step)}/{CORRUPT_MARKER}", body, fsync)


def inspect_step(
    root: str | os.PathLike[str] | Storage,
    step: int,
    path: str | os.PathLike[str] | None = None,
    store: ChunkStore | None = None,
    *,
    reuse: ParsedManifest | None = None,
) -> tuple[CheckpointInfo, Manifest | None]:
    """Status of one step directory (cheap: parses the manifest and stats its chunks, reads no chunk data).

    Everything goes through the root's :class:`~trainguard.storage.base.Storage` (a restore's in-memory
    overlay included). A checkpoint deleted while it is inspected (a writer's retention) lists as
    ``incomplete`` with the problem :data:`GONE`, never as corrupt; :func:`scan` rescans until such races are
    over.

    Args:
        root: the run root or its storage.
        step: the step.
        path: how to name the step directory in the result (default: the storage's location of it).
        store: the chunk store to stat chunks with (default: one on ``root``'s storage).
        reuse: the manifest of ``step`` parsed before, used if the file holds the same bytes (see
            :func:`read_manifest`).

    Returns:
        The :class:`CheckpointInfo`, and the parsed manifest when it parsed (None otherwise).
    """
    storage = as_storage(root)
    key = step_dir_name(step)
    where = os.fspath(path) if path is not None else storage.location(key)
    store = store if store is not None else ChunkStore(storage)
    if not is_committed(storage, step):
        return _incomplete(storage, step, key, "no manifest (the save did not commit)", where), None
    try:
        m = read_manifest(storage, step, reuse=reuse)
    except CheckpointNotFoundError:
        return _incomplete(storage, step, key, GONE, where), None
    except CorruptCheckpointError as e:
        if not is_committed(storage, step):
            return _incomplete(storage, step, key, GONE, where), None
        t = _mtime(storage, key)
        return CheckpointInfo(step, "corrupt", 0, iso(t) if t else None, t, str(e), where), None
    problem = None
    bad_chunk = None
    if any(isinstance(e, TensorEntry) and e.dtype not in DTYPE_ITEMSIZE for e in m.entries.values()):
        from .state.dtypes import check_shard_bytes  # imports torch: only for dtypes the parser cannot size

        try:
            check_shard_bytes(m)
        except CorruptCheckpointError as e:
            problem = str(e)
    unreadable = None
    for rec in [] if problem else m.chunks.values():
        bad = store.check_present(rec)
        if bad is not None and bad.startswith("cannot be read"):  # an I/O error (EACCES...): not damage
            unreadable = unreadable or f"chunk {rec.path} {bad}; not marked corrupt"
        elif bad is not None:
            if bad.startswith(MOVED_ASIDE) or bad == "is missing":  # quarantined by a restore: what it found
                bad += recorded_problem(storage, step, rec.path)
            problem, bad_chunk = f"chunk {rec.path} {bad}", rec.path
            break
    if problem is not None and not is_committed(storage, step):
        return _incomplete(
            storage, step, key, GONE, where
        ), None  # its chunks went with it: deleted, not corrupt
    status = "corrupt"
    if problem is None and unreadable is not None and corrupt_marker(storage, step) is None:
        status, problem = "unverified", unreadable
    elif problem is None:
        marker = corrupt_marker(storage, step)
        if marker is not None:
            problem = str(marker.get("problem", "corrupt"))
            chunk = marker.get("chunk")
            bad_chunk = chunk if isinstance(chunk, str) else None
        else:
            status, problem = _check_status(root, step)
            reason = suspect_reason(root, step)
            if reason is not None:
                status, problem = "suspect", reason
    return CheckpointInfo(
        step,
        status,
        m.bytes,
        m.time or iso(m.t),
        m.t,
        problem,
        where,
        bad_chunk,
        new_bytes=m.new_bytes,
        logical_bytes=m.logical_bytes,
    ), m


def recorded_problem(storage: Storage, step: int, path: str) -> str:
    """``"; recorded in step-N/corrupt.json: <problem>"`` when ``step``'s marker names the chunk ``path``,
    else ``""``."""
    marker = corrupt_marker(storage, step)
    if marker is None or marker.get("chunk") != path or not isinstance(marker.get("problem"), str):
        return ""
    return f"; recorded in {step_dir_name(step)}/{CORRUPT_MARKER}: {marker['problem']}"


def where_of(root: str | os.PathLike[str] | Storage) -> str:
    """The run root as a user types it (a path or a URL), for messages that name a command to run."""
    return str(root) if isinstance(root, (str, os.PathLike)) else str(getattr(root, "url", root))


def _check_status(root: str | os.PathLike[str] | Storage, step: int) -> tuple[str, str | None]:
    check = check_record(root, step)
    if check is None:
        return (
            "unverified",
            f"no full read of its bytes is recorded (run `trainguard verify {where_of(root)} --step {step}`)",
        )
    if check.get("ok") is True:
        return "valid", None
    return "unverified", (
        f"the last full read ({check.get('by')}, {check.get('time')}) could not read a chunk: "
        f"{check.get('problem')}; not marked corrupt"
    )


def _mtime(storage: Storage, key: str) -> float | None:
    """Modification time of ``key`` (seconds since the epoch), or None when it cannot be had."""
    try:
        info = storage.stat(key)
    except OSError:
        return None
    return info.mtime if info is not None else None


def _tree_bytes(storage: Storage, prefix: str) -> int:
    """Bytes of the regular files under ``prefix`` (a step or partial directory; symlinks not followed)."""
    size = 0
    try:
        entries = storage.list(prefix)
    except OSError:
        return 0
    for e in entries:
        key = f"{prefix}/{e.name}"
        if e.is_dir:
            size += _tree_bytes(storage, key)
            continue
        try:
            info = storage.stat(key)
        except OSError:
            continue
        if info is not None and info.is_file:
            size += info.size
    return size


def _incomplete(
    storage: Storage, step: int, key: str, problem: str, where: str | None = None
) -> CheckpointInfo:
    """An ``incomplete`` entry for the step or partial directory ``key`` (its bytes summed, its mtime)."""
    t = _mtime(storage, key)
    return CheckpointInfo(
        step,
        "incomplete",
        _tree_bytes(storage, key),
        iso(t) if t else None,
        t,
        problem,
        where if where is not None else storage.location(key),
    )


def is_run_root(path: str | os.PathLike[str]) -> bool:
    """True when ``path`` holds step directories, a chunk store or an event log (cheap: one listdir)."""
    steps, partials = step_dirs(path)
    p = Path(path)
    return bool(steps or partials) or (p / "chunks").is_dir() or (p / "events").is_dir()


def find_run_roots(parent: str | os.PathLike[str], *, max_depth: int = 2, limit: int = 20) -> list[Path]:
    """Run roots inside ``parent`` (not ``parent`` itself), at most ``max_depth`` levels down, sorted by path.

    Used to name the runs of a folder given where a run root was expected (``trainguard ls runs/``). Does
    not descend into a run root nor follow symlinks; stops after ``limit`` roots.

    Args:
        parent: the folder to search.
        max_depth: how many levels below ``parent`` to look (1: its direct subfolders).
        limit: the most run roots returned.

    Returns:
        The run roots found, in path order.
    """
    found: list[Path] = []

    def visit(d: Path, depth: int) -> None:
        try:
            subs = sorted((e for e in os.scandir(d) if e.is_dir(follow_symlinks=False)), key=lambda e: e.name)
        except OSError:
            return
        for e in subs:
            if len(found) >= limit:
                return
            sub = Path(e.path)
            if is_run_root(sub):
                found.append(sub)
            elif depth < max_depth:
                visit(sub, depth + 1)

    visit(Path(parent), 1)
    return found


def scan(
    root: str | os.PathLike[str] | Storage,
    store: ChunkStore | None = None,
    *,
    stable_s: float = STABLE_SCAN_S,
    failed_saves: bool = False,
) -> list[CheckpointInfo]:
    """Every checkpoint under ``root`` with its status, ascending by step.

    Safe against a writer committing and deleting checkpoints meanwhile: the listing is taken again after every
    step was judged, and the scan is repeated until both listings agree (at most ``stable_s`` seconds; then
    the last scan is returned). So a checkpoint that retention deleted mid-scan is not reported, and a valid
    checkpoint that existed during the whole scan is never missed. With ``failed_saves``, the steps whose save
    failed (``save_failed`` events: a failed save leaves no directory) and that have no checkpoint are listed
    as ``incomplete`` too, unless older than every checkpoint listed.
    """
    storage = as_storage(root)
    store = store or ChunkStore(storage)
    deadline = time.monotonic() + stable_s
    before = listing(storage)
    while True:
        steps, partials = step_keys(storage)
        out = [inspect_step(storage, s, None, store)[0] for s in steps]
        for s, ps in partials.items():
            if s not in steps:
                out.append(_incomplete(storage, s, ps[0], "save in progress or killed before commit"))
        out.sort(key=lambda i: i.step)
        after = listing(storage)
        stable = after == before and not any(i.problem == GONE for i in out)
        if stable or time.monotonic() > deadline:
            if failed_saves:
                local = storage.local_path
                failed = _failed_saves(local, {i.step for i in out}) if local is not None else []
                out = sorted(out + failed, key=lambda i: i.step)
            return out
        before = after


def _failed_saves(root: str | os.PathLike[str], listed: set[int]) -> list[CheckpointInfo]:
    from .eventlog import iter_events

    last: dict[int, dict[str, object]] = {}
    for ev in iter_events(root, event="save_failed"):
        s = ev.get("step")
        if (
            isinstance(s, int)
            and not isinstance(s, bool)
            and s not in listed
            and (not listed or s > min(listed))
        ):
            last[s] = ev  # the newest failure of that step
    out = []
    for s, ev in last.items():
        ranks = ev.get("failed_ranks")
        where = f" on rank(s) {ranks}" if isinstance(ranks, list) and ranks else ""
        t = ev.get("t")
        t = float(t) if isinstance(t, (int, float)) else None
        problem = f"the save failed{where}: {error_field_text(ev.get('error'))}; nothing was committed"
        out.append(
            CheckpointInfo(
                s, "incomplete", 0, iso(t) if t else None, t, problem, str(Path(root) / step_dir_name(s))
            )
        )
    return out
