"""A state that cannot be saved raises the same error type, with the same fix in its message, whether the
save is synchronous or asynchronous, and leaves nothing behind."""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any

import pytest
import torch

import trainguard as tg
from trainguard.integrity.verify import verify

CASES: dict[str, tuple[Callable[[], dict[str, Any]], type[Exception], str]] = {
    "sparse": (lambda: {"w": torch.eye(3).to_sparse()}, tg.ConfigError, "to_dense()"),
    "sparse-csr": (lambda: {"w": torch.eye(3).to_sparse_csr()}, tg.ConfigError, "to_dense()"),
    "quantized": (
        lambda: {"w": torch.quantize_per_tensor(torch.ones(4), 0.1, 0, torch.qint8)},
        tg.ConfigError,
        "int_repr()",
    ),
    "nested": (
        lambda: {"w": torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])},
        tg.ConfigError,
        "unbind()",
    ),
    "meta": (lambda: {"w": torch.empty(3, device="meta")}, tg.ConfigError, "meta tensor"),
    "huge-int": (lambda: {"v": {"n": 10**5000}}, tg.ConfigError, "integer too large"),
}


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("case", list(CASES))
def test_an_unsavable_state_raises_one_error_type_in_both_save_modes(tmp_path, case, async_save):
    make, error, fix = CASES[case]
    with tg.CheckpointManager(tmp_path / "run", async_save=async_save) as mgr:
        mgr.save(1, {"ok": torch.ones(2)}).wait()
        with pytest.raises(error, match=fix.replace("(", r"\(").replace(")", r"\)")) as ei:
            mgr.save(2, make()).wait()
        assert type(ei.value).__module__ == "trainguard.errors", type(
            ei.value
        )  # not a raw torch/builtin error
        assert [(i.step, i.status) for i in mgr.checkpoints()] == [(1, "valid")]
        mgr.save(3, {"ok": torch.zeros(2)}).wait()  # the manager still works


def test_a_step_beyond_2_62_is_refused_at_save(tmp_path):
    """A manifest with a step above 2**62 is read as corrupt: save refuses it up front (nothing written)."""
    with tg.CheckpointManager(tmp_path, async_save=False) as mgr:
        with pytest.raises(tg.ConfigError, match=r"at most 2\*\*62"):
            mgr.save(10**30, {"w": torch.zeros(2)})
        mgr.save(2**62, {"w": torch.zeros(2)})  # the bound itself is a valid step
        assert [i.step for i in mgr.checkpoints()] == [2**62]
    assert tg.CheckpointManager(tmp_path, read_only=True).restore_latest({"w": torch.ones(2)}) == 2**62


BAD_STEPS = [1.0, 5.0, 10.5, -5, "5", True, None, 2**62 + 1]


@pytest.mark.parametrize("step", BAD_STEPS, ids=repr)
def test_a_bad_step_is_refused_with_a_config_error_at_every_entry(tmp_path, step):
    """A float, negative, str or bool step is a ConfigError naming the value, from save, maybe_save (with and
    without force, on and off the policy's grid) and restore: never silently skipped, never a raw TypeError."""
    state = {"w": torch.zeros(2)}
    with tg.CheckpointManager(tmp_path, save_policy=tg.EveryNSteps(5), async_save=False) as mgr:
        mgr.save(5, state)
        calls = {
            "save": lambda: mgr.save(step, state),
            "maybe_save": lambda: mgr.maybe_save(step, state),
            "maybe_save force": lambda: mgr.maybe_save(step, state, force=True),
            "restore": lambda: mgr.restore(step, state),
        }
        for name, call in calls.items():
            with pytest.raises(tg.ConfigError, match="step must be") as ei:
                call()
            assert repr(step) in str(ei.value) or str(step) in str(ei.value), name
        assert [i.step for i in mgr.checkpoints()] == [5]  # nothing was saved
    if step is not None:  # dcp_reader's None means the newest valid step
        with pytest.raises(tg.ConfigError, match="step must be"):
            tg.dcp_reader(tmp_path, step)


def test_a_numpy_integer_step_is_accepted_as_an_int(tmp_path):
    np = pytest.importorskip("numpy")
    with tg.CheckpointManager(tmp_path, save_policy=tg.EveryNSteps(5), async_save=False) as mgr:
        assert mgr.maybe_save(np.int64(5), {"w": torch.ones(2)}) is not None
        mgr.save(np.int32(6), {"w": torch.ones(2)})
        assert [i.step for i in mgr.checkpoints()] == [5, 6]
        w = torch.zeros(2)
        assert mgr.restore(np.int64(6), {"w": w}) == 6 and type(mgr.restore(np.int64(6), {"w": w})) is int
        assert torch.equal(w, torch.ones(2))


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_negative_and_large_int_keys_round_trip(tmp_path, async_save):
    """A dict keyed by negative or large ints (up to the signed 64-bit bounds) saves and restores exactly.

    Before, a manifest path refused int keys outside ``[0, 2**40]``, so such a checkpoint saved fine and then
    was read as corrupt, every time."""
    keys = [-1, -(2**63), 2**40 + 1, 2**63 - 1, 0]
    state = {"m": {k: torch.full((3,), float(i)) for i, k in enumerate(keys)}}
    with tg.CheckpointManager(tmp_path, async_save=async_save) as mgr:
        mgr.save(1, state).wait()
    assert verify(tmp_path).ok
    live = {"m": {k: torch.zeros(3) for k in reversed(keys)}}  # matched by key, not by position
    assert tg.CheckpointManager(tmp_path, read_only=True).restore_latest(live) == 1
    assert sorted(live["m"]) == sorted(keys)
    for i, k in enumerate(keys):
        assert torch.equal(live["m"][k], torch.full((3,), float(i))), k


class Phase(str, enum.Enum):
    TRAIN = "train"
    EVAL = "eval"


class Level(int, enum.Enum):
    LOW = 1
    HIGH = 2


class Tag(str):
    def __str__(self) -> str:
        return f"Tag<{str.__str__(self)}>"


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_enum_and_str_subclass_keys_round_trip_also_from_an_older_save(tmp_path, async_save):
    """Keys that are ``(str, Enum)``, ``(int, Enum)`` members or a str subclass with its own ``__str__``: a
    manifest path stores their value (as JSON writes it) and the entry's name shows that value, so a restore
    into the live objects (Enum keys) and into an empty dict (plain keys) both take every tensor.

    Before, names used ``str(key)`` ("stats.Phase.TRAIN") while paths held "train": a check that a name matches
    its path then read every such checkpoint as corrupt. A checkpoint saved with those older names (rewritten
    here) still restores: a manifest entry is named by its path."""
    import json

    import crc32c

    from trainguard.format.manifest import _canonical

    def make(v: float) -> dict[str, Any]:
        return {
            "stats": {Phase.TRAIN: torch.full((2,), v), Phase.EVAL: torch.full((3,), v + 1)},
            "levels": {Level.LOW: torch.full((2,), v + 2), Level.HIGH: torch.full((2,), v + 3)},
            "tags": {Tag("a"): torch.full((4,), v + 4)},
        }

    with tg.CheckpointManager(tmp_path, async_save=async_save) as mgr:
        mgr.save(1, make(1.0)).wait()
        mgr.save(2, make(10.0)).wait()
    # step 1 as an older save wrote it: names from str(key)
    mpath = next(tmp_path.glob("step*1/manifest.json"))
    body = json.loads(mpath.read_bytes())
    old = {"stats.train": "stats.Phase.TRAIN", "stats.eval": "stats.Phase.EVAL", "tags.a": "tags.Tag<a>"}
    assert set(old) <= set(body["entries"]), sorted(body["entries"])
    for new_name, old_name in old.items():
        body["entries"][old_name] = body["entries"].pop(new_name)
    body.pop("crc32c")
    body["crc32c"] = crc32c.crc32c(_canonical(body))
    mpath.write_bytes(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    assert verify(tmp_path).ok
    for step, v in ((1, 1.0), (2, 10.0)):
        live = make(-1.0)
        assert tg.CheckpointManager(tmp_path, read_only=True).restore(step, live) == step
        for key, t in make(v).items():
            for k, x in t.items():
                assert torch.equal(live[key][k], x), (step, key, k)
        empty: dict[str, Any] = {"stats": {}, "levels": {}, "tags": {}}
        tg.CheckpointManager(tmp_path, read_only=True).restore(step, empty)
        assert torch.equal(empty["stats"]["train"], torch.full((2,), v)) and empty["levels"][2][0] == v + 3
        assert torch.equal(empty["tags"]["a"], torch.full((4,), v + 4))


class Role(str, enum.Enum):
    GEN = "gen"
    DISC = "disc"


def _two_optimizers(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    out = {}
    for role in Role:
        m = torch.nn.Linear(2, 2)
        o = torch.optim.Adam(m.parameters())
        m(torch.ones(1, 2)).sum().backward()
        o.step()
        out[role] = o.state_dict()
    return out


@pytest.mark.parametrize("older", [False, True], ids=["this-save", "older-save"])
def test_optimizer_state_under_enum_keys_restores_strictly(tmp_path, older):
    """``{"opts": {Role.GEN: optimizer.state_dict(), ...}}``: the optimizer sections were recorded as
    "Role.GEN" while the entries are named opts.gen..., so every strict restore reported the optimizer state
    missing. Sections are named as entries are now; a record written before (rewritten here) is matched
    through the live object's sections."""
    import json

    import crc32c

    from trainguard.format.manifest import _canonical

    saved = _two_optimizers(0)
    with tg.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"opts": saved})
    mpath = next(tmp_path.glob("step*1/manifest.json"))
    body = json.loads(mpath.read_bytes())
    record = body["top_level"]["opts"]["optimizer_state"]
    assert sorted(record) == ["disc", "gen"], record
    assert body["top_level"]["opts"]["optimizer_state_names"] == "value"
    if older:  # as a save before 2026-12-04 wrote it: sections named str(key), no optimizer_state_names
        body["top_level"]["opts"]["optimizer_state"] = {f"Role.{k.upper()}": v for k, v in record.items()}
        del body["top_level"]["opts"]["optimizer_state_names"]
        body.pop("crc32c")
        body["crc32c"] = crc32c.crc32c(_canonical(body))
        mpath.write_bytes(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    live = {"opts": _two_optimizers(1)}
    assert tg.CheckpointManager(tmp_path, read_only=True).restore(1, live) == 1
    for role in Role:
        assert torch.equal(live["opts"][role]["state"][0]["exp_avg"], saved[role]["state"][0]["exp_avg"])
    empty: dict[str, Any] = {"opts": {}}
    tg.CheckpointManager(tmp_path, read_only=True).restore(1, empty)
    assert torch.equal(empty["opts"]["gen"]["state"][0]["exp_avg"], saved[Role.GEN]["state"][0]["exp_avg"])


@pytest.mark.parametrize("key", ["", "g"])
def test_optimizer_state_under_an_empty_string_key_restores_strictly(tmp_path, key):
    """``{"x": {"": adam.state_dict(), "w": t}}``: its section is named "" like the entry itself, and the check
    looked for x.state.0.exp_avg where the entries are x..state.0.exp_avg (reported missing)."""
    saved = _two_optimizers(0)[Role.GEN]
    with tg.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"x": {key: saved, "w": torch.ones(1)}})
    live = {"x": {key: _two_optimizers(1)[Role.GEN], "w": torch.zeros(1)}}
    assert tg.CheckpointManager(tmp_path, read_only=True).restore(1, live) == 1
    assert torch.equal(live["x"][key]["state"][0]["exp_avg"], saved["state"][0]["exp_avg"])


def test_optimizer_state_removed_from_a_manifest_is_reported_into_an_empty_dict_too(tmp_path):
    """Every entry of an optimizer section removed from a (re-signed) manifest: a strict restore into an empty
    dict reports the recorded state missing; only a record written before sections were named as entries are
    leaves such a section out (it cannot tell an Enum-named section from a removed one)."""
    import json

    import crc32c

    from trainguard.format.manifest import _canonical

    saved = _two_optimizers(0)
    with tg.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, {"plain": {"gen": saved[Role.GEN], "w": torch.ones(1)}})
    mpath = next(tmp_path.glob("step*1/manifest.json"))
    body = json.loads(mpath.read_bytes())
    for name in [n for n in body["entries"] if n.startswith("plain.gen")]:
        del body["entries"][name]
    body.pop("crc32c")
    body["crc32c"] = crc32c.crc32c(_canonical(body))
    mpath.write_bytes(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    with pytest.raises(tg.StateMismatchError, match="optimizer state recorded at save time but not restored"):
        tg.CheckpointManager(tmp_path, read_only=True).restore(1, {"plain": {}})


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    "key", [2**63, -(2**63) - 1, 10**30, 10**5000], ids=["2**63", "-2**63-1", "1e30", "1e5000"]
)
def test_an_int_key_beyond_64_bits_is_refused_at_save(tmp_path, key, async_save):
    """A ConfigError in both modes, also for a key too long to print (Python refuses str() beyond 4,300
    digits: the message gives its size instead)."""
    with tg.CheckpointManager(tmp_path, async_save=async_save) as mgr:
        mgr.save(1, {"w": torch.zeros(2)}).wait()
        with pytest.raises(tg.ConfigError, match="signed 64-bit range"):
            mgr.save(2, {"m": {key: torch.ones(2)}}).wait()
        assert [i.step for i in mgr.checkpoints()] == [1]
