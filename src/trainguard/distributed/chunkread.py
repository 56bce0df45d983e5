"""Reading a checkpoint's entries into destination tensors, without DCP (torch only).

:class:`ShardReader` reads saved shards (or parts of them) into destination tensors and values into their
tagged payloads, checking each chunk (length, CRC32C) as it is read. When a read covers a whole saved shard
whose chunks are the shard's own, the bytes go straight into the destination tensor's memory (no intermediate
buffer); otherwise (resharding, packed chunks, dtype or device conversion) the shard is read, checked, narrowed
and copied. DCP's :class:`~trainguard.distributed.reader.TrainguardReader` drives it item by item;
:func:`queue_local` then :func:`finish_local` drive it alone for a single process, so a restart that restores one process's checkpoint
never imports DCP (:mod:`trainguard._lazy`).
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from .._prefault import MemoryMaps, edges, never_written, put_back, swap_configured
from ..errors import CorruptCheckpointError
from ..format import ChunkRecord, Manifest, Segment, ShardRecord, TensorEntry, ValueEntry
from ..incremental.chunkstore import ChunkStore
from ..incremental.delta import read_decoded
from ..state.dtypes import dtype_from_name
from ..state.values import TAG_JSON, TAG_TORCH, bool_bytes_valid, decode_value, invalid_bools_problem
from ..validation.finite import byte_view, count_nonfinite_buffer


class ShardReader:
    """Reads the entries of one parsed, validated manifest.

    Args:
        store: the run's chunk store.
        manifest: the checkpoint's manifest.
        threads: threads reading whole chunks into destination memory.

        scan_finite: count NaN/Inf of each tensor read whole, chunk by chunk in the reading threads as its
            bytes land (overlapping the reads still in flight); see :meth:`scanned`.

    Attributes:
        bytes_read: bytes read from chunks so far.
    """

    def __init__(
        self, store: ChunkStore, manifest: Manifest, *, threads: int = 4, scan_finite: bool = False
    ) -> None:
        self.threads = threads
        self.store = store
        self.manifest = manifest
        self.owners = manifest.chunk_owners()
        self.bytes_read = 0
        self.scan_finite = scan_finite
        self.nonfinite: dict[
            str, int
        ] = {}  # fqn -> NaN/Inf count, for tensors scanned as their chunks landed
        self._unscanned: set[str] = set()  # fqns read (partly) another way: the caller scans them
        self._multi: set[str] = set()  # fqns saved in several shards: scanned() leaves them to the caller
        self.scanned_elems: dict[str, int] = {}  # fqn -> elements the reading threads scanned
        self._chunk_cache: dict[str, bytearray] = {}
        self._jobs: list[tuple[ChunkRecord, memoryview, str, torch.dtype]] = []
        self._lock = threading.Lock()
        # chunk hash -> file version whose CRC32C this process checked just before the load (the pass of
        # ``verify_before_load``): read again without computing it a second time (``ChunkStore.readinto``)
        self.checked: dict[str, tuple[Any, ...]] = {}
        self._prescanned: dict[str, int] = {}  # chunk hash -> NaN/Inf count found by that pass (block_scan)
        self.not_put_back: set[str] = set()  # see flush_never_written

    def entry(self, fqn: str) -> TensorEntry | ValueEntry:
        entry = self.manifest.entries.get(fqn)
        if entry is None:
            raise CorruptCheckpointError(
                f"checkpoint of step {self.manifest.step} has no entry {fqn!r}", step=self.manifest.step
            )
        return entry

    def value_payload(self, fqn: str) -> bytes:
        """The tagged payload of value ``fqn`` (what :func:`trainguard.state.values.decode_value` reads)."""
        entry = self.entry(fqn)
        if not isinstance(entry, ValueEntry):
            raise CorruptCheckpointError(f"{fqn!r} is a tensor in the checkpoint, expected a value")
        if entry.segments is None:
            return TAG_JSON + json.dumps(entry.value).encode()
        tag = TAG_JSON if entry.codec == "json" else TAG_TORCH
        return tag + bytes(self._segments_bytes(entry.segments))

    def read_tensor(
        self,
        fqn: str,
        shard_offsets: tuple[int, ...],
        storage_offsets: tuple[int, ...],
        lengths: tuple[int, ...],
        dest: torch.Tensor,
        dest_bytes: memoryview | None = None,
    ) -> bool:
        """Read the part ``storage_offsets`` + ``lengths`` (elements per dim) of the saved shard of ``fqn`` at
        ``shard_offsets`` into ``dest`` (a tensor of shape ``lengths``, any dtype and device).

        ``dest_bytes``: ``dest``'s bytes as :func:`_bytes_of` gives them for a contiguous CPU ``dest``, made
        by the caller beforehand. :func:`finish_local` passes them: made while the reading threads run, the
        tensor view costs a GIL hand-over per call (measured: 0.2 s per 2 GiB restore of 420 packed tensors).

        Returns:
            True when the bytes are only queued to go straight into ``dest``'s memory: ``dest`` holds them
            after :meth:`flush`. False when ``dest`` holds them already.

        Raises:
            CorruptCheckpointError: no such entry or shard, a wrong byte count, a chunk failing its check.
        """
        entry = self.entry(fqn)
        if not isinstance(entry, TensorEntry):
            raise CorruptCheckpointError(f"{fqn!r} is a value in the checkpoint, expected a tensor")
        shard = self._find_shard(entry, shard_offsets)
        dtype = dtype_from_name(entry.dtype)
        expected = shard.nbytes
        numel = math.prod(shard.sizes)
        if expected != numel * dtype.itemsize:
            raise CorruptCheckpointError(
                f"{fqn!r}: shard holds {expected} bytes but {tuple(shard.sizes)} x {entry.dtype} needs "
                f"{numel * dtype.itemsize}",
                step=self.manifest.step,
            )
        if self._whole(shard, dtype, storage_offsets, lengths, dest):
            raw = dest_bytes if dest_bytes is not None else _bytes_of(dest)
            if not self._own_chunks(shard):  # parts of packed chunks: each copied from its chunk into dest
                self._unscanned.add(fqn)
                self._segments_into(shard.segments, raw)
                return False
            off = 0
            if any(seg.length % dtype.itemsize for seg in shard.segments):
                self._unscanned.add(fqn)  # scanned per chunk only when the chunks hold whole elements
            elif len(entry.shards) != 1:
                self._multi.add(fqn)  # see scanned_covering
            for seg in shard.segments:
                self._jobs.append((self.manifest.chunks[seg.chunk], raw[off : off + seg.length], fqn, dtype))
                off += seg.length
            return True
        self._unscanned.add(fqn)
        data = self._segments_bytes(shard.segments)
        src = (
            torch.frombuffer(data, dtype=torch.uint8).view(dtype) if numel else torch.empty(0, dtype=dtype)
        ).reshape(shard.sizes)
        for dim, (o, n) in enumerate(zip(storage_offsets, lengths, strict=False)):
            src = src.narrow(dim, o, n)
        if dtype == torch.bool and not bool_bytes_valid(src):
            # ``copy_`` turns every nonzero byte into 1 (into a bool destination too), so forged bytes would pass
            # any later check of ``dest``: a resharded or column-sharded load, a strided destination, a user's
            # dcp.load into a float or uint8 tensor. Raised on this rank; DCP's load gathers it on every rank
            problem = invalid_bools_problem([fqn])
            raise CorruptCheckpointError(f"step {self.manifest.step}: {problem}", step=self.manifest.step)
        dest.copy_(src)
        return False

    def _whole(
        self,
        shard: ShardRecord,
        dtype: torch.dtype,
        storage_offsets: tuple[int, ...],
        lengths: tuple[int, ...],
        dest: torch.Tensor,
    ) -> bool:
        """Whether a read of ``storage_offsets`` + ``lengths`` of ``shard`` into ``dest`` is the whole shard
        into contiguous CPU memory of the saved dtype: its bytes can be copied into ``dest``'s as they lie."""
        return (
            all(o == 0 for o in storage_offsets)
            and tuple(lengths) == tuple(shard.sizes)
            and dest.dtype == dtype
            and _plain_memory(dest)
        )

    def _own_chunks(self, shard: ShardRecord) -> bool:
        """Whether every segment of ``shard`` is a whole chunk of its own (not packed with other tensors'
        bytes): a :meth:`_whole` read then reads each chunk file straight into ``dest`` in the reading
        threads."""
        return all(
            s.offset == 0 and s.length == self.manifest.chunks[s.chunk].decoded_size for s in shard.segments
        )

    def queues_directly(
        self,
        fqn: str,
        shard_offsets: tuple[int, ...],
        storage_offsets: tuple[int, ...],
        lengths: tuple[int, ...],
        dest: torch.Tensor,
    ) -> bool:
        """Whether :meth:`read_tensor` with these arguments would only queue the read (no I/O before
        :meth:`flush`); False also when the entry or shard is missing (read_tensor then raises)."""
        entry = self.manifest.entries.get(fqn)
        if not isinstance(entry, TensorEntry):
            return False
        try:
            shard = self._find_shard(entry, shard_offsets)
            dtype = dtype_from_name(entry.dtype)
        except (CorruptCheckpointError, ValueError, TypeError):
            return False
        return self._whole(shard, dtype, storage_offsets, lengths, dest) and self._own_chunks(shard)

    def flush(self) -> None:
        """Read every queued whole chunk into its destination, CRC32C-checked, from ``threads`` threads
        (largest first: one stream at a time leaves the disk idle between files)."""
        jobs, self._jobs = self._jobs, []
        self._run(jobs)

    def never_written_chunks(self) -> set[str]:
        """The queued chunks (stored, not encoded) whose every destination is memory never written
        (:func:`trainguard._prefault.never_written`: a relaunched job's new ``torch.empty`` tensors, a model
        materialized with ``to_empty``): :meth:`flush_never_written` loads them in one read each, checked as
        they land, and puts that memory back as it was if one fails, so ``verify_before_load`` need not read
        them first. Empty where the machine has swap or the calls are missing. Call after every read is
        queued, before any is run."""
        if not self._jobs or swap_configured():
            return set()
        maps = MemoryMaps()  # after the destinations were allocated: ~1 ms for a few thousand mappings
        by_chunk: dict[str, bool] = {}
        for rec, view, _, _ in self._jobs:
            ok = by_chunk.get(rec.hash, True)
            by_chunk[rec.hash] = ok and not rec.encoded and never_written(view, maps)
        if swap_configured():  # again, after the mincore calls: a page swapped out meanwhile counts as swap
            return set()
        return {h for h, ok in by_chunk.items() if ok}

    def flush_never_written(self, chunks: set[str]) -> None:
        """Read the queued reads of ``chunks`` (:meth:`never_written_chunks`) now, as :meth:`flush` does, and
        leave the others queued. When one fails (a chunk fails its check, an I/O error), every destination of
        these reads is put back as it was (:func:`trainguard._prefault.put_back`: its pages dropped, zero-filled
        as never written; the bytes of its partial end pages rewritten) before the error is raised.

        Attributes set:
            not_put_back: the fqns whose memory the kernel refused to put back (they may hold the failed
                read's bytes); empty when everything was.
        """
        jobs = [j for j in self._jobs if j[0].hash in chunks]
        self._jobs = [j for j in self._jobs if j[0].hash not in chunks]
        kept = [edges(view) for _, view, _, _ in jobs]  # before any byte is written
        self.not_put_back = set()
        try:
            self._run(jobs)  # returns or raises only once no read can write any more
        except BaseException:
            for (_, view, fqn, _), k in zip(jobs, kept, strict=True):
                if not put_back(view, k):
                    self.not_put_back.add(fqn)
            raise

    @contextlib.contextmanager
    def flushing(self) -> Iterator[None]:
        """Run :meth:`flush` of the reads queued so far in a thread while the body reads the rest (values,
        packed chunks, resharded parts), so both kinds of I/O overlap; on exit wait for those reads (also when
        the body raised: no thread is left writing into destination tensors), raise their error, then flush
        whatever the body queued."""
        jobs, self._jobs = self._jobs, []  # taken here: the body may queue more meanwhile
        errors: list[BaseException] = []

        def run() -> None:
            try:
                self._run(jobs)
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread after the join
                errors.append(e)

        flusher = threading.Thread(target=run, name="trainguard-read-flush", daemon=True) if jobs else None
        if flusher is not None:
            flusher.start()
        try:
            yield
        finally:
            if flusher is not None:
                flusher.join()
        if errors:
            raise errors[0]
        self.flush()

    def _run(self, jobs: list[tuple[ChunkRecord, memoryview, str, torch.dtype]]) -> None:
        jobs = sorted(jobs, key=lambda j: -j[0].length)
        step = self.manifest.step

        def one(job: tuple[ChunkRecord, memoryview, str, torch.dtype]) -> None:
            rec, view, fqn, dtype = job
            scanning = self._scanning(job)
            bad: int | None = None
            if rec.encoded:
                self._decode(rec, view)
            else:  # the NaN/Inf scan of each block as it lands, while it is in the cache
                bad = self.store.readinto(
                    rec,
                    view,
                    step=step,
                    owners=self.owners.get(rec.hash),
                    scan=_block_scan(dtype) if scanning and rec.hash not in self._prescanned else None,
                    checked=self.checked.get(rec.hash),
                )
                if scanning and rec.hash in self._prescanned:
                    bad = self._prescanned[rec.hash]
            if scanning:
                if bad is None:  # decoded, or copied from a tier: the whole chunk, as it now lies in memory
                    bad = count_nonfinite_buffer(view, dtype)
                with self._lock:
                    self.nonfinite[fqn] = self.nonfinite.get(fqn, 0) + bad
                    self.scanned_elems[fqn] = self.scanned_elems.get(fqn, 0) + len(view) // dtype.itemsize

        if len(jobs) <= 1 or self.threads <= 1:
            for job in jobs:
                one(job)
        else:
            # Returns or raises only once no thread can write into a destination any more: after a failure
            # (or a KeyboardInterrupt landing in submit, when the pool may not know a thread it started) the
            # reads not begun are skipped, and the ones under way are waited for
            done = threading.Condition()
            gate = {"running": 0, "stop": False}

            def guarded(job: tuple[ChunkRecord, memoryview, str, torch.dtype]) -> None:
                with done:
                    gate["running"] += 1  # before looking at "stop": the wait below then sees this read
                try:
                    if not gate["stop"]:
                        one(job)
                finally:
                    with done:
                        gate["running"] -= 1
                        done.notify_all()

            try:
                with ThreadPoolExecutor(
                    max_workers=self.threads, thread_name_prefix="trainguard-read"
                ) as pool:
                    try:
                        for f in [pool.submit(guarded, j) for j in jobs]:
                            f.result()
                    except BaseException:
                        gate["stop"] = True
                        raise
            finally:
                with done:
                    gate["stop"] = True
                    while gate["running"]:
                        done.wait()
        with self._lock:
            self.bytes_read += sum(job[0].length for job in jobs if not job[0].encoded)

    def _scanning(self, job: tuple[ChunkRecord, memoryview, str, torch.dtype]) -> bool:
        """Whether the reading threads count NaN/Inf of this queued read (see :meth:`scanned`)."""
        _, view, fqn, dtype = job
        return (
            self.scan_finite
            and fqn not in self._unscanned
            and len(view) > 0
            and (dtype.is_floating_point or dtype.is_complex)
        )

    def block_scans(self) -> dict[str, Callable[[memoryview], int]]:
        """Chunk hash -> the NaN/Inf count per block, for every chunk whose queued reads would all be scanned
        with one dtype: the pass that checks every chunk before the load (``verify_before_load``) runs it while
        the disk is the bottleneck and reports each count with :meth:`prescanned`. Call after every read is
        queued."""
        by_chunk: dict[str, list[tuple[ChunkRecord, memoryview, str, torch.dtype]]] = {}
        for job in self._jobs:
            by_chunk.setdefault(job[0].hash, []).append(job)
        return {
            h: _block_scan(jobs[0][3])
            for h, jobs in by_chunk.items()
            if not jobs[0][0].encoded
            and all(self._scanning(j) for j in jobs)
            and len({j[3] for j in jobs}) == 1
        }

    def prescanned(self, h: str, count: int) -> None:
        """Record the NaN/Inf count :meth:`block_scans`' function found in chunk ``h`` (the load reads it
        without scanning again, and counts this for every tensor read from it)."""
        self._prescanned[h] = count

    def scanned(self) -> dict[str, int]:
        """fqn -> NaN/Inf count for the tensors the reading threads scanned whole (``scan_finite``); a tensor
        read any other way (resharded, packed with others, converted) is not here: the caller scans it."""
        return {k: v for k, v in self.nonfinite.items() if k not in self._unscanned and k not in self._multi}

    def scanned_covering(self, numels: Mapping[str, int]) -> dict[str, int]:
        """fqn -> NaN/Inf count for the tensors whose every element the reading threads scanned: all of
        their reads went straight into memory and the scanned elements add up to ``numels[fqn]`` (the
        destination's element count; e.g. a rank's local shard of a DTensor, read from one or more saved
        shards). Any other tensor is not here: the caller scans it."""
        return {
            k: v
            for k, v in self.nonfinite.items()
            if k not in self._unscanned and k in numels and self.scanned_elems.get(k) == numels[k]
        }

    def clear(self) -> None:
        """Drop cached chunk bytes and queued reads."""
        self._chunk_cache.clear()
        self._jobs = []
        self._prescanned.clear()

    # -- helpers ------------------------------------------------------------------------------------------
    def _chunk(self, h: str) -> bytearray:
        buf = self._chunk_cache.get(h)
        if buf is None:
            rec = self.manifest.chunks[h]
            if rec.encoded:
                buf = bytearray(rec.decoded_size)
                self._decode(rec, memoryview(buf))
            else:
                buf = self.store.read(
                    rec, step=self.manifest.step, owners=self.owners.get(h), checked=self.checked.get(h)
                )
                with self._lock:  # flush's threads may be counting too (TrainguardReader.read_data)
                    self.bytes_read += rec.length
            self._chunk_cache[h] = buf
        return buf

    def _decode(self, rec: ChunkRecord, out: memoryview) -> None:
        """Decode an encoded chunk (and its chain of delta bases, each CRC32C-checked) into ``out``."""
        read_decoded(
            self.store,
            self.manifest.chunks,
            rec,
            out,
            step=self.manifest.step,
            owners=self.owners.get(rec.hash),
        )
        base, n = rec, rec.length
        while base.base is not None:
            base = self.manifest.chunks[base.base]
            n += base.length
        with self._lock:
            self.bytes_read += n

    def _segments_bytes(self, segs: tuple[Segment, ...]) -> bytearray:
        out = bytearray(sum(s.length for s in segs))
        self._segments_into(segs, memoryview(out))
        return out

    def _segments_into(self, segs: tuple[Segment, ...], out: memoryview) -> None:
        """Copy the bytes of ``segs`` in order into ``out`` (their total length), each from its chunk (read,
        checked and cached once per chunk: a packed chunk serves all its tensors)."""
        off = 0
        for s in segs:
            chunk = self._chunk(s.chunk)
            out[off : off + s.length] = memoryview(chunk)[s.offset : s.offset + s.length]
            off += s.length
            if s.length == len(chunk):
                self._chunk_cache.pop(s.chunk, None)  # a tensor's own chunk is not needed again

    @staticmethod
    def _find_shard(entry: TensorEntry, offsets: tuple[int, ...]) -> ShardRecord:
        for sh in entry.shards:
            if tuple(sh.offsets) == offsets or (not offsets and not any(sh.offsets)):
                return sh
        raise CorruptCheckpointError(f"{entry.fqn!r}: no saved shard at offsets {offsets}")


def _plain_memory(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements are its bytes as they lie: contiguous CPU memory, no conjugate or negative bit
    (a view with one of those bits is loaded by value through ``Tensor.copy_``)."""
    return t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and not t.is_neg()


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable, as a flat memoryview of ``t.nbytes`` bytes."""
    return memoryview(byte_view(t).numpy())  # type: ignore[arg-type]


def _block_scan(dtype: torch.dtype) -> Callable[[memoryview], int]:
    """The per-block NaN/Inf count of a chunk holding elements of ``dtype`` (``ChunkStore.readinto``'s and
    ``ChunkStore.verify``'s ``scan``)."""
    return lambda block: count_nonfinite_buffer(block, dtype)


def local_loadable(template: MutableMapping[str, Any], manifest: Manifest) -> bool:
    """Whether :func:`queue_local` + :func:`finish_local` can load ``template`` exactly as ``dcp.load`` would: every destination
    tensor is a plain tensor (or ``nn.Parameter``: no DTensor or other subclass) of the saved shape, every
    value destination is a non-tensor, and every key is in the manifest. Anything else goes through DCP, whose
    errors and resharding are the reference."""
    for fqn, dest in template.items():
        entry = manifest.entries.get(fqn)
        if entry is None:
            return False
        if isinstance(dest, torch.Tensor):
            if type(dest) not in (torch.Tensor, torch.nn.Parameter) or not isinstance(entry, TensorEntry):
                return False
            if tuple(dest.shape) != tuple(entry.shape):
                return False
        elif isinstance(entry, TensorEntry):
            return False
    return True


# what :func:`queue_local` leaves to :func:`finish_local`, per entry: None for a value; for a shard read by the
# loading thread, ``read_tensor``'s arguments and the destination's bytes (None: not contiguous CPU memory)
_ReadArgs = tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, ...], torch.Tensor]
Rest = list[tuple[str, tuple[_ReadArgs, memoryview | None] | None]]


def queue_local(template: MutableMapping[str, Any], reader: ShardReader) -> Rest:
    """Load a single process's ``template`` (``{fqn: destination tensor | placeholder}``, see
    :func:`trainguard._statefn.build_template`) in place, as ``dcp.load`` with the trainguard planner does, in
    two halves (check :func:`local_loadable` first; call :meth:`ShardReader.clear` after both). This first half
    queues every read that goes straight into a destination's memory (no I/O yet) and returns the rest (values,
    packed chunks) for :func:`finish_local`, which reads every saved shard into its region of the destination
    and decodes each value (JSON or ``torch.load(weights_only=True)``). Between the two the reader's queued
    reads are known: ``verify_before_load`` checks their chunks and counts their NaN/Inf
    (:meth:`ShardReader.block_scans`) before any byte reaches the caller's objects.

    Raises:
        CorruptCheckpointError: the manifest disagrees with itself (no entry or shard, wrong byte count).
    """
    rest: Rest = []
    for fqn, dest in list(template.items()):
        if not isinstance(dest, torch.Tensor):
            rest.append((fqn, None))
            continue
        entry = reader.entry(fqn)
        assert isinstance(entry, TensorEntry)
        for sh in entry.shards:
            if 0 in sh.sizes and entry.shape and 0 not in entry.shape:
                continue  # an empty shard of a non-empty tensor holds nothing
            region = dest.detach()
            for dim, (o, n) in enumerate(zip(sh.offsets, sh.sizes, strict=True)):
                region = region.narrow(dim, o, n)
            args: _ReadArgs = (fqn, tuple(sh.offsets), (0,) * len(sh.sizes), tuple(sh.sizes), region)
            if reader.queues_directly(*args):
                reader.read_tensor(*args)
            else:
                whole = region.dtype == dtype_from_name(entry.dtype) and _plain_memory(region)
                rest.append((fqn, (args, _bytes_of(region) if whole else None)))
    return rest


def finish_local(template: MutableMapping[str, Any], reader: ShardReader, rest: Rest) -> None:
    """Second half of :func:`queue_local`: the queued reads in the reading threads while this thread decodes
    the values and reads the packed chunks of ``rest`` (:func:`queue_local`'s result).

    Raises:
        CorruptCheckpointError: a chunk fails its check, or the manifest disagrees with itself.
        UnsafeCheckpointError: a value's payload is unsafe to decode.
    """
    with reader.flushing():
        for fqn, item in rest:
            if item is None:
                template[fqn] = decode_value(reader.value_payload(fqn), fqn)
            else:
                reader.read_tensor(*item[0], dest_bytes=item[1])
