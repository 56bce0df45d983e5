"""validate_relpath with a shared ``resolved`` cache (a manifest's chunk paths: each directory resolved once)
gives the verdicts of resolving every path from scratch (os.path.realpath), symlinks included."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from trainguard.errors import UnsafeCheckpointError
from trainguard.format.layout import validate_relpath


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
