"""validate_relpath with a shared ``resolved`` cache (a manifest's chunk paths: each directory resolved once)
gives the verdicts of resolving every path from scratch (os.path.realpath), symlinks included; so does
LinkCheck, which runs those checks in threads (inline below PARALLEL_FROM paths)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainguard.errors import UnsafeCheckpointError
from trainguard.format.layout import LinkCheck, validate_relpath


def reference(rel: str, root: Path) -> bool:
    """The check without a cache: realpath of every path, from the root down."""
    root_real = Path(os.path.realpath(root))
    full = Path(os.path.realpath(root / rel))
    if full == root_real or root_real in full.parents:
        return True
    parts = rel.split("/")
    return parts[0] == "chunks" and len(parts) > 1 and Path(os.path.realpath(root / "chunks")) in full.parents


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A run root whose chunks/ is a symlink to another disk's directory, with every kind of link below it."""
    root, store, outside = tmp_path / "run", tmp_path / "store", tmp_path / "outside"
    for d in (root, store / "aa", store / "bb", outside / "cc"):
        d.mkdir(parents=True)
    (root / "chunks").symlink_to(store, target_is_directory=True)  # allowed: the store on another disk
    (store / "aa" / "ok").write_bytes(b"x")
    (store / "aa" / "out").symlink_to(outside / "f")  # a chunk file leading out: refused
    (store / "aa" / "in").symlink_to(store / "bb" / "g")  # a link staying inside the store: allowed
    (store / "cc").symlink_to(outside / "cc", target_is_directory=True)  # a <2 hex> dir leading out
    (store / "dd").symlink_to("bb", target_is_directory=True)  # relative link inside the store
    (root / "step-1").symlink_to(outside, target_is_directory=True)
    (root / "loop").symlink_to(root / "loop")
    return root


RELS = [
    "chunks/aa/ok",
    "chunks/aa/out",
    "chunks/aa/in",
    "chunks/aa/missing",
    "chunks/cc/x",
    "chunks/dd/y",
    "chunks/zz/new",
    "step-1/manifest.json",
    "loop",
    "loop/x",
    "events/a.jsonl",
]


def verdict(rel: str, root: Path, cache: dict[str, Path]) -> bool:
    try:
        validate_relpath(rel, root, resolved=cache)
    except UnsafeCheckpointError:
        return False
    return True


@pytest.mark.parametrize("rel", RELS)
def test_each_verdict_matches_the_reference(tree: Path, rel: str) -> None:
    assert verdict(rel, tree, {}) == reference(rel, tree)


def test_verdicts_match_the_reference_with_one_cache(tree: Path) -> None:
    cache: dict[str, Path] = {}
    verdicts = {}
    for rel in RELS + RELS[::-1]:  # one cache for all, in both orders
        ok = verdict(rel, tree, cache)
        assert ok == reference(rel, tree), rel
        verdicts[rel] = ok
    assert verdicts["chunks/aa/ok"] and verdicts["chunks/aa/in"] and verdicts["chunks/dd/y"]
    assert (
        not verdicts["chunks/aa/out"] and not verdicts["chunks/cc/x"] and not verdicts["step-1/manifest.json"]
    )


@pytest.mark.parametrize("rel", ["", "/etc/passwd", "C:x", "a//b", "a/./b", "../x", "a\\b", "a\x00b"])
def test_malformed_paths_are_refused_without_a_root(rel: str) -> None:
    with pytest.raises(UnsafeCheckpointError):
        validate_relpath(rel)
    with pytest.raises(UnsafeCheckpointError):
        validate_relpath(rel, None, resolved={})


@pytest.mark.parametrize("copies", [1, 8])  # 11 paths: inline; 88: in LinkCheck.THREADS threads
def test_link_check_refuses_the_first_bad_path_in_order(tree: Path, copies: int) -> None:
    rels = [r for r in RELS if reference(r, tree)] * copies
    assert (len(rels) >= LinkCheck.PARALLEL_FROM) == (copies > 1)
    LinkCheck(tree, rels).raise_first()  # all good: no error
    for bad in [r for r in RELS if not reference(r, tree)]:
        at = len(rels) - 3
        check = LinkCheck(tree, rels[:at] + [bad, "chunks/aa/out"] + rels[at:])
        with pytest.raises(UnsafeCheckpointError, match="outside the run root") as err:
            check.raise_first()
        assert repr(bad) in str(err.value)  # the first refused path in the list's order, not the later one


def test_link_check_without_a_root_checks_nothing(tree: Path) -> None:
    LinkCheck(None, ["chunks/aa/out"] * 40).raise_first()


def test_a_manifest_of_many_chunks_refuses_a_chunk_file_linked_out_of_the_root(tmp_path: Path) -> None:
    """The threaded check inside read_manifest (>= PARALLEL_FROM chunks) still refuses a chunk file that is a
    symlink leading out of the run root, and still accepts the checkpoint without it."""
    import json
    import shutil

    import torch

    import trainguard as tg
    from trainguard.catalog import read_manifest

    root = tmp_path / "run"
    with tg.CheckpointManager(root, async_save=False, chunk_size_bytes=4096) as mgr:
        mgr.save(1, {"w": torch.arange(48 * 1024, dtype=torch.float32)})  # 48 chunks of 4 KiB
    m = read_manifest(root, 1)
    assert len(m.chunks) >= LinkCheck.PARALLEL_FROM
    body = json.loads((root / "step-000000001" / "manifest.json").read_bytes())
    victim = root / body["chunks"][sorted(body["chunks"])[-1]]["path"]
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy2(victim, outside / victim.name)
    victim.unlink()
    victim.symlink_to(outside / victim.name)
    with pytest.raises(UnsafeCheckpointError, match="outside the run root"):
        read_manifest(root, 1)
