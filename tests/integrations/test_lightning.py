"""PyTorch Lightning through ``tg.lightning.TrainguardCheckpointIO``: a run SIGKILLed mid-training and resumed
with ``fit(ckpt_path="last")`` continues identically (per-step losses and final weights, bitwise) to an
uninterrupted run, on CPU with ``deterministic=True``. The job is ``examples/train_lightning.py``.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from ..conftest import REPO, run_env
from ._example import losses, run_example

pytest.importorskip("pytorch_lightning")

import trainguard as tg  # noqa: E402
from trainguard.catalog import read_manifest  # noqa: E402
from trainguard.format import chunk_relpath  # noqa: E402
from trainguard.lightning import TrainguardCheckpointIO, read_pointer  # noqa: E402

pytestmark = pytest.mark.integration

SCRIPT = REPO / "examples" / "train_lightning.py"
STEPS, SAVE_EVERY = 25, 4  # 10 batches per epoch: the kills land mid-epoch 0 and mid-epoch 1


def train(root: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return run_example(SCRIPT, root, out, STEPS, SAVE_EVERY, *extra)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("lightning")
    ref, faulted = d / "reference", d / "faulted"
    ref.mkdir()
    faulted.mkdir()
    r = train(ref / "root", ref)
    assert r.returncode == 0, r.stderr[-3000:]
    kills = []
    for kill_at in (7, 14):  # after the saves of steps 4 and 12 (mid-epoch); the run resumes twice
        p = train(faulted / "root", faulted, "--kill-at", str(kill_at))
        kills.append(p.returncode)
    final = train(faulted / "root", faulted)
    assert final.returncode == 0, final.stderr[-3000:]
    return {"ref": ref, "faulted": faulted, "kills": kills}


def test_a_killed_lightning_run_resumes_bit_exactly(runs: dict[str, Any]) -> None:
    assert runs["kills"] == [-signal.SIGKILL, -signal.SIGKILL]  # both faults fired
    ref, faulted = losses(runs["ref"]), losses(runs["faulted"])
    assert sorted(ref) == list(range(1, STEPS + 1))
    assert faulted == ref
    a = torch.load(runs["ref"] / "final.pt", weights_only=True)
    b = torch.load(runs["faulted"] / "final.pt", weights_only=True)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_every_step_of_every_attempt_matches_the_uninterrupted_run(runs: dict[str, Any]) -> None:
    ref = losses(runs["ref"])
    rows = [json.loads(line) for line in (runs["faulted"] / "losses.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows]
    restarts = [i for i in range(1, len(steps)) if steps[i] != steps[i - 1] + 1]
    assert len(restarts) == 2  # two resumes, each from a committed checkpoint at or before its kill
    assert [steps[i - 1] for i in restarts] == [7, 14]
    assert all(steps[i] <= steps[i - 1] + 1 for i in restarts)
    assert all(r["loss"] == ref[r["step"]] for r in rows)


def test_lightning_files_are_pointers_and_checkpoints_are_trainguard_ones(runs: dict[str, Any]) -> None:
    root = runs["faulted"] / "root"
    newest = 24  # the last multiple of SAVE_EVERY
    # Lightning keeps the last.ckpt it resumed from and writes last-v1.ckpt beside it; "last" is the newest file
    lasts = sorted((root / "lightning").glob("last*.ckpt"), key=lambda p: p.stat().st_mtime)
    assert read_pointer(lasts[-1])["step"] == newest
    (named,) = (root / "lightning").glob(f"epoch=*-step={newest}.ckpt")
    assert read_pointer(named)["step"] == newest
    mgr = tg.CheckpointManager(root, read_only=True)
    infos = {i.step: i.status for i in mgr.checkpoints()}
    assert infos == {16: "valid", 20: "valid", 24: "valid"}  # keep=3 in the example
    state: dict[str, Any] = {"lightning": {}}
    mgr.restore(newest, state)
    assert state["lightning"]["global_step"] == newest
    assert set(state["lightning"]["state_dict"]) == {
        "net.0.weight",
        "net.0.bias",
        "net.3.weight",
        "net.3.bias",
    }


def test_last_resumes_from_the_newest_valid_checkpoint_when_the_newest_is_corrupt(tmp_path: Path) -> None:
    root = tmp_path / "root"
    io = TrainguardCheckpointIO(root, async_save=False)
    for step in (1, 2):
        ckpt = {
            "global_step": step,
            "epoch": 0,
            "state_dict": {"w": torch.full((4,), float(step))},
            "loops": {},
        }
        io.save_checkpoint(ckpt, root / "lightning" / "last.ckpt")
    io.teardown()
    only_2 = set(read_manifest(root, 2).chunks) - set(read_manifest(root, 1).chunks)
    chunk = root / chunk_relpath(sorted(only_2)[0])
    data = bytearray(chunk.read_bytes())
    data[len(data) // 2] ^= 0x01  # a bit flip in a chunk only step 2 references
    chunk.write_bytes(bytes(data))
    loaded = TrainguardCheckpointIO(root).load_checkpoint(root / "lightning" / "last.ckpt")
    assert loaded["global_step"] == 1
    assert torch.equal(loaded["state_dict"]["w"], torch.full((4,), 1.0))


MODEL_CHECKPOINT_KEY = "ModelCheckpoint{'monitor': None, 'mode': 'min', 'every_n_train_steps': 1}"


def lightning_ckpt(step: int, w: torch.Tensor) -> dict[str, Any]:
    """A checkpoint dict as ModelCheckpoint without ``monitor`` hands it over: kth_value/best_model_score +-inf."""
    return {
        "global_step": step,
        "epoch": 0,
        "state_dict": {"w": w},
        "optimizer_states": [{"state": {0: {"exp_avg": w.clone()}}, "param_groups": [{"lr": 0.1, "params": [0]}]}],
        "loops": {},
        "callbacks": {MODEL_CHECKPOINT_KEY: {"kth_value": torch.tensor(float("inf")),
                                             "best_model_score": torch.tensor(float("-inf")), "monitor": None}},
    }  # fmt: skip


def test_the_default_finite_check_ignores_callback_bookkeeping_and_still_rejects_nan_weights(
    tmp_path: Path,
) -> None:
    """The default path (check_finite="error", ModelCheckpoint without monitor) used to fail at the first save:
    kth_value is +inf. The check is scoped to state_dict/optimizer_states; a NaN weight is still rejected."""
    root = tmp_path / "root"
    io = TrainguardCheckpointIO(root, async_save=False)
    io.save_checkpoint(lightning_ckpt(1, torch.ones(4)), root / "lightning" / "last.ckpt")
    with pytest.raises(tg.NonFiniteStateError, match=r"lightning\.state_dict\.w") as e:
        io.save_checkpoint(
            lightning_ckpt(2, torch.tensor([1.0, float("nan"), 1.0, 1.0])), tmp_path / "b.ckpt"
        )
    assert set(e.value.tensors) == {"lightning.state_dict.w", "lightning.optimizer_states.0.state.0.exp_avg"}
    io.teardown()
    # a restore scans the same entries: the +-inf bookkeeping does not make the checkpoint suspect
    loaded = TrainguardCheckpointIO(root).load_checkpoint(root / "lightning" / "last.ckpt")
    assert loaded["global_step"] == 1
    assert loaded["callbacks"][MODEL_CHECKPOINT_KEY]["kth_value"].item() == float("inf")
    assert [(i.step, i.status) for i in tg.CheckpointManager(root, read_only=True).checkpoints()] == [
        (1, "valid")
    ]


def test_a_plain_manager_restoring_a_lightning_checkpoint_scans_what_the_save_scanned(tmp_path: Path) -> None:
    """The scope is recorded in the manifest's metadata: a plain reader (``trainguard export``, a read-only
    manager) does not mark the checkpoint suspect for the callbacks' +-inf."""
    root = tmp_path / "root"
    io = TrainguardCheckpointIO(root, async_save=False)
    io.save_checkpoint(lightning_ckpt(1, torch.ones(4)), root / "lightning" / "last.ckpt")
    io.teardown()
    assert read_manifest(root, 1).metadata["trainguard.check_finite_only"] == [
        "lightning.state_dict",
        "lightning.optimizer_states",
    ]
    state: dict[str, Any] = {"lightning": {}, "rng": {}}
    assert tg.CheckpointManager(root, read_only=True).restore_latest(state) == 1
    assert state["lightning"]["callbacks"][MODEL_CHECKPOINT_KEY]["kth_value"].item() == float("inf")
    assert [i.status for i in tg.CheckpointManager(root, read_only=True).checkpoints()] == ["valid"]


def test_check_finite_entries_none_scans_every_entry(tmp_path: Path) -> None:
    io = TrainguardCheckpointIO(tmp_path / "root", async_save=False, check_finite_entries=None)
    with pytest.raises(tg.NonFiniteStateError, match="kth_value"):
        io.save_checkpoint(lightning_ckpt(1, torch.ones(4)), tmp_path / "a.ckpt")
    io.teardown()
    with pytest.raises(tg.ConfigError, match="sequence of entry names"):
        TrainguardCheckpointIO(tmp_path / "root2", check_finite_entries="state_dict")


def test_a_plain_torch_save_checkpoint_is_refused_without_unpickling(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"

    class Armed:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (Path.touch, (marker,))

    torch.save({"state_dict": {}, "x": Armed()}, tmp_path / "epoch=0-step=1.ckpt")
    with pytest.raises(tg.ConfigError, match="not a trainguard checkpoint pointer"):
        TrainguardCheckpointIO(tmp_path / "root").load_checkpoint(tmp_path / "epoch=0-step=1.ckpt")
    assert not marker.exists()


def test_remove_checkpoint_removes_the_pointer_and_keeps_the_data(tmp_path: Path) -> None:
    root = tmp_path / "root"
    io = TrainguardCheckpointIO(root, async_save=False)
    io.save_checkpoint({"global_step": 3, "state_dict": {"w": torch.ones(2)}}, tmp_path / "a.ckpt")
    io.remove_checkpoint(tmp_path / "a.ckpt")
    io.teardown()
    assert not (tmp_path / "a.ckpt").exists()
    assert [i.step for i in tg.CheckpointManager(root, read_only=True).checkpoints()] == [3]


def test_trainguard_imports_without_lightning_and_the_plugin_names_the_extra() -> None:
    code = (
        "import sys\n"
        "for m in ('pytorch_lightning', 'lightning_fabric', 'lightning'): sys.modules[m] = None\n"
        "import trainguard as tg\n"
        "tg.CheckpointManager\n"
        "try:\n"
        "    tg.lightning\n"
        "except tg.MissingDependencyError as e:\n"
        "    print('ERR', isinstance(e, ImportError), e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=run_env(), timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert "ERR True" in out.stdout and "pip install 'trainguard[lightning]'" in out.stdout


DDP_STEPS = (
    13  # 2 ranks x 4 samples a step: 5 steps per epoch; the kill after step 7 resumes from 4, mid-epoch
)


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    d = tmp_path_factory.mktemp("lightning-ddp")
    ref, faulted = d / "reference", d / "faulted"
    ref.mkdir()
    faulted.mkdir()

    def ddp(out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, str(SCRIPT), "--root", str(out / "root"), "--steps", str(DDP_STEPS), "--save-every",
               str(SAVE_EVERY), "--losses", str(out / "losses.jsonl"), "--final", str(out / "final.pt"),
               "--devices", "2", *extra]  # fmt: skip
        env = run_env() | {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=out)

    r = ddp(ref)
    assert r.returncode == 0, r.stderr[-3000:]
    killed = ddp(faulted, "--kill-at", "7")
    final = ddp(faulted)
    assert final.returncode == 0, final.stderr[-3000:]
    return {"ref": ref, "faulted": faulted, "killed": killed.returncode}


def ddp_losses(out: Path) -> tuple[dict[tuple[int, int], str], list[tuple[int, int]]]:
    rows = [json.loads(line) for line in (out / "losses.jsonl").read_text().splitlines()]
    return {(r["step"], r["rank"]): r["loss"] for r in rows}, [(r["step"], r["rank"]) for r in rows]


@pytest.mark.distributed
@pytest.mark.slow  # 3 two-process Lightning runs (~30 s each on a loaded 2-core machine: imports dominate)
@pytest.mark.timeout(1200)  # the module fixture's 3 runs took 280 s of the default 600 under heavy load
def test_a_killed_ddp_run_resumes_bit_exactly_on_every_rank(ddp_runs: dict[str, Any]) -> None:
    assert ddp_runs["killed"] == -signal.SIGKILL
    ref, _ = ddp_losses(ddp_runs["ref"])
    got, order = ddp_losses(ddp_runs["faulted"])
    assert sorted(ref) == [(s, r) for s in range(1, DDP_STEPS + 1) for r in (0, 1)]
    assert got == ref  # both ranks: their own data shard and dropout RNG continue bit for bit
    assert any(
        ref[(s, 0)] != ref[(s, 1)] for s in range(1, DDP_STEPS + 1)
    )  # the ranks train on other samples
    rank0 = [s for s, r in order if r == 0]
    assert rank0 == [*range(1, 8), *range(5, DDP_STEPS + 1)]  # killed after 7, resumed from the save of 4
    a = torch.load(ddp_runs["ref"] / "final.pt", weights_only=True)
    b = torch.load(ddp_runs["faulted"] / "final.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(1200)  # runs the module fixture when selected alone
def test_a_ddp_checkpoint_is_one_commit_with_each_rank_s_rng_state(ddp_runs: dict[str, Any]) -> None:
    root = ddp_runs["faulted"] / "root"
    m = read_manifest(root, 12)
    assert m.world_size == 2
    state: dict[str, Any] = {"lightning": {}, "rng": {}}
    tg.CheckpointManager(root, read_only=True).restore(12, state)
    assert set(state["rng"]) == {"rank_0", "rank_1"}
    # (seed_everything seeds both ranks alike, so their RNG states may be equal; each is saved and restored)
    assert state["lightning"]["global_step"] == 12


def test_the_ddp_strategy_needs_the_trainguard_plugin(tmp_path: Path) -> None:
    from lightning_fabric.plugins import TorchCheckpointIO

    strategy = tg.lightning.TrainguardDDPStrategy(checkpoint_io=TorchCheckpointIO())
    with pytest.raises(tg.ConfigError, match="TrainguardCheckpointIO"):
        strategy.save_checkpoint({"global_step": 1}, tmp_path / "x.ckpt")
    assert not (tmp_path / "x.ckpt").exists()
