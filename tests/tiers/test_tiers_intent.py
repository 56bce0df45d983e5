"""Upload intent markers: another process's ``trainguard ls HOT --json`` shows "uploading" for a step being
uploaded, and "missing" once the writer that meant to upload it is gone."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import trainguard as tg
from trainguard.storage.objects import LocalObjects
from trainguard.tiers import intent

from .helpers import CHUNK, make_state, train

TG = str(Path(sys.executable).parent / "trainguard")


def _ls_tiers(hot: Path) -> dict[int, dict[str, str]]:
    out = subprocess.run([TG, "ls", str(hot), "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    return {r["step"]: r["tiers"] for r in json.loads(out.stdout)}


def test_another_process_sees_uploading_while_a_step_is_uploaded_then_valid(
    tmp_path: Path, monkeypatch
) -> None:
    hot, shared = tmp_path / "hot", tmp_path / "shared"
    gate, held = threading.Event(), threading.Event()
    real_put = LocalObjects.put

    def put(self, name, data):  # the tier's manifest PUT waits until the test has looked
        if name.endswith("manifest.json"):
            held.set()
            assert gate.wait(60)
        return real_put(self, name, data)

    monkeypatch.setattr(LocalObjects, "put", put)
    state = make_state()
    mgr = tg.CheckpointManager(hot, tiers=[tg.Tier(str(shared))], chunk_size_bytes=CHUNK)
    try:
        train(state)
        mgr.save(1, state).wait()
        assert held.wait(60)
        marker = intent._path(hot, str(shared), 1)
        assert json.loads(marker.read_text())["tier"] == str(shared)
        assert _ls_tiers(hot) == {1: {str(shared): "uploading"}}
    finally:
        gate.set()
        mgr.close()
    assert not marker.exists()  # removed once the tier's manifest committed
    assert _ls_tiers(hot) == {1: {str(shared): "valid"}}


def test_a_marker_left_by_a_dead_writer_reads_as_missing(tmp_path: Path) -> None:
    hot, shared = tmp_path / "hot", tmp_path / "shared"
    state = make_state()
    with tg.CheckpointManager(hot, tiers=[tg.Tier(str(shared))], chunk_size_bytes=CHUNK) as mgr:
        train(state)
        mgr.save(1, state).wait()
        train(state)
        mgr.save(2, state).wait()
    (shared / "step-000000002" / "manifest.json").unlink()  # as if the upload of step 2 never committed
    intent.mark(hot, str(shared), 2)
    assert intent.uploading(hot, str(shared)) == {2}  # this (live) process wrote it
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    marker = intent._path(hot, str(shared), 2)
    body = json.loads(marker.read_text())
    body["pid"] = int(dead.stdout)
    marker.write_text(json.dumps(body))
    assert _ls_tiers(hot) == {1: {str(shared): "valid"}, 2: {str(shared): "missing"}}
