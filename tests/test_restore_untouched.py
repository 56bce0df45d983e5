"""A failed restore never leaves the caller's objects holding a corrupt checkpoint's bytes (tester finding:
chunks were read in place and their CRC32C checked after, so a CorruptCheckpointError or NoValidCheckpointError
left the weights = the corrupt checkpoint's values), and a fallback never leaves a silent mix of two
checkpoints."""

from __future__ import annotations

import pytest
import torch

import trainguard as tg
from trainguard.catalog import read_manifest


def save(root, step: int, state, **kw) -> None:
    with tg.CheckpointManager(root, async_save=False, **kw) as mgr:
        mgr.save(step, state)


def flip_every_chunk(root, step: int) -> None:
    """Flips one byte in the middle of every chunk of ``step`` (same length: only the CRC32C can tell)."""
    for rec in read_manifest(root, step).chunks.values():
        p = root / rec.path
        b = bytearray(p.read_bytes())
        b[len(b) // 2] ^= 0xFF
        p.write_bytes(bytes(b))


def test_restore_of_a_corrupt_step_leaves_the_objects_untouched(tmp_path):
    save(tmp_path, 5, {"w": {"t": torch.full((4096,), 5.0)}})
    flip_every_chunk(tmp_path, 5)
    live = torch.zeros(4096)
    with pytest.raises(tg.CorruptCheckpointError, match="not modified"):
        tg.CheckpointManager(tmp_path, read_only=True).restore(5, {"w": {"t": live}})
    assert torch.equal(live, torch.zeros(4096))  # not one byte of the corrupt checkpoint


def test_no_valid_checkpoint_leaves_the_objects_untouched_and_says_so(tmp_path):
    save(tmp_path, 5, {"w": {"t": torch.full((4096,), 5.0)}})
    flip_every_chunk(tmp_path, 5)
    live = torch.zeros(4096)
    with pytest.raises(tg.NoValidCheckpointError) as ei:
        tg.CheckpointManager(tmp_path, read_only=True).restore_latest({"w": {"t": live}})
    assert torch.equal(live, torch.zeros(4096))
    assert "were not modified" in str(ei.value)


def test_without_the_verify_pass_a_corrupt_restore_reads_once_and_says_the_objects_were_modified(tmp_path):
    """``verify_before_load=False`` (the fastest restart): no pre-check pass, and the error says the objects may
    hold the corrupt checkpoint's bytes instead of claiming they were not modified."""
    save(tmp_path, 5, {"w": {"t": torch.full((4096,), 5.0)}})
    flip_every_chunk(tmp_path, 5)
    live = torch.zeros(4096)
    mgr = tg.CheckpointManager(tmp_path, read_only=True, verify_before_load=False)
    with pytest.raises(tg.CorruptCheckpointError, match="rebuild the objects") as ei:
        mgr.restore(5, {"w": {"t": live}})
    assert ei.value.state_modified is True
    save(tmp_path, 6, {"w": {"t": torch.full((4096,), 6.0)}})
    for verify, extra in ((False, 0), (True, 4096 * 4)):
        live = torch.zeros(4096)
        mgr = tg.CheckpointManager(tmp_path, read_only=True, verify_before_load=verify)
        mgr.restore(6, {"w": {"t": live}})
        assert torch.equal(live, torch.full((4096,), 6.0))
        assert mgr.last_restore.verify_bytes == extra  # the pre-check pass reads the tensor's bytes once more


def test_fallback_from_a_corrupt_candidate_loads_the_older_one_whole(tmp_path):
    save(tmp_path, 5, {"w": {"t": torch.full((4096,), 5.0)}})
    save(tmp_path, 10, {"w": {"t": torch.full((4096,), 10.0)}})
    flip_every_chunk(tmp_path, 10)
    live = torch.zeros(4096)
    assert tg.CheckpointManager(tmp_path, read_only=True).restore_latest({"w": {"t": live}}) == 5
    assert torch.equal(live, torch.full((4096,), 5.0))


def test_a_fallback_that_cannot_overwrite_what_a_failed_candidate_loaded_is_an_error(tmp_path):
    """Step 10 holds a NaN in "b" (saved with the check off): it is loaded, found non-finite and marked suspect.
    Step 5 has no "b": with strict=False restore_latest would leave b = step 10's NaN: a silent mix."""
    save(tmp_path, 5, {"w": {"a": torch.full((8,), 5.0)}})
    save(
        tmp_path,
        10,
        {"w": {"a": torch.full((8,), 10.0), "b": torch.full((8,), float("nan"))}},
        check_finite="off",
    )
    a, b = torch.zeros(8), torch.zeros(8)
    with tg.CheckpointManager(tmp_path) as mgr, pytest.raises(tg.StateMismatchError, match="rebuild") as ei:
        mgr.restore_latest({"w": {"a": a, "b": b}}, strict=False)
    assert "w.b" in str(ei.value) or "'b'" in str(ei.value)
    # rebuilt objects: step 10 is marked suspect, so restore_latest loads step 5 into them
    a, b = torch.zeros(8), torch.zeros(8)
    with tg.CheckpointManager(tmp_path) as mgr:
        assert mgr.restore_latest({"w": {"a": a}}) == 5
    assert torch.equal(a, torch.full((8,), 5.0))


def test_the_verify_pass_reads_each_needed_chunk_once_more(tmp_path):
    """The cost of the CRC32C pass before loading: the bytes of the chunks the state needs, once."""
    save(tmp_path, 5, {"w": {"t": torch.full((1 << 16,), 5.0)}})
    mgr = tg.CheckpointManager(tmp_path, read_only=True)
    mgr.restore(5, {"w": {"t": torch.zeros(1 << 16)}})
    chunk_bytes = sum(r.length for r in read_manifest(tmp_path, 5).chunks.values())
    assert mgr.last_restore.verify_bytes == chunk_bytes == mgr.last_restore.bytes


def test_a_suspect_restore_says_the_objects_hold_its_values(tmp_path):
    save(tmp_path, 10, {"w": {"b": torch.full((8,), float("nan"))}}, check_finite="off")
    b = torch.zeros(8)
    with (
        tg.CheckpointManager(tmp_path) as mgr,
        pytest.raises(tg.SuspectCheckpointError, match="do not train"),
    ):
        mgr.restore(10, {"w": {"b": b}})
    assert torch.isnan(b).all()  # what the message says: the values were loaded (validation runs on them)
