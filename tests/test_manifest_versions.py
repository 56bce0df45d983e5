"""Manifest format versions: per-rank entries are written as format version 2 (a version-1 reader would misread
them), every other manifest stays version 1, and a version-1 manifest claiming a per-rank entry is corrupt."""

from __future__ import annotations

import json

import pytest

import trainguard as tg
from trainguard.format import Manifest, ValueEntry, manifest_from_json, manifest_to_json
from trainguard.format.run import RunInfo


def manifest(*entries: ValueEntry, run: RunInfo | None = None) -> Manifest:
    return Manifest(
        step=3, t=1.0, time="t", world_size=2, entries={e.fqn: e for e in entries}, chunks={}, run=run
    )


def test_per_rank_entries_round_trip_as_format_version_2():
    m = manifest(
        ValueEntry("c.offset@rank0", (("s", "c"), ("s", "offset")), "json", 0, None, 0),
        ValueEntry("c.offset@rank1", (("s", "c"), ("s", "offset")), "json", 1, None, 1),
        ValueEntry("lr", (("s", "lr"),), "json", 0.1),
        run=RunInfo("abc123", (("prev", 2),)),
    )
    data = manifest_to_json(m)
    assert json.loads(data)["format_version"] == 2
    back = manifest_from_json(data, expect_step=3)
    assert {f: e.rank for f, e in back.entries.items()} == {
        "c.offset@rank0": 0,
        "c.offset@rank1": 1,
        "lr": None,
    }
    assert back.run == RunInfo("abc123", (("prev", 2),))


def test_a_manifest_without_per_rank_entries_stays_version_1():
    data = manifest_to_json(manifest(ValueEntry("lr", (("s", "lr"),), "json", 0.1)))
    assert json.loads(data)["format_version"] == 1


def test_a_version_1_manifest_with_a_per_rank_entry_is_corrupt():
    import crc32c

    body = json.loads(manifest_to_json(manifest(ValueEntry("a@rank0", (("s", "a"),), "json", 0, None, 0))))
    body.pop("crc32c")
    body["format_version"] = 1
    body["crc32c"] = crc32c.crc32c(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    with pytest.raises(tg.CorruptCheckpointError, match="per-rank entry needs format_version 2"):
        manifest_from_json(json.dumps(body).encode(), expect_step=3)
