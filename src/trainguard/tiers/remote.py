"""A run root on an object store (or any :class:`~trainguard.storage.objects.ObjectStore`): the same layout as
a local run root, read through whole-object gets.

Status of a step on a tier (``checkpoints()[i].tiers``):
- ``valid``: ``step-N/manifest.json`` parses (its own CRC32C included) and every chunk it lists exists there
  with the recorded length. A full read (:meth:`RemoteRoot.verify`) also checks every chunk's CRC32C;
  restore checks the CRC32C of every chunk it reads, so a chunk rotted on the store is never loaded.
- ``corrupt``: the manifest does not parse, or a chunk is missing or has the wrong length.
- ``missing``: no manifest (never uploaded, still uploading, or an upload killed before its manifest).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import crc32c

from .._time import iso
from ..errors import CorruptCheckpointError, TrainguardError
from ..format import MANIFEST_NAME, Manifest, manifest_from_json, step_dir_name
from ..format.layout import CHUNKS_DIR, parse_step_dir
from ..format.manifest import ChunkRecord
from ..storage.objects import ObjectStore
from ..storage.safeio import MAX_MANIFEST_BYTES

CHECK_NAME = "verified.json"


def manifest_name(step: int) -> str:
    return f"{step_dir_name(step)}/{MANIFEST_NAME}"


@dataclass
class RemoteStep:
    step: int
    status: str  # valid | corrupt
    bytes: int
    time: str | None
    t: float | None
    problem: str | None
    chunk: str | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "step": self.step,
            "status": self.status,
            "bytes": self.bytes,
            "time": self.time,
            "problem": self.problem,
        }


class RemoteRoot:
    """A run root held by an object store.

    Args:
        store: the tier's store (names relative to the run root).
    """

    def __init__(self, store: ObjectStore) -> None:
        self.store = store
        self.url = store.url
        self._manifests: dict[int, Manifest] = {}  # immutable once committed: cached by step

    def committed_steps(self) -> list[int]:
        """Steps whose manifest exists on the store, ascending (one listing)."""
        return sorted(self.committed_sizes())

    def committed_sizes(self) -> dict[int, int]:
        """Step -> the size of its manifest in bytes, for every step whose manifest exists on the store (one
        listing; the sizes let :meth:`manifest_bytes` skip a HEAD request)."""
        names = self.store.list("step-")
        return {s: names[manifest_name(s)] for s in self._committed(names)}

    @staticmethod
    def _committed(names: dict[str, int]) -> set[int]:
        steps = set()
        for name in names:
            d, _, leaf = name.partition("/")
            parsed = parse_step_dir(d)
            if leaf == MANIFEST_NAME and parsed is not None and not parsed[1]:
                steps.add(parsed[0])
        return steps

    def manifest_bytes(self, step: int, size: int | None = None) -> bytes:
        """The manifest of ``step`` as stored (size checked first: ``size`` from a listing, else one HEAD).

        Raises:
            FileNotFoundError: no manifest of that step on the store.
            CorruptCheckpointError: larger than a manifest may be.
        """
        if size is None:
            size = self.store.size(manifest_name(step))
        if size is None:
            raise FileNotFoundError(f"{self.url}/{manifest_name(step)}")
        if size > MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(f"manifest of step {step} on {self.url} is {size} bytes", step=step)
        return self.store.get(manifest_name(step))

    def manifest(self, step: int) -> Manifest:
        """The parsed manifest of ``step`` (cached).

        Raises:
            FileNotFoundError: no manifest of that step on the store.
            CorruptCheckpointError: it does not parse or fails its CRC32C.
        """
        if step not in self._manifests:
            self._manifests[step] = manifest_from_json(self.manifest_bytes(step), expect_step=step)
        return self._manifests[step]

    def forget(self, step: int) -> None:
        self._manifests.pop(step, None)

    def scan(self) -> list[RemoteStep]:
        """Every committed step on the store with its status (two listings, no chunk data read)."""
        names = self.store.list("step-")
        chunks = self.store.list(CHUNKS_DIR + "/")
        out = [self.status(s, chunks) for s in sorted(self._committed(names))]
        return out

    def status(self, step: int, chunks: dict[str, int]) -> RemoteStep:
        """Status of ``step`` given the store's chunk listing (name -> size)."""
        try:
            m = self.manifest(step)
        except FileNotFoundError:
            return RemoteStep(step, "missing", 0, None, None, "no manifest")
        except TrainguardError as e:
            return RemoteStep(step, "corrupt", 0, None, None, str(e))
        for rec in m.chunks.values():
            size = chunks.get(rec.path)
            if size is None:
                return RemoteStep(
                    step, "corrupt", m.bytes, m.time or iso(m.t), m.t, f"chunk {rec.path} missing", rec.path
                )
            if size != rec.length:
                return RemoteStep(
                    step,
                    "corrupt",
                    m.bytes,
                    m.time or iso(m.t),
                    m.t,
                    f"chunk {rec.path} has {size} bytes, expected {rec.length}",
                    rec.path,
                )
        return RemoteStep(step, "valid", m.bytes, m.time or iso(m.t), m.t, None)

    def read_chunk(self, rec: ChunkRecord) -> bytes | None:
        """The chunk's bytes when the store holds it with the recorded length and CRC32C, else None."""
        try:
            data = self.store.get(rec.path)
        except FileNotFoundError:
            return None
        if len(data) != rec.length or crc32c.crc32c(data) != rec.crc32c:
            return None
        return data

    def verify(
        self, step: int, *, on_read: Callable[[int], None] | None = None
    ) -> tuple[str | None, str | None, int]:
        """Read every chunk of ``step`` and check length and CRC32C.

        Args:
            step: the step.
            on_read: called with the bytes of each chunk read, after the read (a rate cap such as
                ``verify --max-bandwidth`` sleeps there: the average read rate stays below it).

        Returns:
            ``(problem, chunk, bytes_read)``: problem None when intact (then recorded on the store as
            ``step-N/verified.json``), else what is wrong and the chunk's path (None for the manifest).
        """
        try:
            m = self.manifest(step)
        except FileNotFoundError:
            return "no manifest", None, 0
        except TrainguardError as e:
            return str(e), None, 0
        read = 0
        for rec in m.chunks.values():
            try:
                data = self.store.get(rec.path)
            except FileNotFoundError:
                return f"chunk {rec.path} missing", rec.path, read
            read += len(data)
            if on_read is not None:
                on_read(len(data))
            if len(data) != rec.length:
                return f"chunk {rec.path} has {len(data)} bytes, expected {rec.length}", rec.path, read
            if crc32c.crc32c(data) != rec.crc32c:
                return f"chunk {rec.path}: CRC32C mismatch", rec.path, read
        try:
            self.store.put(
                f"{step_dir_name(step)}/{CHECK_NAME}",
                json.dumps({"ok": True, "by": "verify", "time": iso()}).encode(),
            )
        except OSError:
            pass  # advisory (a read-only store)
        return None, None, read
