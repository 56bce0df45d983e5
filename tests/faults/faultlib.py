"""Shared helpers of the fault-injection tests: a deterministic training state, on-disk probes and a
manifest re-signer.

Imported by the test modules and by ``crash_worker.py`` (which runs as a script in another process), so it
must not import pytest.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import crc32c
import torch

from trainguard.format.layout import MANIFEST_NAME, step_dir_name
from trainguard.format.manifest import _canonical

# One tensor that never changes between steps: a single chunk shared by every checkpoint (dedup under faults).
_FROZEN_SEED = 7
FROZEN_NUMEL = 262_144  # exactly 1 MiB of float32: the smallest tensor that gets a chunk of its own


def frozen_tensor() -> torch.Tensor:
    return torch.randn(FROZEN_NUMEL, generator=torch.Generator().manual_seed(_FROZEN_SEED))


def make_state(step: int) -> dict[str, Any]:
    """The training state saved at ``step`` (about 3.5 MB; every entry but ``model.frozen`` differs per step).

    Layout on disk: ``model.big``, ``model.emb`` and ``model.frozen`` (>= 1 MiB) get chunks of their own; the
    small tensors, the tuple-holding ``optim`` dict (torch codec) and the 20 KB ``trainer`` dict (JSON codec,
    too large to inline) are packed into one shared chunk; ``epoch`` is inlined in the manifest.
    """
    g = torch.Generator().manual_seed(10_000 + step)
    return {
        "model": {
            "big": torch.randn(320_000, generator=g),
            "emb": torch.randn(288, 1024, generator=g),
            "frozen": frozen_tensor(),
            "small": torch.randn(32, 32, generator=g),
            "bias": torch.arange(64, dtype=torch.int64) * step,
            "half": torch.randn(100, generator=g).to(torch.bfloat16),
        },
        "optim": {"lr": 0.1 / (step + 1), "betas": (0.9, 0.999), "step": step},
        "trainer": {"step": step, "history": [float(i * step) for i in range(2500)]},
        "epoch": step // 10,
    }


def blank_state() -> dict[str, Any]:
    """A restore target whose every tensor and value differs from any saved step."""
    s = make_state(0)
    for k, t in s["model"].items():
        s["model"][k] = torch.full_like(t, -1)
    s["optim"] = {}
    s["trainer"] = {}
    s["epoch"] = -1
    return s


def assert_state_is(state: dict[str, Any], step: int) -> None:
    """Fail unless ``state`` holds exactly what ``make_state(step)`` saved (bit for bit)."""
    want = make_state(step)
    for k, t in want["model"].items():
        got = state["model"][k]
        assert got.dtype == t.dtype and got.shape == t.shape, k
        assert torch.equal(got, t), f"model.{k} does not hold the values of step {step}"
    assert state["optim"] == want["optim"], "optim"
    assert state["trainer"] == want["trainer"], "trainer"
    assert state["epoch"] == want["epoch"], "epoch"


def save_modes() -> list[dict[str, Any]]:
    """Manager keyword sets to run a test under: background and synchronous saves where both exist."""
    import inspect

    import trainguard as tg

    if "async_save" in inspect.signature(tg.CheckpointManager).parameters:
        return [{"async_save": True}, {"async_save": False}]
    return [{}]


def mode_id(kw: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in kw.items()) or "default"


def commit_save(mgr: Any, step: int, state: dict[str, Any], **kw: Any) -> Any:
    """``mgr.save`` and, when it returns a handle of a background save, wait for the commit (so that a
    failure of this save is raised here, whichever save mode the manager uses). Returns the SaveResult."""
    out = mgr.save(step, state, **kw)
    wait = getattr(out, "wait", None)
    return wait() if callable(wait) else out


def require(cond: object, what: str) -> None:
    """A precondition of a test (the fault fired, the premise holds): fails the test as an error of the test
    itself, never as the AssertionError that an ``xfail(raises=AssertionError)`` would absorb."""
    if not cond:
        import pytest

        pytest.fail(f"precondition failed: {what}", pytrace=False)


# -- on-disk probes ---------------------------------------------------------------------------------------
def manifest_path(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / step_dir_name(step) / MANIFEST_NAME


def read_manifest_json(root: str | os.PathLike[str], step: int) -> dict[str, Any]:
    return json.loads(manifest_path(root, step).read_bytes())


def sha256_file(path: str | os.PathLike[str]) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def chunk_files(root: str | os.PathLike[str]) -> set[str]:
    """Relative paths of every file under ``chunks/``."""
    base = Path(root)
    d = base / "chunks"
    if not d.is_dir():
        return set()
    return {p.relative_to(base).as_posix() for p in d.rglob("*") if p.is_file()}


def referenced_chunks(root: str | os.PathLike[str], steps: list[int]) -> set[str]:
    out: set[str] = set()
    for s in steps:
        out |= {c["path"] for c in read_manifest_json(root, s)["chunks"].values()}
    return out


def is_chunk_tmp(path: str | os.PathLike[str]) -> bool:
    """True for the temporary file of a chunk being written (``step-N.partial-*/<32 hex>.<writer>.tmp``), as
    opposed to a manifest's (``.manifest.json.tmp-*``); both go through ``trainguard.storage.local.write_file``."""
    p = Path(path)
    return p.suffix == ".tmp" and len(p.name.split(".")[0]) == 32 and ".partial-" in p.parent.name


def partial_dirs(root: str | os.PathLike[str]) -> list[Path]:
    return sorted(Path(root).glob("step-*.partial-*"))


def chunks_only_in(root: str | os.PathLike[str], step: int, others: list[int]) -> dict[str, dict[str, Any]]:
    """Chunk records of ``step`` that no checkpoint in ``others`` references, by hash."""
    shared = referenced_chunks(root, others)
    return {h: c for h, c in read_manifest_json(root, step)["chunks"].items() if c["path"] not in shared}


def owners_of(root: str | os.PathLike[str], step: int, chunk_hash: str) -> list[str]:
    """FQNs of the entries with bytes in chunk ``chunk_hash`` of ``step`` (from the manifest)."""
    out = []
    for fqn, e in read_manifest_json(root, step)["entries"].items():
        segs = [s for sh in e.get("shards", []) for s in sh["segments"]] + list(e.get("segments") or [])
        if any(s[0] == chunk_hash for s in segs):
            out.append(fqn)
    return out


def flip_bit(path: str | os.PathLike[str], byte: int, bit: int = 0) -> tuple[int, int]:
    """Flip one bit of a file in place; returns the byte's (old, new) values."""
    p = Path(path)
    data = bytearray(p.read_bytes())
    old = data[byte]
    data[byte] ^= 1 << bit
    p.write_bytes(bytes(data))
    return old, data[byte]


# -- crafted manifests ------------------------------------------------------------------------------------
def sign(body: dict[str, Any]) -> bytes:
    """Manifest bytes for ``body`` with a correct ``crc32c`` field (as ``manifest_to_json`` computes it), so
    that a crafted manifest passes the CRC check and reaches the other checks."""
    body = dict(body)
    body.pop("crc32c", None)
    body["crc32c"] = crc32c.crc32c(_canonical(body))
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def write_manifest(root: str | os.PathLike[str], step: int, body: dict[str, Any]) -> None:
    manifest_path(root, step).write_bytes(sign(body))


# -- victim processes -------------------------------------------------------------------------------------
WORKER = Path(__file__).with_name("crash_worker.py")


class ForkServer:
    """Client of ``crash_worker.py serve`` (see its docstring): forks victim processes in milliseconds."""

    def __init__(self) -> None:
        import subprocess
        import sys

        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), "serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=str(WORKER.parent),
        )

    def _call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"fork server died (exit {self.proc.poll()})")
        return json.loads(line)

    def spawn(self, **args: Any) -> int:
        """Fork a victim running ``crash_worker.victim(args)``; returns its pid."""
        return int(self._call(op="spawn", args=args)["pid"])

    def wait(self, pid: int) -> dict[str, Any]:
        """Reap a victim: ``{"signal": N or None, "exit": code or None}``."""
        return self._call(op="wait", pid=pid)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def read_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """A victim's JSON-lines log (a torn last line from the kill is skipped)."""
    out = []
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def wait_until(pred: Any, timeout_s: float, what: str) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.002)


# -- bounded subprocesses ---------------------------------------------------------------------------------
def run_limited(
    argv: list[str], *, timeout_s: float = 60, address_space_bytes: int = 3 << 30
) -> tuple[int | None, str, str]:
    """Run ``argv`` (a Python command line) with ``RLIMIT_AS`` set and a wall-clock limit, for operations that
    could hang (a named pipe) or allocate without bound (a symlink to /dev/zero) on a regression, so that such
    a regression fails the test instead of hanging it or starving the machine. Returns ``(exit code or None
    on a timeout, stdout, stderr)``."""
    import resource
    import subprocess
    import sys

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (address_space_bytes, address_space_bytes))

    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    try:
        p = subprocess.run(
            [sys.executable, *argv],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            preexec_fn=limit,
            env=env,
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        return None, str(e.stdout or ""), str(e.stderr or "")
    return p.returncode, p.stdout, p.stderr


_STORAGE_METHODS = (
    "write_new", "publish", "stage", "commit_staged", "barrier", "move", "read", "open_read", "read_range",
    "stat", "exists", "list", "delete", "delete_prefix",
)  # fmt: skip


def faulty_local(monkeypatch: Any, *faults: Any) -> Any:
    """Route every ``LocalStorage`` (the manager's, the CLI's, ``verify``'s) through the faults of one
    ``FaultyStorage``, for tests that reach the storage through the CLI or a path (where no storage object can
    be handed in). Returns that FaultyStorage: its ``faults``, ``calls`` and ``injected`` are shared by every
    storage; ``clear()`` heals it. Undone with the ``monkeypatch``."""
    from trainguard.storage import FaultyStorage, LocalStorage

    real = {name: getattr(LocalStorage, name) for name in _STORAGE_METHODS}
    shared = FaultyStorage(LocalStorage("/"), *faults)

    class _Unpatched:  # a LocalStorage whose methods are the real ones (the FaultyStorage's inner)
        def __init__(self, st: Any) -> None:
            self.st = st

        def __getattr__(self, name: str) -> Any:
            return real[name].__get__(self.st) if name in real else getattr(self.st, name)

    def route(name: str) -> Any:
        def method(self: Any, *a: Any, **k: Any) -> Any:
            view = object.__new__(FaultyStorage)
            view.__dict__.update(shared.__dict__)
            view.inner = _Unpatched(self)
            return getattr(view, name)(*a, **k)

        return method

    for name in _STORAGE_METHODS:
        monkeypatch.setattr(LocalStorage, name, route(name))
    return shared
