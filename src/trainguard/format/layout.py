"""Path layout of a run root and validation of paths read from a manifest.

<run root>/
  chunks/<2 hex>/<content hash>        content-addressed chunks shared by the run's checkpoints
  step-000001000/manifest.json         written last, atomically: its presence is the commit
  step-000001000.partial-<nonce>/      a save in progress (temporary chunk files); never a checkpoint
  events/                              the event log (JSON lines)
"""

from __future__ import annotations

import os
import re

from ..errors import UnsafeCheckpointError

CHUNKS_DIR = "chunks"
MANIFEST_NAME = "manifest.json"
STEP_DIGITS = 9

_STEP_RE = re.compile(r"step-([0-9]+)")  # always used with fullmatch: no trailing newline, ASCII digits only
_PARTIAL_RE = re.compile(r"step-([0-9]+)\.partial-([0-9a-zA-Z]+)")
_HASH_RE = re.compile(r"[0-9a-f]{32}")
_DRIVE_RE = re.compile(r"[A-Za-z]:")  # a Windows drive, refused as absolute


MAX_STEP = 1 << 62
"""The largest step a checkpoint may have (a manifest with a larger one is corrupt)."""


def step_problem(step: object) -> str | None:
    """None for a valid step (an int in ``[0, MAX_STEP]``, not a bool), else what is wrong and the fix."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"step must be an int >= 0, got {step!r}"
    if step > MAX_STEP:
        return f"step must be at most 2**62 ({MAX_STEP}), got {step}; count steps from 0 with a plain counter"
    return None


def step_dir_name(step: int) -> str:
    """``step-000001000`` for step 1000 (zero-padded to 9 digits; wider steps keep all their digits)."""
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    return f"step-{step:0{STEP_DIGITS}d}"


def partial_dir_name(step: int, nonce: str) -> str:
    return f"{step_dir_name(step)}.partial-{nonce}"


def parse_step_dir(name: str) -> tuple[int, bool] | None:
    """Return ``(step, is_partial)`` for a step or partial directory name, else None.

    Only the canonical name of a step is accepted (``step-000000007``, not ``step-0000000007`` or ``step-7``):
    every other reader builds the name back from the step with :func:`step_dir_name`, so a misnamed folder
    is not a checkpoint. Ordering of checkpoints always uses the returned integer, never the name as text.
    """
    m = _STEP_RE.fullmatch(name)
    if m:
        step = int(m.group(1))
        return (step, False) if step_dir_name(step) == name else None
    m = _PARTIAL_RE.fullmatch(name)
    if m:
        step = int(m.group(1))
        return (step, True) if name.startswith(step_dir_name(step) + ".") else None
    return None


def chunk_relpath(content_hash: str) -> str:
    """Relative path of a chunk: ``chunks/<first 2 hex>/<hash>``."""
    if not isinstance(content_hash, str) or not _HASH_RE.fullmatch(content_hash):
        raise UnsafeCheckpointError(f"invalid chunk hash {content_hash!r}: expected 32 lowercase hex digits")
    return f"{CHUNKS_DIR}/{content_hash[:2]}/{content_hash}"


def validate_relpath(rel: str, root: str | os.PathLike[str] | None = None) -> str:
    """Check a path read from a manifest and return it unchanged.

    A valid path is relative, uses ``/`` separators, has no empty, ``.`` or ``..`` components, no NUL or
    backslash, and, when ``root`` is given, does not resolve (through symlinks) outside ``root``. A path under
    ``chunks/`` may instead resolve inside wherever ``<root>/chunks`` itself resolves: the user may place the
    chunk store on another disk by making ``chunks`` a symlink; a chunk file or a ``chunks/<2 hex>``
    directory that is a symlink leading out of it is still refused. To check many paths under one root, use
    one :class:`PathChecker` (it resolves each directory once).

    Raises:
        UnsafeCheckpointError: naming the path and the rule it breaks.
    """
    return PathChecker(root).check(rel)


class PathChecker:
    """:func:`validate_relpath` for many paths under one ``root`` (a manifest's chunk paths): each directory's
    symlink resolution is computed once per checker, so a path costs one ``lstat`` of its last component
    instead of resolving every component of its absolute path again. Same result as ``os.path.realpath`` of
    each path (a directory's resolution is cached for the checker's life: make one per manifest read).

    Args:
        root: the run root; None checks the path's form only.
    """

    def __init__(self, root: str | os.PathLike[str] | None) -> None:
        self.root = None if root is None else os.fspath(root)
        self._dirs: dict[str, str] = {}  # relative directory ("" is the root) -> its resolved absolute path

    def check(self, rel: str) -> str:
        """Check ``rel`` as :func:`validate_relpath` does and return it unchanged.

        Raises:
            UnsafeCheckpointError: naming the path and the rule it breaks.
        """
        if not isinstance(rel, str) or not rel:
            raise UnsafeCheckpointError(f"manifest path {rel!r} is not a non-empty string")
        if "\x00" in rel or "\\" in rel:
            raise UnsafeCheckpointError(f"manifest path {rel!r} contains a NUL or backslash")
        if rel.startswith("/") or _DRIVE_RE.match(rel):  # (a POSIX path is absolute iff it starts with /)
            raise UnsafeCheckpointError(
                f"manifest path {rel!r} is absolute; only paths inside the run root are allowed"
            )
        parts = rel.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise UnsafeCheckpointError(f"manifest path {rel!r} has an empty, '.' or '..' component")
        if self.root is None:
            return rel
        root_real = self._resolved("")
        full = self._resolved(rel)
        inside = full == root_real or full.startswith(_as_dir(root_real))
        if not inside and parts[0] == CHUNKS_DIR and len(parts) > 1:
            inside = full.startswith(_as_dir(self._resolved(CHUNKS_DIR)))
        if not inside:
            raise UnsafeCheckpointError(f"manifest path {rel!r} resolves outside the run root (symlink?)")
        return rel

    def _resolved(self, rel: str) -> str:
        """``os.path.realpath(root / rel)``: the parent's resolution (cached) joined with the last component,
        resolved again only when that component is a symlink."""
        hit = self._dirs.get(rel)
        if hit is not None:
            return hit
        assert self.root is not None
        if not rel:
            out = os.path.realpath(self.root)
        else:
            parent, _, name = rel.rpartition("/")
            joined = os.path.join(self._resolved(parent), name)
            out = os.path.realpath(joined) if os.path.islink(joined) else joined
        if rel.count("/") < 2:  # the root and its directories (chunks/<2 hex>), not every chunk file
            self._dirs[rel] = out
        return out


def _as_dir(path: str) -> str:
    """``path`` with one trailing separator (a prefix matching only paths strictly inside it)."""
    return path.rstrip("/") + "/"
