"""Armed inputs to ``import`` and ``dcp_reader``: a pickle that would run code never runs, is refused with the
reason, and nothing is committed. Each payload is proven armed first (loaded without restrictions, it creates
its sentinel)."""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from click.testing import CliRunner
from faultlib import commit_save, make_state, read_manifest_json, write_manifest
from test_malicious import add_chunk

import trainguard as tg
from trainguard.cli.main import main as cli
from trainguard.errors import UnsafeCheckpointError
from trainguard.interop import import_checkpoint


class RunsCode:
    """Unpickled without restrictions, runs ``touch <path>``."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


def armed_torch_file(path: Path, sentinel: Path) -> None:
    torch.save({"weight": torch.ones(3), "payload": RunsCode(sentinel)}, path)
    proof = sentinel.with_name("proof")
    torch.save({"payload": RunsCode(proof)}, path.with_suffix(".proof"))
    torch.load(path.with_suffix(".proof"), weights_only=False)  # armed: unrestricted loading runs it
    assert proof.exists()


def no_checkpoint(root: Path) -> bool:
    return not root.exists() or not list(root.glob("step-*"))


def test_an_armed_torch_save_file_is_refused_with_the_reason_and_never_runs(tmp_path):
    sentinel = tmp_path / "SENTINEL"
    armed_torch_file(tmp_path / "evil.pt", sentinel)
    with pytest.raises(
        UnsafeCheckpointError, match=r"refusing to import .*evil.pt: it contains posix.system"
    ):
        import_checkpoint(tmp_path / "evil.pt", tmp_path / "root", format="torch", step=1)
    assert not sentinel.exists()
    assert no_checkpoint(tmp_path / "root")


def test_the_cli_refuses_an_armed_pickle_with_exit_1_and_never_runs_it(tmp_path):
    sentinel = tmp_path / "SENTINEL"
    armed_torch_file(tmp_path / "evil.pt", sentinel)
    r = CliRunner().invoke(
        cli, ["import", str(tmp_path / "evil.pt"), str(tmp_path / "root"), "--format", "torch", "--step", "1"]
    )
    assert r.exit_code == 1, r.output
    assert "weights_only=True" in r.output and "weights_only=False" not in r.output  # no advice to run it
    assert not sentinel.exists()
    assert no_checkpoint(tmp_path / "root")


def test_an_armed_dcp_metadata_pickle_is_refused_and_never_runs(tmp_path):
    src = tmp_path / "src"
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(src), no_dist=True)
    sentinel = tmp_path / "SENTINEL"
    (src / ".metadata").write_bytes(pickle.dumps(RunsCode(sentinel)))
    with pytest.raises(UnsafeCheckpointError, match="posix.system|os.system"):
        import_checkpoint(src, tmp_path / "root", format="dcp", step=1)
    assert not sentinel.exists()
    assert no_checkpoint(tmp_path / "root")


def test_an_armed_dcp_value_is_refused_and_never_runs(tmp_path):
    src = tmp_path / "src"
    sentinel = tmp_path / "SENTINEL"
    dcp.save({"w": torch.ones(4), "extra": RunsCode(sentinel)}, checkpoint_id=str(src), no_dist=True)
    assert not sentinel.exists()
    with pytest.raises(UnsafeCheckpointError, match=r"extra.*weights_only=True.*posix.system"):
        import_checkpoint(src, tmp_path / "root", format="dcp", step=1, all_state=True)
    assert not sentinel.exists()
    assert no_checkpoint(tmp_path / "root")


def test_a_dcp_storage_path_leaving_the_directory_is_refused(tmp_path):
    src = tmp_path / "src"
    dcp.save({"w": torch.ones(4)}, checkpoint_id=str(src), no_dist=True)
    md = pickle.loads((src / ".metadata").read_bytes())  # the test's own, trusted file
    for info in md.storage_data.values():
        info.relative_path = "../outside.distcp"
    (src / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeCheckpointError, match=r"\.\."):
        import_checkpoint(src, tmp_path / "root", format="dcp", step=1)
    assert no_checkpoint(tmp_path / "root")


def test_dcp_reader_never_hands_a_stored_payload_to_dcps_unpickler(tmp_path):
    root = tmp_path / "root"
    with tg.CheckpointManager(root) as mgr:
        commit_save(mgr, 1, make_state(1))
    sentinel = tmp_path / "SENTINEL"
    buf = io.BytesIO()
    torch.save(RunsCode(sentinel), buf)
    h, rec = add_chunk(root, buf.getvalue())
    body = read_manifest_json(root, 1)
    assert body["entries"]["optim"]["codec"] == "torch"
    body["chunks"][h] = rec
    body["entries"]["optim"]["segments"] = [[h, 0, rec["length"]]]
    write_manifest(root, 1, body)
    state = {"optim": {}}
    with pytest.raises(BaseException) as e:  # DCP wraps it in its CheckpointException (a BaseException)
        dcp.load(state, storage_reader=tg.dcp_reader(root, 1))  # DCP's DefaultLoadPlanner: weights_only=False
    assert "weights_only" in str(e.value) and "optim" in str(e.value)
    assert not sentinel.exists()
