"""SIGKILL of a writer at random and at chosen moments of a save never loses or damages a committed checkpoint.

Each trial forks a victim (``crash_worker.py``) that saves steps N, N+1, ... with ``fsync=True`` into a run
root shared by several trials, and SIGKILLs it. Then, from this process:

- a read-only manager lists every step the victim reported committed (and those of earlier trials) as valid,
  their manifests are byte-identical to what was committed, ``verify`` re-reads every chunk, and the only step
  that may be valid beyond them is the one in flight, when its manifest was already published;
- a writable manager cleans up (no partial directory, no orphan chunk is left), ``restore_latest`` returns the
  newest committed step with its exact values, and saving the next step works.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from faultlib import (
    ForkServer,
    assert_state_is,
    blank_state,
    chunk_files,
    commit_save,
    make_state,
    manifest_path,
    mode_id,
    partial_dirs,
    read_log,
    referenced_chunks,
    save_modes,
    sha256_file,
    wait_until,
)

import trainguard as tg
from trainguard.format.layout import step_dir_name
from trainguard.integrity.verify import verify

SEED = 1129
RANDOM_TRIALS = 30
TRIALS_PER_ROOT = 6
MAX_DELAY_S = 0.45


@dataclass
class Ledger:
    """What this test knows was committed in one run root: step -> SHA-256 of its manifest file."""

    root: Path
    committed: dict[int, str] = field(default_factory=dict)
    next_step: int = 1
    manager_kwargs: dict[str, Any] = field(default_factory=dict)  # how the victims open the root

    def save_here(self, step: int) -> None:
        with tg.CheckpointManager(self.root, fsync=True) as mgr:
            commit_save(mgr, step, make_state(step))
        self.committed[step] = sha256_file(manifest_path(self.root, step))
        self.next_step = step + 1


@dataclass
class Trial:
    inflight: int | None
    committed_by_victim: list[int]
    partial_at_kill: bool
    orphans_at_kill: set[str]
    marker: dict[str, Any] | None


def new_ledger(root: Path, manager_kwargs: dict[str, Any] | None = None) -> Ledger:
    """A run root with one committed checkpoint (step 1) before any kill."""
    ledger = Ledger(root, manager_kwargs=dict(manager_kwargs or {}))
    ledger.save_here(1)
    return ledger


def kill_victim(
    fs: ForkServer,
    ledger: Ledger,
    work: Path,
    name: str,
    *,
    delay_s: float | None = None,
    after: str = "ready",
    hook: tuple[str, int] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """Fork a victim saving from ``ledger.next_step`` on, SIGKILL it ``delay_s`` after its log first shows
    the event ``after`` ("ready": the manager is open; "done": it committed a save), or when it reaches the kill
    point ``hook``, and return its log and the hook's marker. Counting the delay from the victim's own progress,
    not from the fork, keeps where the kills land the same on a loaded machine (start-up and saves slow down
    there)."""
    log, err, marker = work / f"{name}.log", work / f"{name}.stderr", work / f"{name}.marker"
    args: dict[str, Any] = {
        "root": str(ledger.root),
        "log": str(log),
        "stderr": str(err),
        "start": ledger.next_step,
        "manager_kwargs": ledger.manager_kwargs,
    }
    if hook is not None:
        args["hook"] = {"point": hook[0], "at": hook[1], "marker": str(marker)}
    pid = fs.spawn(**args)
    try:
        if hook is None:
            assert delay_s is not None
            wait_until(
                lambda: any(r.get("ev") == after for r in read_log(log)) or "Traceback" in _text(err),
                120,
                f"the victim's first {after!r} record",
            )
            time.sleep(delay_s)
        else:
            wait_until(lambda: marker.exists() or "Traceback" in _text(err), 60, f"kill point {hook}")
    finally:
        os.kill(pid, signal.SIGKILL)
        status = fs.wait(pid)
    assert status["signal"] == signal.SIGKILL, f"the victim ended before the kill: {status}\n{_text(err)}"
    return read_log(log), (json.loads(marker.read_text()) if marker.exists() else None)


def _text(p: Path) -> str:
    try:
        return p.read_text()
    except FileNotFoundError:
        return ""


def check_after_kill(
    ledger: Ledger, log: list[dict[str, Any]], marker: dict[str, Any] | None, inflight_committed: bool | None
) -> Trial:
    """Every assertion after one kill; ``inflight_committed`` True/False when the kill point decides whether
    the step in flight was committed, None for a random kill."""
    root = ledger.root
    done = {e["step"]: e["sha256"] for e in log if e["ev"] == "done"}
    begun = [e["step"] for e in log if e["ev"] == "begin"]
    inflight = begun[-1] if begun and begun[-1] not in done else None
    ledger.committed.update(done)
    partial_at_kill = bool(partial_dirs(root))

    # 1. Listing: every committed step valid; nothing else valid but, possibly, the step in flight.
    infos = {i.step: i for i in tg.CheckpointManager(root, read_only=True).checkpoints()}
    valid = sorted(s for s, i in infos.items() if i.status == "valid")
    lost = sorted(set(ledger.committed) - set(valid))
    assert not lost, f"committed steps {lost} no longer valid: {[infos.get(s) for s in lost]}"
    extra = set(valid) - set(ledger.committed)
    assert extra <= {inflight}, (
        f"steps {sorted(extra)} list as valid but were never committed (in flight: {inflight})"
    )
    if inflight_committed is True:
        assert extra == {inflight}, "the kill came after the manifest was published: the step must be valid"
    elif inflight_committed is False:
        assert not extra, f"step {inflight} was killed before its commit but lists as valid"
        if inflight is not None and inflight in infos:
            assert infos[inflight].status == "incomplete", infos[inflight]

    # 2. Committed manifests are byte-identical; every chunk of every valid step re-reads with its CRC32C.
    for s, digest in ledger.committed.items():
        assert sha256_file(manifest_path(root, s)) == digest, f"manifest of committed step {s} changed"
    report = verify(root, valid)
    assert report.ok, report.corrupt
    assert report.checked == valid
    if extra:  # the in-flight step did commit: from now on it is as committed as the others
        ledger.committed[inflight] = sha256_file(manifest_path(root, inflight))  # type: ignore[index]
    orphans_at_kill = chunk_files(root) - referenced_chunks(root, valid)

    # 3. A writable manager cleans up, restores the newest committed step exactly and saves the next one.
    with tg.CheckpointManager(root, fsync=True) as mgr:
        assert partial_dirs(root) == [], "partial directories survived the cleanup"
        dead = [d.name for d in root.glob("step-*") if d.is_dir() and not (d / "manifest.json").exists()]
        assert dead == [], f"step directories without a manifest survived the cleanup: {dead}"
        assert chunk_files(root) == referenced_chunks(root, valid), "orphan chunks survived the cleanup"
        state = blank_state()
        newest = mgr.restore_latest(state)
        assert newest == max(valid)
        assert_state_is(state, newest)
        nxt = newest + 1
        commit_save(mgr, nxt, make_state(nxt))
    ledger.committed[nxt] = sha256_file(manifest_path(root, nxt))
    ledger.next_step = nxt + 1
    return Trial(inflight, sorted(done), partial_at_kill, orphans_at_kill, marker)


def final_check(ledger: Ledger) -> None:
    """After the last trial of a root: all of it verifies, and only committed steps are listed."""
    infos = tg.CheckpointManager(ledger.root, read_only=True).checkpoints()
    assert [(i.step, i.status) for i in infos] == [(s, "valid") for s in sorted(ledger.committed)]
    report = verify(ledger.root)
    assert report.ok and report.checked == sorted(ledger.committed), report.corrupt


def test_random_sigkills_never_lose_or_damage_a_committed_checkpoint(forkserver, tmp_path):
    rng = random.Random(SEED)
    trials: list[Trial] = []
    ledger = None
    for n in range(RANDOM_TRIALS):
        if n % TRIALS_PER_ROOT == 0:
            if ledger is not None:
                final_check(ledger)
            r = n // TRIALS_PER_ROOT
            ledger = new_ledger(tmp_path / f"root{r}", save_modes()[r % len(save_modes())])  # alternate modes
        assert ledger is not None
        # every other trial counts its delay from the victim's first commit, so that trials with a commit by
        # the victim itself exist however slow the machine is; the rest count from the manager being open
        log, _ = kill_victim(
            forkserver,
            ledger,
            tmp_path,
            f"random{n}",
            delay_s=rng.uniform(0.0, MAX_DELAY_S),
            after="done" if n % 2 else "ready",
        )
        trials.append(check_after_kill(ledger, log, None, None))
    assert ledger is not None
    final_check(ledger)
    # The kills landed where they matter: many in the middle of a save (about 3 in 4 on an idle machine) and
    # many after the victim had committed something itself (every odd trial waits for that, so >= 15). (Kills that leave uncommitted chunks published
    # happen in some random trials, not reliably on a loaded machine: the deterministic ``chunk_published``
    # kill point below covers that window every time.)
    mid_save = [t for t in trials if t.inflight is not None]
    assert len(mid_save) >= RANDOM_TRIALS // 3, [t.inflight for t in trials]
    assert sum(1 for t in trials if t.committed_by_victim) >= RANDOM_TRIALS // 2, [
        t.committed_by_victim for t in trials
    ]


# (kill point, occurrence, was the step in flight committed?) The occurrence counts within one victim: the
# first save of a victim writes three new chunks (big, emb and the packed one; frozen exists already).
KILL_POINTS = [
    ("mid_chunk_write", 1, False),
    ("mid_chunk_write", 5, False),
    ("chunk_published", 1, False),
    ("chunk_published", 6, False),
    ("before_publish", 1, False),
    ("before_publish", 3, False),
    ("step_dir_created", 1, False),
    ("step_dir_created", 2, False),
    ("manifest_tmp_written", 1, False),
    ("manifest_tmp_written", 2, False),
    ("after_commit", 1, True),
    ("after_commit", 2, True),
]


@pytest.mark.parametrize("mode", save_modes(), ids=mode_id)
def test_sigkill_at_each_point_of_the_commit_protocol_is_recovered(forkserver, tmp_path, mode):
    ledger = new_ledger(tmp_path / "root", mode)
    fired = []
    for point, at, committed in KILL_POINTS:
        log, marker = kill_victim(forkserver, ledger, tmp_path, f"{point}{at}", hook=(point, at))
        assert marker is not None and marker["point"] == point, f"kill point {point} #{at} never fired"
        root = ledger.root
        # Evidence that the fault left what it should, before the checks (which clean it up) run.
        if point == "mid_chunk_write":
            tmp = Path(marker["path"])
            inflight = [e["step"] for e in log if e["ev"] == "begin"][-1]
            assert tmp.parent.name.startswith(step_dir_name(inflight) + ".partial-")
            assert tmp.stat().st_size == marker["written"] < marker["length"]
        elif point == "chunk_published":
            assert Path(marker["chunk"]).is_file()
        elif point == "step_dir_created":
            assert Path(marker["step_dir"]).is_dir()
            assert not (Path(marker["step_dir"]) / "manifest.json").exists()
        elif point == "manifest_tmp_written":
            assert Path(marker["tmp"]).is_file() and not Path(marker["dst"]).exists()
        trial = check_after_kill(ledger, log, marker, committed)
        assert trial.inflight is not None, "the kill point is inside a save"
        if point == "chunk_published":
            # an orphan at the kill; check_after_kill saw the cleanup collect it (the re-save of the same step
            # then writes the same content-addressed chunk again)
            assert Path(marker["chunk"]).relative_to(root).as_posix() in trial.orphans_at_kill
        if point == "mid_chunk_write":
            assert not Path(marker["path"]).exists()
        fired.append((point, at))
    final_check(ledger)
    assert fired == [(p, a) for p, a, _ in KILL_POINTS]


def test_a_job_killed_during_its_first_publish_restarts_from_scratch(forkserver, tmp_path):
    ledger = Ledger(tmp_path / "root")
    log, marker = kill_victim(forkserver, ledger, tmp_path, "first", hook=("step_dir_created", 1))
    assert marker is not None and [e["step"] for e in log if e["ev"] == "begin"] == [1]
    step_dir = ledger.root / step_dir_name(1)
    assert step_dir.is_dir() and not (step_dir / "manifest.json").exists()
    ro = tg.CheckpointManager(ledger.root, read_only=True)
    assert ro.restore_latest(blank_state()) is None  # the uncommitted step directory is no checkpoint
    with tg.CheckpointManager(ledger.root) as mgr:
        assert not step_dir.exists(), "the writable manager's cleanup removes the dead step directory"
        assert mgr.restore_latest(blank_state()) is None
        commit_save(mgr, 1, make_state(1))
    assert verify(ledger.root).ok


def test_verify_of_the_whole_root_skips_a_step_directory_killed_before_its_manifest(forkserver, tmp_path):
    ledger = new_ledger(tmp_path / "root")
    _, marker = kill_victim(forkserver, ledger, tmp_path, "publish", hook=("step_dir_created", 1))
    assert marker is not None
    report = verify(ledger.root)
    assert report.ok and report.checked == [1]


def test_identical_large_tensors_in_one_save_are_written_safely(tmp_path):
    from trainguard.storage import Fault, FaultyStorage, LocalStorage

    slow = Fault(
        "write", match="chunks/*", times=None, stall=0.05
    )  # a slow disk: both writer threads overlap
    disk = FaultyStorage(LocalStorage(tmp_path / "root"), slow)
    zeros = {"a": torch.zeros(300_000), "b": torch.zeros(300_000)}  # e.g. fresh optimizer moments
    with tg.CheckpointManager(disk) as mgr:
        commit_save(mgr, 1, zeros)
        assert slow.seen, "the slow disk was in the path"
        state = {"a": torch.ones(300_000), "b": torch.ones(300_000)}
        assert mgr.restore_latest(state) == 1 and not state["a"].any() and not state["b"].any()
