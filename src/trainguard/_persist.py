"""The save path: DCP save through our writer, the commit, the events and retention (a save's "persist"
phase; it runs in the caller's thread for synchronous saves and in the background worker otherwise)."""

from __future__ import annotations

import contextlib
import secrets
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from .commit import build_manifest
from .errors import SaveError, StorageFullError, TrainguardError
from .format import Manifest
from .format.layout import partial_dir_name
from .results import SaveResult
from .retention.apply import referenced_chunks, space_hint
from .validation.hooks import check_before_persist
from .validation.probe import PROBE_FILE, encode

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata
    from torch.distributed.checkpoint.storage import WriteResult

    from .distributed import TrainguardWriter
    from .manager import CheckpointManager


def persist(
    mgr: CheckpointManager,
    step: int,
    flat: dict[str, Any],
    paths: Mapping[str, Any],
    top: dict[str, dict[str, Any]],
    metrics: Mapping[str, Any] | None,
    metadata: Mapping[str, Any] | None,
    t0: float,
    *,
    blocking: bool,
    staging_s: float | None = None,
    cancel: threading.Event | None = None,
) -> SaveResult:
    """Write chunks, commit, apply retention (in the caller's thread or the background worker).

    Imports DCP on the first save (not at ``import trainguard``: see :mod:`trainguard._lazy`).

    ``cancel`` set (the save was abandoned after a stall) makes the commit raise instead of publishing.

    Raises:
        NonFiniteStateError: ``check_finite="error"`` and the staged state holds NaN/Inf (nothing written)."""
    probe = mgr._probes.pop(step, None)
    check_before_persist(mgr, step, flat)
    partial = partial_dir_name(step, f"r{mgr.dist.rank}{secrets.token_hex(4)}")
    mgr.storage.make_dir(partial)
    mgr.store.last_progress = time.monotonic()
    manifest_box: list[Manifest] = []

    def commit(md: Metadata, results: list[list[WriteResult]], all_paths: dict[str, Any]) -> None:
        if cancel is not None and cancel.is_set():
            raise SaveError(
                f"the save of step {step} was abandoned (no progress); not committing it", step=step
            )
        m = build_manifest(step, md, results, all_paths, top, metrics, metadata, run=mgr.run)
        mgr._publish(m, (lambda mbytes: {PROBE_FILE: encode(probe[0], manifest=mbytes)}) if probe else None)
        manifest_box.append(m)

    import torch.distributed.checkpoint as dcp

    from .distributed import TrainguardSavePlanner, TrainguardWriter

    staging = mgr.store.staging_for(partial)  # on the chunks' filesystem
    writer = TrainguardWriter(mgr.store, staging, commit, mgr.options, step, paths=dict(paths))
    try:
        with quiet_dcp():
            dcp.save(flat, storage_writer=writer, planner=TrainguardSavePlanner(), **mgr.dist.dcp_kwargs())
    except BaseException as e:
        err = unwrap(e, step)
        ranks = sorted(int(r) for r in e.failures) if is_checkpoint_exception(e) else [mgr.dist.rank]
        mgr._event("save_failed", step=step, error=f"{type(err).__name__}: {err}", failed_ranks=ranks)
        discard_new_chunks(mgr, writer)
        if isinstance(err, StorageFullError):
            if err.step is None:
                err.step = step
            hint = space_hint(mgr)
            if hint and err.args and hint not in str(err.args[0]):
                err.args = (str(err.args[0]) + hint, *err.args[1:])
        if mgr.dist.enabled and isinstance(err, SaveError) and not err.rank_errors and ranks:
            # a SaveError raised on one rank (StorageFullError): name that rank on every rank
            cause = err.__cause__ if isinstance(err.__cause__, BaseException) else err
            err.rank_errors = {ranks[0]: cause}
            if err.args and f"rank {ranks[0]}" not in str(err.args[0]):
                err.args = (f"saving step {step} failed on rank {ranks[0]}: {err.args[0]}", *err.args[1:])
        if isinstance(err, (KeyboardInterrupt, SystemExit, SaveError)):
            raise err  # noqa: B904 - keeps its own cause (e.g. the OSError behind a StorageFullError)
        if isinstance(err, TrainguardError) and not isinstance(err, OSError) and not mgr.dist.enabled:
            raise err  # noqa: B904 - one process: the specific error; under dist it is wrapped to name the rank
        where = f" on rank {ranks[0]}" if mgr.dist.enabled else ""
        raise SaveError(
            f"saving step {step} failed{where}: {type(err).__name__}: {err}; nothing was committed and earlier "
            "checkpoints are intact",
            step=step,
            rank_errors={ranks[0]: err},
        ) from err
    finally:
        mgr.store.unpin(writer.hashes)
        mgr.storage.delete_prefix(partial)
        if staging != partial:
            mgr.storage.delete_prefix(staging)
    elapsed = time.perf_counter() - t0
    block_s = elapsed if blocking else float(staging_s or 0.0)
    if not manifest_box:  # not the coordinator: this rank's chunks are durable and rank 0 committed
        result = SaveResult(
            step=step,
            bytes=writer.bytes_total,
            bytes_written=writer.bytes_written,
            block_s=block_s,
            persist_s=elapsed,
        )
        mgr.saves.append(result)
        return result
    m = manifest_box[0]
    mgr._manifest_chunks[step] = set(m.chunks)
    mgr._manifest_runs[step] = mgr.run.run_id
    mgr._manifest_metrics[step] = dict(m.metrics)
    result = SaveResult(
        step=step, bytes=m.bytes, bytes_written=writer.bytes_written, block_s=block_s, persist_s=elapsed
    )
    mgr.saves.append(result)
    mgr._event(
        "save",
        step=step,
        bytes=result.bytes,
        bytes_written=result.bytes_written,
        block_s=result.block_s,
        persist_s=result.persist_s,
        chunks=len(m.chunks),
        staging_bytes=mgr.staging_bytes,
        async_save=not blocking,
        **({"probe_s": probe[1]} if probe is not None else {}),
    )
    tier_error = (
        mgr._tiers.after_commit(step) if mgr._tiers is not None else None
    )  # dual write, queue uploads
    mgr._apply_retention()
    if tier_error is not None:
        raise tier_error
    return result


def discard_new_chunks(mgr: CheckpointManager, writer: TrainguardWriter) -> None:
    """After a failed save: delete the chunks it wrote that no committed manifest references.

    One process: this save's new chunks. Under torch.distributed, rank 0 (the lock holder) collects every
    unreferenced chunk: DCP reports a failure to rank 0 only after every rank's ``write_data`` returned (its
    chunks are renamed into ``chunks/`` or dropped by then), and no other save of this run can write before
    rank 0 joins its planning collective, so every unreferenced chunk is garbage of this save (or of earlier
    failed ones)."""
    mgr.store.unpin(writer.hashes)
    writer.hashes = []
    if mgr.dist.enabled:
        if not mgr.dist.is_coordinator:
            return
        candidates = mgr.store.all_hashes()
    elif writer.new_hashes:
        candidates = set(writer.new_hashes)
    else:
        return
    referenced = referenced_chunks(mgr)
    if referenced is not None:
        freed = mgr.store.collect(candidates, referenced)
        if freed:
            mgr._event("failed_save_chunks_freed", step=writer.step, bytes=freed)


@contextlib.contextmanager
def quiet_dcp() -> Iterator[None]:
    """Silence DCP's "assuming the intent is to save in a single process" warning: single process is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


def is_checkpoint_exception(e: BaseException) -> bool:
    """Whether ``e`` is DCP's CheckpointException (never imports DCP: none is raised before it is imported)."""
    api = sys.modules.get("torch.distributed.checkpoint.api")
    return api is not None and isinstance(e, api.CheckpointException)


def unwrap(e: BaseException, step: int | None = None, prefer: type | None = None) -> BaseException:
    """The original exception(s) inside DCP's CheckpointException.

    One failing rank: its exception. Several: a SaveError naming the ranks with every rank's exception in
    ``rank_errors`` (unless one of them is a ``prefer`` instance, e.g. a CorruptCheckpointError on load, which
    every rank then raises so that all fall back together).
    """
    if not is_checkpoint_exception(e):
        return e
    assert hasattr(e, "failures")
    errors: dict[int, BaseException] = {}
    for rank, failure in e.failures.items():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            errors[int(rank)] = inner
    if prefer is not None:
        for inner in errors.values():
            if isinstance(inner, prefer):
                return inner
    if len(errors) == 1:
        return next(iter(errors.values()))
    ranks = sorted(errors)
    first = errors[ranks[0]] if ranks else e
    return SaveError(
        f"step {step}: failed on ranks {ranks} (rank {ranks[0] if ranks else '?'}: {type(first).__name__}: "
        f"{first}); nothing was committed and earlier checkpoints are intact",
        step=step,
        rank_errors=errors,
    )
