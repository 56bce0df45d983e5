"""The commit protocol (docs/FORMAT.md "Commit protocol").

1. Every rank writes its chunks as temporary files in the save's partial directory, makes them durable
   (one ``syncfs`` by default, or an fsync per file), renames them into ``chunks/`` and makes the renames
   durable; ``write_data`` returns only then.
2. DCP gathers every rank's results to the coordinator; only if no rank failed does it call ``finish``.
3. The coordinator builds the manifest, creates ``step-N/`` (fsync of the root), and publishes
   ``step-N/manifest.json`` with tmp + fsync + rename + directory fsync. Its presence is the commit.
   Just before the manifest, it records the save's check of the bytes (``step-N/verified.json``, not
   fsynced: losing it only makes the checkpoint list as ``unverified``; without the manifest it means
   nothing): every chunk was either written from the bytes whose CRC32C the manifest records, or re-read and
   matched before the save referenced it (ChunkStore). Written before the commit, so that a kill right after
   the commit never leaves a committed checkpoint without it.

A failure anywhere before step 3 completes leaves no manifest, so no reader ever sees the step as valid, and
nothing earlier was modified (chunks are immutable and content-addressed; manifests of other steps are never
touched).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from .catalog import CHECK_RECORD, CORRUPT_MARKER, record_check
from .errors import SaveError
from .format import MANIFEST_NAME, Manifest, manifest_to_json, step_dir_name
from .storage.base import Storage, as_storage
from .validation.probe import PROBE_FILE
from .validation.suspect import SUSPECT_MARKER


def publish(
    root: str | os.PathLike[str] | Storage,
    m: Manifest,
    *,
    fsync: bool = True,
    extra: Callable[[bytes], dict[str, bytes]] | None = None,
) -> None:
    """Step 3 of the protocol: create the step directory and publish the manifest last, atomically.

    Args:
        root: the run root (a directory or its :class:`~trainguard.storage.base.Storage`).
        m: the manifest to commit.
        fsync: make the step directory and the manifest durable.
        extra: ``extra(manifest bytes)`` -> per-step side files (name -> bytes, e.g. ``probe.json``, which
            records the CRC32C of the manifest it belongs to), published before the manifest so a committed
            checkpoint always has them. A ``suspect.json`` of the checkpoint this one replaces is removed after
            the manifest (a crash in between leaves a marker bound to the old manifest's CRC32C: ignored).

    Raises:
        StorageFullError: no space left for the manifest (nothing is committed; its ``step`` is set).
        OSError: the manifest could not be written (nothing is committed).
    """
    storage = as_storage(root)
    d = step_dir_name(m.step)
    created = storage.make_dir(d)
    try:  # from here on a failure or an interrupt (Ctrl-C) leaves no step directory it created
        if created and fsync:
            storage.barrier("")
        for stale in (CORRUPT_MARKER, CHECK_RECORD, PROBE_FILE):  # records of a checkpoint this one replaces
            storage.delete(f"{d}/{stale}")
        data = manifest_to_json(m)
        for name, side in (extra(data) if extra is not None else {}).items():
            storage.publish(f"{d}/{name}", side, durable=fsync)
        record_check(storage, m.step, by="save")
        storage.publish(f"{d}/{MANIFEST_NAME}", data, durable=fsync)
        storage.delete(f"{d}/{SUSPECT_MARKER}")
    except BaseException as e:
        if created:  # leave nothing behind that lists as a checkpoint of this step
            storage.delete_prefix(d)
        else:  # the record must not vouch for the checkpoint this one failed to replace
            storage.delete(f"{d}/{CHECK_RECORD}")
        if isinstance(e, SaveError) and e.step is None:
            e.step = m.step
        raise
