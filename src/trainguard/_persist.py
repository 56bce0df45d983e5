"""The save path: DCP save through our writer, the commit, the events and retention (a save's "persist"
phase; it runs in the caller's thread for synchronous saves and in the background worker otherwise)."""

from __future__ import annotations

import contextlib
import logging
import secrets
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ._text import exception_text, naming_step
from ._writers import WriterThreads
from .commit import publish
from .distributed.chunkwrite import ChunkWriter, ItemResult, Layout, plain_state, save_local, tensor_bytes
from .distributed.manifest import build_manifest
from .errors import NonFiniteStateError, SaveError, StateMismatchError, StorageFullError, TrainguardError
from .format import Manifest
from .format.layout import partial_dir_name
from .incremental.auto import SAMPLE_BYTES, SAMPLE_TENSORS, Decision, state_sample
from .incremental.delta import SaveEncoder
from .results import SaveResult
from .retention.apply import apply_retention, referenced_chunks, space_hint
from .validation.probe import PROBE_FILE, encode

if TYPE_CHECKING:
    from ._context import RootContext

log = logging.getLogger("trainguard")


def persist(
    ctx: RootContext,
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
    writers: WriterThreads | None = None,
) -> SaveResult:
    """Write chunks, commit, apply retention (in the caller's thread or the background worker).

    One process with plain tensors saves without DCP (:func:`~trainguard.distributed.chunkwrite.save_local`);
    under torch.distributed (or with DTensors) ``dcp.save`` drives the same writer and imports DCP on the first
    save (not at ``import trainguard``: see :mod:`trainguard._lazy`).

    ``cancel`` set (the save was abandoned after a stall) makes the commit raise instead of publishing.

    A background save (``blocking=False``) starts the manager's writer threads but lets only
    ``WriterOptions.background()``'s number of them work at once (training keeps a core), all of them once
    ``writers`` is lifted (a caller waits for this save: :class:`~trainguard._writers.WriterThreads`).

    One process: the ``check_finite`` scan of each tensor stored as chunks of its own runs in the writer
    thread that stored it, skipped for a tensor whose chunks equal those it had when last found finite
    (:class:`~trainguard.validation.finite.SaveScan`); the remaining (packed) tensors are scanned before the
    commit. On a manager's first save the codec sample of ``compression="auto"`` runs in a thread beside the
    writes (:class:`Beside`). Under torch.distributed the whole scan (with a collective) runs before the
    writes.

    Raises:
        NonFiniteStateError: ``check_finite="error"`` and the staged state holds NaN/Inf (nothing committed;
            chunks this save wrote are deleted)."""
    ctx.collection.wait()  # the last retention's chunk deletions end before this save deduplicates
    overlap = not ctx.dist.enabled
    probe = (
        ctx.validation.before_persist(step, flat, scan=not overlap) if ctx.validation is not None else None
    )
    partial = partial_dir_name(step, f"r{ctx.dist.rank}{secrets.token_hex(4)}")
    ctx.storage.make_dir(partial)
    ctx.store.last_progress = time.monotonic()
    manifest_box: list[Manifest] = []

    def commit(layout: Layout, results: list[list[ItemResult]], all_paths: dict[str, Any]) -> None:
        if cancel is not None and cancel.is_set():
            raise SaveError(
                f"the save of step {step} was abandoned (no progress); not committing it", step=step
            )
        beside.join()
        if overlap and validation is not None:  # NonFiniteStateError: a state with NaN/Inf is never committed
            validation.scan_before_commit(step, flat, scan.known if scan is not None else None)
        if sample and ctx.compression is not None:  # the first save's event shows the codec it measured
            decision.inputs.update(codec_Bps=ctx.compression.codec_Bps, ratio=ctx.compression.ratio)
        m = build_manifest(step, layout, results, all_paths, top, metrics, metadata, run=ctx.run)
        extra = (lambda mbytes: {PROBE_FILE: encode(probe[0], manifest=mbytes)}) if probe else None
        publish(ctx.storage, m, fsync=ctx.fsync, extra=extra)
        manifest_box.append(m)
        # known to retention before the chunks are unpinned (``finally`` below): a background chunk deletion
        # checks pins, then these counts, under the store's lock (ChunkStore.collect)
        ctx.refs.add(step, m.chunks, run_id=ctx.run.run_id, metrics=m.metrics)

    local = not ctx.dist.enabled and plain_state(flat)
    staging = ctx.store.staging_for(partial)  # on the chunks' filesystem
    # a background persist leaves training a core until someone waits for it; its writer threads also encode
    # (compression="auto" models the threads of a save that nobody waits for)
    options = ctx.options
    threads = options.threads
    if not blocking:
        threads = options.background().threads
        writers = writers or WriterThreads()
        writers.configure(low=threads, high=options.threads)
    else:
        writers = None
    decision, encoder, sample = begin_encoding(ctx, flat, defer_sample=overlap, threads=threads)
    validation = ctx.validation
    scan = validation.save_scan() if overlap and validation is not None else None
    writer = (ChunkWriter if local else dcp_writer())(
        ctx.store,
        staging,
        commit,
        options,
        step,
        paths=dict(paths),
        encoder=encoder,
        scan=scan,
        writers=writers,
    )
    beside = Beside(
        (lambda: ctx.compression.measure_sample(sample)) if sample else None  # type: ignore[union-attr]
    )
    try:
        if local:  # one process, plain tensors: no DCP
            save_local(flat, writer)
        else:
            save_dcp(ctx, flat, writer)
    except BaseException as e:
        err = unwrap(e, step)
        # rejected by the scan before the commit (its event is logged)
        if isinstance(err, NonFiniteStateError):
            discard_new_chunks(ctx, writer)
            raise err from None
        ranks = (
            sorted(int(r) for r in getattr(e, "failures", {}))
            if is_checkpoint_exception(e)
            else [ctx.dist.rank]
        )
        ctx.event("save_failed", step=step, error=exception_text(err), failed_ranks=ranks)
        discard_new_chunks(ctx, writer)
        if isinstance(err, StorageFullError):
            if err.step is None:
                err.step = step
            if err.args and isinstance(err.args[0], str):
                err.args = (naming_step(err.args[0], step), *err.args[1:])
            hint = space_hint(ctx)
            if hint and err.args and hint not in str(err.args[0]):
                head = str(err.args[0]).rstrip()  # the hint is whole sentences: end the message with one
                err.args = (head + ("" if head.endswith(".") else ".") + hint, *err.args[1:])
        if ctx.dist.enabled and isinstance(err, SaveError) and not err.rank_errors and ranks:
            # a SaveError raised on one rank (StorageFullError): name that rank on every rank
            cause = err.__cause__ if isinstance(err.__cause__, BaseException) else err
            err.rank_errors = {ranks[0]: cause}
            if err.args and f"rank {ranks[0]}" not in str(err.args[0]):
                # the step is named once, with the rank
                text = str(err.args[0]).removeprefix(f"saving step {step} failed: ")
                err.args = (f"saving step {step} failed on rank {ranks[0]}: {text}", *err.args[1:])
        if isinstance(err, (KeyboardInterrupt, SystemExit, SaveError)):
            raise err  # noqa: B904 - keeps its own cause (e.g. the OSError behind a StorageFullError)
        if isinstance(err, TrainguardError) and not isinstance(err, OSError) and not ctx.dist.enabled:
            raise err  # noqa: B904 - one process: the specific error; under dist it is wrapped to name the rank
        where = f" on rank {ranks[0]}" if ctx.dist.enabled else ""
        raise SaveError(
            f"saving step {step} failed{where}: {exception_text(err)}; nothing was committed and earlier "
            "checkpoints are intact",
            step=step,
            rank_errors={ranks[0]: err},
        ) from err
    finally:
        beside.join(raise_error=False)  # the staged buffers are reused after the save: no reader left
        ctx.store.unpin(writer.hashes)
        ctx.storage.delete_prefix(partial)
        if staging != partial:
            ctx.storage.delete_prefix(staging)
    elapsed = time.perf_counter() - t0
    block_s = elapsed if blocking else float(staging_s or 0.0)
    end_encoding(ctx, decision, encoder, writer)
    if not manifest_box:  # not the coordinator: this rank's chunks are durable and rank 0 committed
        result = SaveResult(
            step=step,
            bytes=writer.bytes_total,
            bytes_written=writer.bytes_written,
            block_s=block_s,
            persist_s=elapsed,
            new_bytes=writer.bytes_written,
            logical_bytes=logical_bytes(flat),
        )
        ctx.saves.append(result)
        return result
    m = manifest_box[0]
    ctx.refs.committed(step)
    result = SaveResult(
        step=step,
        bytes=m.bytes,
        bytes_written=writer.bytes_written,
        block_s=block_s,
        persist_s=elapsed,
        new_bytes=m.new_bytes if m.new_bytes is not None else writer.bytes_written,
        logical_bytes=m.logical_bytes,
    )
    ctx.saves.append(result)
    ctx.event(
        "save",
        step=step,
        bytes=result.bytes,
        bytes_written=result.bytes_written,
        new_bytes=result.new_bytes,
        logical_bytes=result.logical_bytes,
        compression=decision.to_json()
        | {
            "deltas": encoder.stats.deltas if encoder else 0,
            "reused": encoder.stats.reused if encoder else 0,
        },
        block_s=result.block_s,
        persist_s=result.persist_s,
        chunks=len(m.chunks),
        staging_bytes=ctx.staging_bytes(),
        async_save=not blocking,
        **({"probe_s": probe[1]} if probe is not None else {}),
    )
    tier_error = ctx.tiers.after_commit(step) if ctx.tiers is not None else None  # dual write, queue uploads
    if cancel is None or not cancel.is_set():  # an abandoned save's worker has a successor: it decides
        apply_retention(ctx)
    if tier_error is not None:
        raise tier_error
    return result


def dcp_writer() -> type[ChunkWriter]:
    """DCP's ``StorageWriter`` over the chunk writer (imports DCP)."""
    from .distributed.writer import TrainguardWriter

    return TrainguardWriter


def save_dcp(ctx: RootContext, flat: dict[str, Any], writer: ChunkWriter) -> None:
    """Save through DCP's planner: ``dcp.save`` with a process group (its collectives plan the shards and
    dedup replicated tensors across ranks), else the planner and writer calls it makes in one process
    (:func:`~trainguard.distributed.local.save_planned`, a state with DTensors under ``collective=False``)."""
    import torch.distributed.checkpoint as dcp

    from .distributed import TrainguardSavePlanner
    from .distributed.local import save_planned

    if ctx.dist.enabled:  # with a process group: no "single process" warning to silence (quiet_dcp)
        dcp.save(flat, storage_writer=writer, planner=TrainguardSavePlanner(), **ctx.dist.dcp_kwargs())
    else:  # the same planner and writer calls, without dcp.save's logging of every entry
        save_planned(flat, writer, TrainguardSavePlanner())  # type: ignore[arg-type]


def local_tensors(flat: Mapping[str, Any]) -> list[torch.Tensor]:
    """This rank's plain tensors of a flattened state (a DTensor's local shard), on any device but ``meta``:
    a synchronous save of CUDA tensors counts their bytes too."""
    out = []
    for t in flat.values():
        to_local = getattr(t, "to_local", None)
        t = to_local() if callable(to_local) else t
        if isinstance(t, torch.Tensor) and type(t) is torch.Tensor and t.device.type != "meta":
            out.append(t)
    return out


def sample_bytes(t: torch.Tensor, limit: int) -> memoryview:
    """At least the first ``limit`` bytes of ``t`` (whole elements) in host memory, for the codec sample: a
    view of a CPU tensor's bytes, or a copy of only that much of a device tensor (empty for a non-contiguous
    one, which a slice would have to copy whole on its device first)."""
    if t.device.type == "cpu":
        return tensor_bytes(t)
    if not t.is_contiguous():
        return memoryview(b"")
    return tensor_bytes(t.detach().reshape(-1)[: -(-limit // t.element_size())])


def logical_bytes(flat: Mapping[str, Any]) -> int:
    """In-memory bytes of this rank's tensors of a flattened state."""
    return sum(t.numel() * t.element_size() for t in local_tensors(flat))


def begin_encoding(
    ctx: RootContext, flat: Mapping[str, Any], *, defer_sample: bool = False, threads: int | None = None
) -> tuple[Decision, SaveEncoder | None, list[tuple[memoryview, int]] | None]:
    """Decide whether this save compresses (``compression``) and set up its encoder (None: raw chunks, no
    memory of pieces needed).

    Args:
        ctx: the run root's context.
        flat: the staged state.
        defer_sample: when the decision does not depend on the codec sample of ``compression="auto"`` (the
            first save), return the sample instead of compressing it here, for the caller to measure
            (``CompressionChooser.measure_sample``) beside the writes.
        threads: the writer threads of this save, which encode its chunks (an async save's background
            writer may run fewer than a synchronous one); None: the manager's.

    Returns:
        ``(decision, encoder, sample)``: ``sample`` is None unless deferred.
    """
    assert ctx.compression is not None and ctx.incremental is not None  # set by the manager
    tensors = local_tensors(flat)
    chooser = ctx.compression
    sample = None
    if chooser.needs_sample():
        # the largest tensors first, as state_sample takes them; of a device tensor only the bytes sampled
        big = sorted(
            (t for t in tensors if t.numel() * t.element_size() >= 4096),
            key=lambda t: -t.numel() * t.element_size(),
        )[:SAMPLE_TENSORS]
        per = max(SAMPLE_BYTES // max(len(big), 1), 4096)
        sample = state_sample([(sample_bytes(t, per), t.element_size()) for t in big])
    later = sample if defer_sample and chooser.sample_can_wait() else None
    if later is not None:
        sample = None
    piece = max((t.numel() * t.element_size() for t in tensors), default=0)
    decision = chooser.decide(
        logical_bytes(flat), sample, piece_bytes=min(piece, ctx.options.chunk_size_bytes), threads=threads
    )
    log.info(
        "save compression: %s (%s)",
        "on" if decision.compress else "off",
        ", ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in decision.to_json().items()
        ),
    )
    if chooser.mode == "off" and not ctx.incremental.delta:
        return decision, None, later
    return decision, ctx.incremental.begin(compress=decision.compress), later


class Beside:
    """One job run in a thread beside a save's chunk writes (the codec sample of ``compression="auto"`` on a
    manager's first save), joined before the commit.

    Args:
        job: the callable (None: no thread is started).
    """

    def __init__(self, job: Callable[[], None] | None) -> None:
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if job is not None:
            self._thread = threading.Thread(
                target=self._run, args=(job,), name="trainguard-beside-writes", daemon=True
            )
            self._thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as e:  # noqa: BLE001 - raised by join, in the save's thread
            self._error = e

    def join(self, *, raise_error: bool = True) -> None:
        """Wait for the job; raise its exception (once) unless ``raise_error`` is False."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        err, self._error = self._error, None
        if err is not None and raise_error:
            raise err


def end_encoding(
    ctx: RootContext, decision: Decision, encoder: SaveEncoder | None, writer: ChunkWriter
) -> None:
    """After a committed save: its pieces become the next save's delta bases; its measurements feed auto."""
    assert ctx.compression is not None and ctx.incremental is not None  # set by the manager
    if encoder is not None:
        ctx.incremental.committed(encoder)
    st = encoder.stats if encoder is not None else None
    ctx.compression.observe(
        compressed=decision.compress,
        logical_bytes=int(decision.inputs.get("logical_bytes") or 0),
        stored_written=writer.bytes_written,
        raw_encoded=st.raw_bytes if st else 0,
        stored_encoded=st.stored_bytes if st else 0,
        encode_s=st.encode_s if st else 0.0,
        write_s=writer.write_s,
    )


def discard_new_chunks(ctx: RootContext, writer: ChunkWriter) -> None:
    """After a failed save: delete the chunks it wrote that no committed manifest references.

    One process: this save's new chunks. Under torch.distributed, rank 0 (the lock holder) collects every
    unreferenced chunk: DCP reports a failure to rank 0 only after every rank's ``write_data`` returned (its
    chunks are renamed into ``chunks/`` or dropped by then), and no other save of this run can write before
    rank 0 joins its planning collective, so every unreferenced chunk is garbage of this save (or of earlier
    failed ones)."""
    ctx.store.unpin(writer.hashes)
    writer.hashes = []
    if ctx.dist.enabled:
        if not ctx.dist.is_coordinator:
            return
        candidates = ctx.store.all_hashes()
    elif writer.new_hashes:
        candidates = set(writer.new_hashes)
    else:
        return
    referenced = referenced_chunks(ctx)
    if referenced is not None:
        freed = ctx.store.collect(candidates, referenced)
        if freed:
            ctx.event("failed_save_chunks_freed", step=writer.step, bytes=freed)


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
    if errors and all(isinstance(x, StateMismatchError) for x in errors.values()):
        return errors[min(errors)]  # a restore's target problem on every rank: not a failed save
    ranks = sorted(errors)
    first = errors[ranks[0]] if ranks else e
    return SaveError(
        f"step {step}: failed on ranks {ranks} (rank {ranks[0] if ranks else '?'}: "
        f"{exception_text(first)}); nothing was committed and earlier checkpoints are intact",
        step=step,
        rank_errors=errors,
    )
