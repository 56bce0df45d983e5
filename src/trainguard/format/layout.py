"""Path layout of a run root and validation of paths read from a manifest.

<run root>/
  chunks/<2 hex>/<content hash>        content-addressed chunks shared by the run's checkpoints
  step-000001000/manifest.json         written last, atomically: its presence is the commit
  step-000001000.partial-<nonce>/      a save in progress (temporary chunk files); never a checkpoint
  events/                              the event log (JSON lines)
"""

from __future__ import annotations

import numbers
import os
import re
import threading
from pathlib import Path, PurePosixPath

from ..errors import ConfigError, UnsafeCheckpointError

CHUNKS_DIR = "chunks"
MANIFEST_NAME = "manifest.json"
STEP_DIGITS = 9

_STEP_RE = re.compile(r"step-([0-9]+)")  # always used with fullmatch: no trailing newline, ASCII digits only
_PARTIAL_RE = re.compile(r"step-([0-9]+)\.partial-([0-9a-zA-Z]+)")
_HASH_RE = re.compile(r"[0-9a-f]{32}")


MAX_STEP = 1 << 62
"""The largest step a checkpoint may have (a manifest with a larger one is corrupt)."""


def step_problem(step: object) -> str | None:
    """None for a valid step (an int in ``[0, MAX_STEP]``, not a bool), else what is wrong and the fix."""
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        return f"step must be an int >= 0, got {step!r}"
    if step > MAX_STEP:
        return f"step must be at most 2**62 ({MAX_STEP}), got {step}; count steps from 0 with a plain counter"
    return None


def as_step(step: object) -> int:
    """Check a step given to a public entry point and return it as a Python int.

    Args:
        step: an int in ``[0, 2**62]``; a numpy integer is accepted and converted. Not a bool, float or str.

    Returns:
        ``step`` as an ``int``.

    Raises:
        ConfigError: ``step`` is not an int, is negative or larger than 2**62 (the message names the value
            and the fix).
    """
    if isinstance(step, numbers.Integral) and not isinstance(step, (bool, int)):
        step = int(step)  # numpy integers
    problem = step_problem(step)
    if problem is None:
        return step  # type: ignore[return-value]  # step_problem checked it is an int
    if not isinstance(step, int) or isinstance(step, bool):
        problem += f" (a {type(step).__name__}); pass the training step counter as an int"
    elif step < 0:
        problem += "; steps count up from 0"
    raise ConfigError(problem)


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


def validate_relpath(
    rel: str, root: str | os.PathLike[str] | None = None, *, resolved: dict[str, Path] | None = None
) -> str:
    """Check a path read from a manifest and return it unchanged.

    A valid path is relative, uses ``/`` separators, has no empty, ``.`` or ``..`` components, no NUL or
    backslash, and, when ``root`` is given, does not resolve (through symlinks) outside ``root``. A path under
    ``chunks/`` may instead resolve inside wherever ``<root>/chunks`` itself resolves: the user may place the
    chunk store on another disk by making ``chunks`` a symlink; a chunk file or a ``chunks/<2 hex>``
    directory that is a symlink leading out of it is still refused.

    Args:
        rel: the path as the manifest spells it.
        root: the run root it must stay inside; None checks the spelling only.
        resolved: a cache of the real paths of ``root``'s directories (relative path -> real path) shared by
            the calls that check one manifest's paths: its chunks share a few directories, each resolved once
            (then only a path's last component is looked at).

    Returns:
        ``rel`` unchanged.

    Raises:
        UnsafeCheckpointError: naming the path and the rule it breaks.
    """
    if not isinstance(rel, str) or not rel:
        raise UnsafeCheckpointError(f"manifest path {rel!r} is not a non-empty string")
    if "\x00" in rel or "\\" in rel:
        raise UnsafeCheckpointError(f"manifest path {rel!r} contains a NUL or backslash")
    if rel.startswith("/") or PurePosixPath(rel).is_absolute() or re.match(r"^[A-Za-z]:", rel):
        raise UnsafeCheckpointError(
            f"manifest path {rel!r} is absolute; only paths inside the run root are allowed"
        )
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise UnsafeCheckpointError(f"manifest path {rel!r} has an empty, '.' or '..' component")
    if root is not None:
        dirs: dict[str, Path] = {} if resolved is None else resolved

        def real(d: str) -> Path:  # a directory of the root ("": the root), resolved through symlinks
            got = dirs.get(d)
            if got is None:
                parent, _, name = d.rpartition("/")
                if not d:
                    got = Path(os.path.realpath(root))
                else:  # the resolved parent plus the name (one lstat), or the link's target resolved
                    got = real(parent) / name
                    if os.path.islink(got):
                        got = Path(os.path.realpath(got))
                dirs[d] = got
            return got

        root_real = real("")
        within = real("/".join(parts[:-1])) / parts[-1]  # the directory resolved: only the name is left
        full = Path(os.path.realpath(within)) if os.path.islink(within) else within
        inside = full == root_real or root_real in full.parents
        if not inside and parts[0] == CHUNKS_DIR and len(parts) > 1:
            inside = real(CHUNKS_DIR) in full.parents
        if not inside:
            raise UnsafeCheckpointError(f"manifest path {rel!r} resolves outside the run root (symlink?)")
    return rel


class LinkCheck:
    """:func:`validate_relpath` of many paths of one root, run in threads while the caller works on.

    Each path's check looks its directory and file up (``realpath``, ``lstat``); on a cold cache every lookup
    waits for the disk (a restore right after a reboot, or each rank of a job reading a manifest of hundreds of
    chunks: ~50 ms of waits one after the other, ~15 ms of CPU). ``THREADS`` threads keep the lookups in
    flight together, and the caller's thread parses the rest of the manifest meanwhile. The verdicts are those
    of calling :func:`validate_relpath` on each path in order (:meth:`raise_first` raises the first path's
    error); fewer than ``PARALLEL_FROM`` paths are checked inline.

    Args:
        root: the run root; None checks nothing (the spelling is the caller's check).
        rels: relative paths (already checked for their spelling).
    """

    THREADS = 8
    PARALLEL_FROM = 32

    def __init__(self, root: str | os.PathLike[str] | None, rels: list[str]) -> None:
        self._root = root
        self._rels = rels
        self._errors: list[BaseException | None] = [None] * len(rels)
        self._resolved: dict[str, Path] = {}  # shared: a race only resolves a directory twice, alike
        self._threads: list[threading.Thread] = []
        if root is None:
            return
        if len(rels) < self.PARALLEL_FROM:
            self._check(0, 1)
            return
        for i in range(self.THREADS):
            th = threading.Thread(
                target=self._check, args=(i, self.THREADS), name="trainguard-links", daemon=True
            )
            th.start()
            self._threads.append(th)

    def _check(self, start: int, stride: int) -> None:
        for i in range(start, len(self._rels), stride):
            try:
                validate_relpath(self._rels[i], self._root, resolved=self._resolved)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread by raise_first
                self._errors[i] = e

    def join(self) -> None:
        """Wait for every path's verdict."""
        for th in self._threads:
            th.join()
        self._threads = []

    def raise_first(self) -> None:
        """Raise the error of the first refused path (in the order given), if any; joins first.

        Raises:
            UnsafeCheckpointError: a path resolves outside the run root.
        """
        self.join()
        for e in self._errors:
            if e is not None:
                raise e
