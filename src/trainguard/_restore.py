"""Choosing and loading the newest valid checkpoint (``CheckpointManager.restore_latest``).

Under torch.distributed every rank takes the same path: rank 0 lists the committed steps and judges each
candidate cheaply (manifest, chunk presence), broadcasting both; every rank then loads the chosen step through
DCP, whose load raises the same CheckpointException on all ranks when any rank fails, so a chunk found corrupt
on one rank makes all ranks fall back to the next older step together.

A reader racing a writer's retention (another process, typically a read-only manager) may find the step it
chose deleted under it: its manifest gone, or a chunk gone after it. That step is not reported as corrupt; the
reader lists the root again and tries the newest valid checkpoint of the new listing. "None is valid" is raised
only after a pass over a listing that stayed the same from start to end.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from . import _statefn
from ._gc import paused_gc
from ._persist import quiet_dcp, unwrap
from .catalog import (
    STABLE_SCAN_S,
    committed_split,
    corrupt_marker,
    inspect_step,
    is_committed,
    read_manifest,
    record_check,
    record_corrupt,
    step_keys,
)
from .distributed.chunkread import ShardReader, finish_local, local_loadable, queue_local
from .errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InsufficientMemoryError,
    NoValidCheckpointError,
    StateMismatchError,
    SuspectCheckpointError,
)
from .format import Manifest, step_dir_name
from .lineage import head_manifest, record_resume, run_info
from .results import RestoreTimings
from .state.dtypes import check_shard_bytes
from .state.values import bool_bytes_valid, invalid_bools_problem
from .validation.suspect import suspect_reason

if TYPE_CHECKING:
    from ._context import RootContext

log = logging.getLogger("trainguard")
VERIFY_THREADS = 4
"""Threads of the CRC32C pass before loading (the load reads chunks with as many)."""


def restore_step(ctx: RootContext, step: int, state: MutableMapping[str, Any], *, strict: bool = True) -> int:
    """``CheckpointManager.restore``: load ``step`` (what the hot root lacks read from the tiers, see
    ``TierSet.restoring``), check the probe, record the timings in ``ctx.last_restore`` and arm the loss
    trajectory check.

    Returns:
        ``step``.

    Raises:
        CheckpointNotFoundError, CorruptCheckpointError, StateMismatchError: see :func:`load`.
        SuspectCheckpointError: the restored state failed validation (NaN/Inf, probe); marked suspect.
    """
    t0 = time.perf_counter()
    ctx.refs.take_newest()  # the manifest a writer's open kept for restore_latest: not needed now
    # chunks missing or corrupt on the hot root: read from a tier straight into the tensors
    with (
        paused_gc(),
        ctx.tiers.restoring(ctx) if ctx.tiers is not None else contextlib.nullcontext() as session,
    ):
        load(ctx, step, state, strict=strict)
        if session is not None:
            session.step = step
    load_s = time.perf_counter() - t0
    v = ctx.validation
    validate_s = v.validate_s + v.check_probe(step) if v is not None else 0.0
    ctx.last_restore = RestoreTimings(
        load_s=load_s,
        validate_s=validate_s,
        bytes=ctx.last_restore.bytes,
        verify_bytes=ctx.last_restore.verify_bytes,
    )
    if v is not None:
        v.arm(step)
    return step


def restore_newest(ctx: RootContext, state: MutableMapping[str, Any], *, strict: bool = True) -> int | None:
    """``CheckpointManager.restore_latest``: :func:`restore_latest` over the hot root and the tiers (the newest
    step on any tier; what the hot root lacks is read from the tiers as the loader needs it); on success the timings go to
    ``ctx.last_restore`` and the loss trajectory check is armed.

    Returns:
        The restored step, or None when no committed checkpoint exists.

    Raises:
        NoValidCheckpointError, StateMismatchError: see :func:`restore_latest`.
    """
    timings = RestoreTimings()
    try:
        with (
            paused_gc(),  # the caller waits; the manifest and the load's plans are many small objects
            ctx.tiers.restoring(ctx) if ctx.tiers is not None else contextlib.nullcontext() as session,
        ):
            step = restore_latest(ctx, state, timings, strict=strict)
            if session is not None:
                session.step = step
    except NoValidCheckpointError as e:  # `trainguard run` reads it: a relaunch cannot fix this
        # the whole message: which checkpoints, and why each was skipped (bounded: one line per checkpoint)
        ctx.event("restore_failed", error="NoValidCheckpointError", problem=str(e)[:8000])
        raise
    if step is not None:
        ctx.last_restore = timings
        if ctx.validation is not None:
            ctx.validation.arm(step)
    return step


def committed_steps(ctx: RootContext) -> list[int]:
    """Steps with a manifest, newest first (rank 0's view, on every rank)."""
    steps: list[int] | None = None
    if ctx.dist.is_coordinator:
        committed, uncommitted = committed_split(ctx.storage)
        partials = step_keys(ctx.storage)[1]
        if uncommitted:
            log.warning(
                "ignoring uncommitted step directories (a save was killed mid-commit): %s", uncommitted
            )
        steps = sorted(committed, reverse=True)
        if not steps and partials:
            log.warning(
                "%s holds only uncommitted saves (steps %s); starting from scratch",
                ctx.root,
                sorted(partials),
            )
    return ctx.dist.broadcast_ints(steps)


OK, BAD, GONE, FOREIGN = 1, 0, 2, 3  # rank 0's verdict on a candidate step, broadcast to every rank


def gone(ctx: RootContext, step: int) -> bool:
    """True on every rank when rank 0 finds the manifest of ``step`` deleted (retention raced this reader)."""
    return bool(ctx.dist.broadcast_ints([int(not is_committed(ctx.storage, step))])[0])


def restore_latest(
    ctx: RootContext, state: MutableMapping[str, Any], timings: RestoreTimings, *, strict: bool = True
) -> int | None:
    """Load the newest valid checkpoint of the head run's lineage into ``state``, falling back past corrupt,
    suspect and incomplete ones (each recorded in ``timings.skipped`` and a ``restore_skipped`` event).

    Returns:
        The restored step, or None when the root holds no committed checkpoint.

    Raises:
        NoValidCheckpointError: checkpoints exist but none is valid.
        StateMismatchError: ``state`` does not match the checkpoint.
    """
    t0 = time.perf_counter()
    deadline = time.monotonic() + STABLE_SCAN_S
    problems: list[str] = []
    unreadable: list[int] = []  # steps whose chunks could not be read (I/O errors): never condemned
    judged: set[int] = set()  # steps found not valid; reported once
    foreign: dict[int, str] = {}  # valid steps of runs outside the head run's lineage (rank 0's view)
    dirty: dict[str, int] = {}  # saved name -> the failed step whose values may have been loaded into it
    steps = committed_steps(ctx)
    while True:
        raced = False
        newest = head_manifest(ctx.storage, ctx.refs.take_newest()) if ctx.dist.is_coordinator else None
        hd = run_info(newest.manifest) if newest is not None else None
        for step in steps:
            if step in judged:
                continue
            verdict, problem, chunk, tensors = OK, "", None, None
            m = None  # rank 0: the manifest judged here is the one loaded (parsed once per restore)
            if ctx.dist.is_coordinator:
                info, m = inspect_step(
                    ctx.storage, step, ctx.root / step_dir_name(step), ctx.store, reuse=newest
                )
                if not info.usable:  # valid or unverified: restore reads and checks every byte it loads
                    verdict = GONE if not is_committed(ctx.storage, step) else BAD
                    marker = corrupt_marker(ctx.storage, step)
                    listed = marker.get("tensors") if marker is not None else None
                    if isinstance(listed, list):
                        tensors = [str(x) for x in listed]
                elif m is not None and hd is not None:
                    rid = run_info(m).run_id
                    if not hd.owns(rid, step):
                        verdict = FOREIGN
                        if step not in foreign:
                            log.info(
                                "passing over step %d: run %s is not in the lineage of the newest run",
                                step,
                                rid,
                            )
                        foreign[step] = rid
                problem, chunk = info.problem or info.status, info.chunk
                if info.status == "suspect":
                    problem = f"suspect: {problem}"
            verdict = ctx.dist.broadcast_ints([verdict])[0]
            if verdict == GONE:
                raced = True
                continue
            if verdict == FOREIGN:
                continue
            if verdict == BAD:
                err = (
                    CorruptCheckpointError(problem, step=step, chunk=chunk, tensors=tensors)
                    if chunk
                    else None
                )
                skip(ctx, step, problem or "not valid on rank 0", err, timings, problems)
                judged.add(step)
                continue
            t_chosen = time.perf_counter()
            attempt: set[str] = set()
            try:
                load(ctx, step, state, strict=strict, manifest=m, touched=attempt)
                probe_s = ctx.validation.check_probe(step) if ctx.validation is not None else 0.0
            except SuspectCheckpointError as e:  # intact bytes, content failed validation: marked, fall back
                dirty.update({f: step for f in attempt if f not in dirty})
                skip(ctx, step, f"suspect: {e.reason}", None, timings, problems)
                judged.add(step)
                continue
            except (CorruptCheckpointError, CheckpointNotFoundError) as e:
                if getattr(e, "state_modified", False):
                    dirty.update({f: step for f in attempt if f not in dirty})
                if gone(ctx, step):
                    raced = True
                    continue
                if isinstance(e, CorruptCheckpointError) and e.unreadable:
                    unreadable.append(step)
                skip(
                    ctx, step, str(e), e if isinstance(e, CorruptCheckpointError) else None, timings, problems
                )
                judged.add(step)
                continue
            except InsufficientMemoryError as e:  # not corrupt (no marker): too large for this machine
                skip(ctx, step, str(e), None, timings, problems)
                judged.add(step)
                continue
            left = sorted(f for f in dirty if f not in attempt)
            if (
                left
            ):  # a failed candidate wrote entries this checkpoint does not overwrite: never a silent mix
                raise StateMismatchError(
                    f"restore_latest fell back to step {step}, but the checkpoint(s) of step(s) "
                    f"{sorted({dirty[f] for f in left})} that failed first had already been loaded into entries "
                    f"step {step} does not hold: {left}. Those entries keep the failed checkpoint's values (the "
                    "others hold step "
                    f"{step}'s): rebuild the state objects (a new model and optimizer) and call restore_latest "
                    "again (the failed checkpoints are marked and are not tried again), or restore into objects "
                    "that do not have these entries"
                )
            t_loaded = time.perf_counter()
            timings.scan_s = t_chosen - t0
            timings.validate_s = (ctx.validation.validate_s if ctx.validation is not None else 0.0) + probe_s
            timings.load_s = max(0.0, t_loaded - t_chosen - timings.validate_s)
            timings.bytes = ctx.last_restore.bytes
            timings.verify_bytes = ctx.last_restore.verify_bytes
            ctx.event(
                "restore",
                step=step,
                scan_s=timings.scan_s,
                load_s=timings.load_s,
                validate_s=timings.validate_s,
                bytes=timings.bytes,
                skipped=timings.skipped,
            )
            log.info("restored step %d from %s in %.3f s", step, ctx.root, t_loaded - t0)
            return step
        again = committed_steps(ctx)
        stable = not raced and again == steps
        if stable or time.monotonic() > deadline:
            break
        steps = again  # a writer committed or deleted meanwhile: judge the new listing
    if not (set(steps) - set(foreign)) and not judged:
        ctx.event(
            "restore",
            step=None,
            scan_s=time.perf_counter() - t0,
            load_s=0.0,
            validate_s=0.0,
            bytes=0,
            skipped=[],
        )
        return None
    objects = (
        f"\nThe state objects passed hold values of the failed checkpoint(s) of step(s) "
        f"{sorted(set(dirty.values()))} (entries {sorted(dirty)[:5]}{' ...' if len(dirty) > 5 else ''}): do not "
        "train on them; rebuild them (a new model and optimizer) first"
        if dirty
        else "\nThe state objects passed were not modified."
    )
    if unreadable:
        raise NoValidCheckpointError(
            f"{ctx.root} holds {len(steps)} checkpoint(s) but none could be loaded; steps {sorted(unreadable)} "
            "could not be read (I/O errors, retried) and are NOT marked corrupt:\n  "
            + "\n  ".join(problems)
            + objects
            + "\nFix access to the storage (permissions, mounts) and retry; do not start a new run root."
        )
    other = (
        f"\nValid checkpoints of other runs, kept apart from the newest run's lineage: steps {sorted(foreign)}; "
        "restore one of them explicitly with restore(step, state)."
        if foreign
        else ""
    )
    which = "of the newest run's lineage is" if foreign else "is"
    suspect = [s for s in sorted(judged) if suspect_reason(ctx.root, s) is not None]
    cleared = (
        f"\nSuspect checkpoints {suspect} failed validation after load (probe, NaN/Inf, or the loss diverged after "
        f"resuming); after checking one, `trainguard mark {ctx.root} STEP --clear` makes it a candidate again."
        if suspect
        else ""
    )
    raise NoValidCheckpointError(
        f"{ctx.root} holds {len(steps)} checkpoint(s) but none {which} valid:\n  "
        + "\n  ".join(problems)
        + other
        + cleared
        + objects
        + f"\nRun `trainguard verify {ctx.root} --all` for details; restore a replica or start a new run root "
        "deliberately" + (", with freshly built objects." if dirty else ".")
    )


def skip(
    ctx: RootContext,
    step: int,
    problem: str,
    err: CorruptCheckpointError | None,
    timings: RestoreTimings,
    problems: list[str],
) -> None:
    if ctx.dist.is_coordinator:
        log.warning("skipping checkpoint of step %d: %s", step, problem)
    rec: dict[str, Any] = {"step": step, "problem": problem}
    if err is not None:
        rec.update(chunk=err.chunk, tensors=err.tensors)
    timings.skipped.append(rec)
    problems.append(f"step {step}: {problem}")
    ctx.event("restore_skipped", **rec)


def load(
    ctx: RootContext,
    step: int,
    state: MutableMapping[str, Any],
    *,
    strict: bool = True,
    manifest: Manifest | None = None,
    touched: set[str] | None = None,
) -> None:
    """Load the checkpoint of ``step`` into ``state`` in place (every rank; collective under torch.distributed).

    In one process every chunk the state needs is read and its CRC32C checked before the first byte is loaded
    into the caller's objects: a corrupt checkpoint raises with the objects untouched. Chunks whose every
    destination is memory never written are loaded first instead, each checked as it lands, and that memory is
    put back as it was if one fails (``ShardReader.flush_never_written``). Under torch.distributed
    DCP loads each rank's shards in place; a corrupt chunk found there may leave part of its bytes in them
    (``CorruptCheckpointError.state_modified``).

    Args:
        ctx: the run root's context.
        step: the step to load.
        state: the training state, loaded in place.
        strict: as ``CheckpointManager.restore``.
        manifest: the manifest of ``step`` when the caller already parsed it (it is not read again).
        touched: receives the saved names of the entries that may have been written into ``state`` (also when
            a later check fails).

    Raises:
        CheckpointNotFoundError: no committed checkpoint of ``step`` (on any rank).
        CorruptCheckpointError: a manifest or chunk check failed (recorded; see :func:`mark_corrupt`).
        StateMismatchError: ``state`` does not match the checkpoint.
    """
    m = manifest
    err0: BaseException | None = None
    if m is None:
        try:
            m = read_manifest(ctx.storage, step)
        except (CheckpointNotFoundError, CorruptCheckpointError) as read_err:
            err0 = read_err
    if ctx.dist.any(err0 is not None):  # every rank gives up together: none may wait in dcp.load alone
        raise err0 or CheckpointNotFoundError(f"another rank could not read the manifest of step {step}")
    assert m is not None
    try:  # an unknown dtype (saved by a newer torch?) or shard bytes that do not match it: before allocating
        check_shard_bytes(m)
    except CorruptCheckpointError as bad_dtype:
        bad_dtype.step = step
        if ctx.dist.is_coordinator:
            mark_corrupt(ctx, step, bad_dtype)
        raise
    memory_error: InsufficientMemoryError | None = None
    mismatch: StateMismatchError | None = None
    try:
        template, paths, reshard = _statefn.build_template(m, state, strict=strict)
    except InsufficientMemoryError as e:
        memory_error = e
    except StateMismatchError as e:
        mismatch = e
    if ctx.dist.enabled and ctx.dist.any(memory_error is not None):  # every rank skips the step together
        memory_error = memory_error or InsufficientMemoryError(
            f"restoring step {step}: another rank has not enough memory for it", step=step
        )
    if memory_error is not None:
        raise memory_error
    # a target that only some ranks cannot take (one rank's tensor on read-only memory): every rank stops
    if ctx.dist.enabled and ctx.dist.any(mismatch is not None):
        mismatch = mismatch or StateMismatchError(
            f"cannot restore step {step}: another rank's state cannot take it (its error lists why); nothing "
            "was loaded"
        )
    if mismatch is not None:
        raise mismatch
    reader: ShardReader
    known: dict[str, int] | None = None  # tensors the reading threads scanned for NaN/Inf as they landed
    writing = False  # True once bytes may have reached the caller's objects (tensors loaded in place)
    new_memory_only = False  # True when they may have reached only memory never written before (see below)
    ctx.last_restore.verify_bytes = 0
    try:
        if not ctx.dist.enabled and local_loadable(template, m):  # one process: no DCP (see trainguard._lazy)
            reader = ShardReader(
                ctx.store,
                m,
                threads=getattr(ctx.store, "read_threads", 4),
                scan_finite=scan_finite(ctx),
            )
            # every chunk's CRC32C before the first byte reaches the caller's objects: a corrupt checkpoint
            # leaves them untouched (one more read, from the page cache when the checkpoint was just read;
            # the load does not compute the CRC32C of a file checked here again). Chunks whose every
            # destination is memory never written (a relaunch's new tensors) are loaded first instead, each
            # checked as it lands (one read); a failure there puts that memory back as it was
            try:
                rest = queue_local(template, reader)  # no I/O yet: what the load will read
                fresh = reader.never_written_chunks() if ctx.verify_before_load else set()
                if ctx.verify_before_load:
                    ctx.last_restore.verify_bytes = verify_chunks(ctx, m, template, reader, skip=fresh)
                if fresh:
                    try:
                        reader.flush_never_written(fresh)
                    except BaseException:
                        if reader.not_put_back:  # the kernel kept the failed read's bytes there
                            writing = new_memory_only = True
                            if touched is not None:
                                touched.update(reader.not_put_back)
                        raise
                writing = True
                if touched is not None:
                    touched.update(template)
                finish_local(template, reader, rest)
            finally:
                reader.clear()
            refuse_invalid_bools(ctx, template, step)
            known = reader.scanned()
        else:
            import torch.distributed.checkpoint as dcp

            from .distributed import TrainguardLoadPlanner, TrainguardReader

            # bools are checked after the load, on every rank together (refuse_invalid_bools)
            reader = TrainguardReader(ctx.store, m, scan_finite=scan_finite(ctx), check_bools=False)
            writing = (
                True  # DCP reads each rank's shards in place: no verify pass (it would read every shard)
            )
            if touched is not None:
                touched.update(template)
            with quiet_dcp():
                dcp.load(
                    template, storage_reader=reader, planner=TrainguardLoadPlanner(), **ctx.dist.dcp_kwargs()
                )
            refuse_invalid_bools(ctx, template, step)
            known = reader.scanned_covering(local_numels(template))
    except BaseException as e:
        err = unwrap(e, step, prefer=CorruptCheckpointError)
        if isinstance(err, CorruptCheckpointError):
            err.state_modified = writing
            err.args = (
                f"{err}; "
                + (
                    "tensors of the state may hold part of this checkpoint's bytes: rebuild the objects (a new "
                    "model and optimizer) before training on them"
                    if writing and not new_memory_only
                    else "only tensors allocated and never written before this restore (e.g. torch.empty) may "
                    "hold part of this checkpoint's bytes, the others were not modified: initialize those (or "
                    "rebuild the objects) before training on them"
                    if writing
                    else "the state objects were not modified (no unchecked byte was left in them)"
                ),
            )
        if (
            isinstance(err, CorruptCheckpointError)
            and ctx.dist.is_coordinator
            and is_committed(ctx.storage, step)
        ):
            mark_corrupt(ctx, step, err)  # a chunk gone with its deleted checkpoint is not corruption
        raise err from None
    if ctx.validation is not None:  # the non-finite scan, before the state's objects take the tensors
        ctx.validation.after_load(step, template, m.metadata, known)
    _statefn.apply(template, paths, state, m, strict=strict, reshard=reshard)
    if touched is not None:
        touched.update(template)
    record_resume(ctx, m)
    ctx.last_restore.bytes = reader.bytes_read


def invalid_bools(template: MutableMapping[str, Any]) -> list[str]:
    """Names of the bool tensors of ``template`` (a DTensor's local shard) holding a byte other than 0 or 1.

    torch writes a bool as one byte, 0 or 1; any other byte means the manifest's dtype does not describe the
    chunk's bytes (a forged or mistaken manifest whose CRC32C still matches), and such a tensor is undefined
    behaviour in torch's kernels (the oracle of tests/faults/test_manifest_fuzz.py: ``copy_`` makes it 1)."""
    bad = []
    for fqn, v in template.items():
        to_local = getattr(v, "to_local", None)
        t = to_local() if callable(to_local) else v
        if isinstance(t, torch.Tensor) and not bool_bytes_valid(t):
            bad.append(fqn)
    return bad


def refuse_invalid_bools(ctx: RootContext, template: MutableMapping[str, Any], step: int) -> None:
    """Raise CorruptCheckpointError when a bool tensor of ``template`` holds a byte other than 0 or 1
    (:func:`invalid_bools`), on every rank when any rank found one (collective under torch.distributed)."""
    bad = invalid_bools(template)
    if not ctx.dist.any(bool(bad)):
        return
    raise CorruptCheckpointError(f"step {step}: {invalid_bools_problem(bad)}", step=step)


def scan_finite(ctx: RootContext) -> bool:
    """Whether the reading threads count NaN/Inf as chunks land (the restore's non-finite scan is on)."""
    return ctx.validation is not None and ctx.validation.check_finite != "off"


def local_numels(template: MutableMapping[str, Any]) -> dict[str, int]:
    """fqn -> element count of this rank's part of each tensor of ``template`` (a DTensor's local shard)."""
    out: dict[str, int] = {}
    for fqn, v in template.items():
        if isinstance(v, torch.Tensor):
            to_local = getattr(v, "to_local", None)
            out[fqn] = (to_local() if callable(to_local) else v).numel()
    return out


def verify_chunks(
    ctx: RootContext,
    m: Manifest,
    template: MutableMapping[str, Any],
    reader: ShardReader | None = None,
    *,
    skip: set[str] | frozenset[str] = frozenset(),
) -> int:
    """Read every chunk a load of ``template`` reads, the whole chain of delta bases of each delta chunk
    included, and check its length and CRC32C; returns the bytes read.

    Args:
        reader: the reader that loads next, its reads queued (:func:`queue_local`): it learns the version of
            each file that passed (``ShardReader.checked``: the load does not compute that same file's CRC32C
            again) and the NaN/Inf count of each chunk it would scan (``ShardReader.block_scans``, counted
            here while the disk is the bottleneck, not again in the load).
        skip: chunk hashes not read here (``ShardReader.never_written_chunks``: the load checks them as it
            reads them, before anything else is written).

    Raises:
        CorruptCheckpointError: a chunk is missing, unreadable or fails its check (nothing was loaded).
    """
    owners = m.chunk_owners()
    wanted = set(template)
    needed = [h for h, o in owners.items() if wanted.intersection(o)]  # skip chunks of entries not loaded
    users = delta_chain_users(m, needed, owners)
    todo = [(m.chunks[h], users[h]) for h in m.chunks if h in users and h not in skip]

    scans = reader.block_scans() if reader is not None else {}

    def one(item: tuple[Any, list[str] | None]) -> int:
        rec = item[0]
        found: list[int] = []
        version = ctx.store.verify(rec, step=m.step, owners=item[1], scan=scans.get(rec.hash), scanned=found)
        if reader is not None and version is not None:  # None: copied from a tier (the load copies it)
            reader.checked[rec.hash] = version  # one key per chunk and thread: a plain dict set
            if found:
                reader.prescanned(rec.hash, found[0])
        return int(rec.length)

    if len(todo) <= 1:
        return sum(one(x) for x in todo)
    with ThreadPoolExecutor(
        max_workers=min(VERIFY_THREADS, len(todo))
    ) as pool:  # as many as the load reads with
        return sum(pool.map(one, todo))  # the first failure in chunk order is raised


def delta_chain_users(m: Manifest, hashes: list[str], owners: dict[str, list[str]]) -> dict[str, list[str]]:
    """``hashes`` and every delta base their decoding reads (the chain closure), each mapped to the entries
    whose bytes depend on it (a base that is no entry's own chunk: the entries of the deltas built on it)."""
    users: dict[str, dict[str, None]] = {}  # ordered sets (a packed chunk has thousands of owners)
    for h in hashes:
        cur: str | None = h
        # the parser bounded every chain (MAX_DELTA_CHAIN) and checked that each base exists
        while cur is not None:
            names = users.setdefault(cur, dict.fromkeys(owners.get(cur) or []))
            names.update(dict.fromkeys(owners.get(h, [])))
            rec = m.chunks.get(cur)
            cur = rec.base if rec is not None else None
    return {h: list(names) for h, names in users.items()}


def mark_corrupt(ctx: RootContext, step: int, err: CorruptCheckpointError) -> None:
    """Record what a restore's full read found, so that every view agrees with it.

    Only a confirmed mismatch (``err.damaged``: read twice) or a manifest-level problem condemns the step (and,
    in a writing manager, quarantines the chunk); an I/O error is recorded as an unreadable check, never as
    corruption; a missing chunk needs no record (listing sees it). A read-only manager records too (the records
    are advisory files; nothing is written where the root is read-only) but never moves a chunk.
    """
    ctx.refs.invalidate()  # statuses changed: retention scans again before it deletes anything
    if err.unreadable:
        record_check(ctx.storage, step, by="restore", ok=False, problem=str(err), chunk=err.chunk)
        return
    if err.chunk and not err.damaged:
        return
    moved = None
    if err.chunk and not ctx.read_only:
        moved = ctx.store.quarantine(err.chunk)
        if moved:
            log.warning("moved corrupt chunk %s aside to %s", err.chunk, moved)
    record_corrupt(
        ctx.storage, step, str(err), chunk=err.chunk, tensors=err.tensors, moved_to=moved, fsync=ctx.fsync
    )
