"""Object stores behind the Storage protocol (ObjectStorage) and the tiers' object-store calls on any Storage
(StorageObjects): the Storage conformance round trip on memory:// and on a real S3 API (moto), both ways."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

import trainguard as tg
from trainguard.errors import UnsafeFileError
from trainguard.storage import (
    Fault,
    FaultyStorage,
    LocalStorage,
    ObjectStorage,
    Storage,
    StorageObjects,
    open_object_storage,
)
from trainguard.storage.objects import ObjectStore

from ..storage.test_storage_protocol import test_write_read_list_delete_round_trip as storage_round_trip
from .helpers import object_round_trip


def _memory() -> ObjectStorage:
    return open_object_storage(f"memory://tg-{uuid.uuid4().hex[:12]}/run")


def test_object_storage_on_memory_passes_the_storage_round_trip_and_refuses_climbing_keys() -> None:
    s = _memory()
    assert isinstance(s, Storage) and s.local_path is None
    storage_round_trip(s)
    s.write_new("big", [memoryview(b"x" * 60), b"y" * 40])  # a list of buffers: one object
    assert s.read("big", limit_bytes=100) == b"x" * 60 + b"y" * 40
    with pytest.raises(UnsafeFileError, match="more than the 10 bytes"):
        s.read("big", limit_bytes=10)
    with pytest.raises(UnsafeFileError, match="'..'"):
        s.read("../other-run/big", limit_bytes=100)
    staged = s.stage("chunks/cd/y", b"abc", staging="step-2.partial-x")
    assert s.exists("chunks/cd/y")  # a PUT is atomic: staged objects are visible and complete at once
    s.commit_staged([staged])
    assert s.read("chunks/cd/y", limit_bytes=3) == b"abc"


@pytest.mark.s3
@pytest.mark.parametrize("fast", [True, False], ids=["boto3", "s3fs"])
def test_object_storage_on_s3_passes_the_storage_round_trip(
    bucket: str, fast: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trainguard.storage import objects

    monkeypatch.setattr(objects, "FAST_S3", fast)
    s = open_object_storage(f"s3://{bucket}/st")
    storage_round_trip(s)
    s.write_new("once", b"1")
    with pytest.raises(FileExistsError):  # a conditional create (If-None-Match) on the store
        s.write_new("once", b"2")
    assert s.read("once", limit_bytes=8) == b"1"


@pytest.mark.parametrize("inner", ["local", "memory", "faulty-memory"])
def test_storage_objects_drive_any_storage_with_the_tiers_calls(inner: str, tmp_path: Path) -> None:
    s: Storage = LocalStorage(tmp_path) if inner == "local" else _memory()
    if inner.startswith("faulty"):
        s = FaultyStorage(s)
    store = StorageObjects(s)
    assert isinstance(store, ObjectStore)
    object_round_trip(store)


def test_a_tier_given_as_a_storage_is_keyed_by_its_url_and_takes_no_options(tmp_path: Path) -> None:
    s = FaultyStorage(LocalStorage(tmp_path / "shared"))
    assert tg.Tier(s).key == str(tmp_path / "shared")
    with pytest.raises(tg.ConfigError, match="storage_options"):
        tg.Tier(s, storage_options={"anon": True})
    with pytest.raises(tg.ConfigError, match="hot root itself"):
        tg.CheckpointManager(tmp_path / "shared", tiers=[tg.Tier(s)])


def test_a_list_fault_on_a_tier_storage_fires_through_the_tiers_listing() -> None:
    s = FaultyStorage(_memory(), Fault("list", errno=5, times=None))
    store = StorageObjects(s)
    with pytest.raises(OSError):
        store.list("chunks/")
    assert s.injected and s.injected[0][0] == "list"
