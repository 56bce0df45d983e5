"""check_finite in the persist path, the non-finite scan after load, the probe fingerprint and suspect status
(issue 11)."""

from __future__ import annotations

import json

import pytest
import torch

import trainguard as tg
from trainguard.recovery.events import read_events
from trainguard.validation.faults import corrupt_silently
from trainguard.validation.probe import compare, compute, decode, encode


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _probe_of(model: torch.nn.Module):
    batch = torch.linspace(-1, 1, 24).reshape(3, 8)

    def probe() -> torch.Tensor:
        was = model.training
        model.eval()
        with torch.no_grad():
            out = model(batch)
        model.train(was)
        return out

    return probe


def _train_steps(model: torch.nn.Module, mgr: tg.CheckpointManager, steps, state) -> None:
    for step in steps:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * step)
        mgr.maybe_save(step, state, metrics={"loss": 1.0 / step})


@pytest.mark.parametrize("async_save", [True, False])
def test_nan_at_step_3_is_rejected_and_restore_returns_2(tmp_path, async_save):
    model = _model()
    state = {"model": model}
    mgr = tg.CheckpointManager(tmp_path, save_policy=tg.EveryNSteps(1), keep=2, async_save=async_save)
    _train_steps(model, mgr, (1, 2), state)
    mgr.wait()
    with torch.no_grad():
        model[0].weight[1, 2] = float("nan")
        model[2].bias[0] = float("inf")
    with pytest.raises(tg.NonFiniteStateError) as ei:
        mgr.maybe_save(3, state)
        mgr.wait()  # async: surfaces here
    err = ei.value
    assert isinstance(err, tg.SaveError)
    assert err.step == 3
    assert err.tensors == {"model.0.weight": 1, "model.2.bias": 1}
    assert "model.0.weight (1 non-finite value)" in str(err)
    mgr.close()
    infos = {i.step: i.status for i in tg.CheckpointManager(tmp_path, read_only=True).checkpoints()}
    assert infos == {1: "valid", 2: "valid"}  # nothing committed for 3, retention did not drop 1
    rejected = list(read_events(tmp_path, event="save_rejected"))
    assert [e["step"] for e in rejected] == [3]
    assert rejected[0]["tensors"] == {"model.0.weight": 1, "model.2.bias": 1}
    fresh = {"model": _model(1)}
    assert tg.CheckpointManager(tmp_path, read_only=True).restore_latest(fresh) == 2


def test_check_finite_warn_saves_and_off_skips_the_scan(tmp_path):
    model = _model()
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    with tg.CheckpointManager(tmp_path / "w", check_finite="warn") as mgr:
        mgr.save(1, {"model": model}).wait()
    assert [e["step"] for e in read_events(tmp_path / "w", event="save_nonfinite")] == [1]
    with tg.CheckpointManager(tmp_path / "o", check_finite="off") as mgr:
        mgr.save(1, {"model": model}).wait()
    assert not list(read_events(tmp_path / "o", event="save_nonfinite"))
    with pytest.raises(tg.ConfigError, match="check_finite"):
        tg.CheckpointManager(tmp_path / "x", check_finite="maybe")


def test_nonfinite_checkpoint_written_without_the_check_is_suspect_after_load(tmp_path):
    good, bad = _model(), _model()
    with tg.CheckpointManager(tmp_path, check_finite="off", save_policy=tg.EveryNSteps(1)) as mgr:
        mgr.save(1, {"model": good}).wait()
        with torch.no_grad():
            bad[2].weight[0, 0] = float("nan")
        mgr.save(2, {"model": bad}).wait()
    target = {"model": _model(5)}
    mgr = tg.CheckpointManager(tmp_path)
    assert mgr.restore_latest(target) == 1  # step 2 fell back within the same call
    assert torch.equal(target["model"][2].weight, good[2].weight)
    assert mgr.last_restore.skipped[0]["step"] == 2
    info = {i.step: i for i in mgr.checkpoints()}
    assert info[2].status == "suspect"
    assert "model.2.weight" in info[2].reason
    assert info[1].reason is None
    with pytest.raises(tg.SuspectCheckpointError):  # an explicit restore refuses it too
        mgr.restore(2, {"model": _model(5)})
    mgr.close()


def test_probe_catches_silent_corruption_with_a_valid_crc(tmp_path):
    model = _model()
    probe = _probe_of(model)
    state = {"model": model}
    mgr = tg.CheckpointManager(tmp_path, save_policy=tg.EveryNSteps(1), probe=probe)
    _train_steps(model, mgr, (1, 2, 3), state)
    mgr.close()
    saved = [e for e in read_events(tmp_path, event="save")]
    assert all(e["probe_s"] >= 0 for e in saved) and len(saved) == 3
    fqn, chunk = corrupt_silently(tmp_path, 3)
    assert fqn.startswith("model.")
    # every byte-level check still passes: the CRC was rewritten with the bytes
    report = tg.CheckpointManager(tmp_path, read_only=True)
    from trainguard.integrity.verify import verify

    assert verify(tmp_path, [3], record=False).ok
    assert {i.step: i.status for i in report.checkpoints()}[3] == "valid"
    # without a probe the damage goes through (documented)
    no_probe = {"model": _model(7)}
    assert tg.CheckpointManager(tmp_path, read_only=True).restore_latest(no_probe) == 3
    # with the probe: step 3 is suspect, the restore falls back to 2 in the same call
    target_model = _model(9)
    mgr = tg.CheckpointManager(tmp_path, probe=_probe_of(target_model))
    assert mgr.restore_latest({"model": target_model}) == 2
    assert mgr.last_restore.validate_s > 0
    info = {i.step: i for i in mgr.checkpoints()}
    assert info[3].status == "suspect" and "probe output" in info[3].reason
    assert mgr.latest_step() == 2
    # the restored state is step 2's (its probe matched)
    stored = decode((tmp_path / "step-000000002" / "probe.json").read_bytes())
    assert compare(stored, compute(_probe_of(target_model))) is None
    restore_ev = list(read_events(tmp_path, event="restore"))[-1]
    assert restore_ev["step"] == 2 and restore_ev["validate_s"] > 0
    # a suspect checkpoint is never tried again: the next launch goes straight to 2
    mgr.close()
    mgr = tg.CheckpointManager(tmp_path, probe=_probe_of(target_model))
    assert mgr.restore_latest({"model": target_model}) == 2
    assert [s["step"] for s in mgr.last_restore.skipped] == [3]
    assert "suspect" in mgr.last_restore.skipped[0]["problem"]
    mgr.close()


def test_probe_tolerances_and_record_round_trip():
    a = {"logits": torch.tensor([[1.0, 2.0]]), "ids": torch.tensor([1, 2])}
    rec = encode(a)
    back = decode(rec)
    assert compare(back, a) is None
    near = {"logits": torch.tensor([[1.0, 2.0 + 1e-6]]), "ids": torch.tensor([1, 2])}
    assert "differs bitwise" in compare(back, near)
    assert compare(back, near, rtol=1e-5, atol=0) is None
    damaged = json.loads(rec)
    damaged["tensors"]["logits"]["shape"] = [2, 1]
    from trainguard.validation.probe import ProbeRecordError

    with pytest.raises(ProbeRecordError, match="CRC32C"):
        decode(json.dumps(damaged).encode())
    with pytest.raises(tg.ConfigError, match="probe"):
        compute(lambda: [1, 2])


def test_checkpoint_list_when_every_candidate_is_suspect(tmp_path):
    model = _model()
    with tg.CheckpointManager(tmp_path, save_policy=tg.EveryNSteps(1)) as mgr:
        _train_steps(model, mgr, (1, 2), {"model": model})
    from trainguard.validation.suspect import mark_suspect

    assert mark_suspect(tmp_path, 1, "operator says so") and mark_suspect(tmp_path, 2, "and this one")
    with pytest.raises(tg.NoValidCheckpointError, match="--clear"):
        tg.CheckpointManager(tmp_path, read_only=True).restore_latest({"model": _model()})


def test_markers_and_probe_records_are_bound_to_their_manifest(tmp_path):
    """A save replacing a suspect step and killed between its side files and the manifest (or after the manifest
    before removing the old marker) never pairs one checkpoint's records with another's manifest."""
    model = _model()
    probe = _probe_of(model)
    state = {"model": model}
    with tg.CheckpointManager(tmp_path, save_policy=tg.EveryNSteps(1), probe=probe) as mgr:
        _train_steps(model, mgr, (1, 2), state)
    from trainguard.validation.suspect import mark_suspect

    d = tmp_path / "step-000000002"
    assert mark_suspect(tmp_path, 2, "bad content")
    old_marker, old_probe = (d / "suspect.json").read_bytes(), (d / "probe.json").read_bytes()
    with tg.CheckpointManager(tmp_path, probe=probe) as mgr:
        assert mgr.restore_latest(state) == 1  # resumes the run; 2 is suspect
        with torch.no_grad():
            model[0].weight.add_(1.0)
        mgr.save(2, state, overwrite=True).wait()  # replaces the suspect checkpoint of step 2
    assert not (d / "suspect.json").exists()
    (d / "suspect.json").write_bytes(old_marker)  # as if killed right after the manifest was replaced
    assert {i.step: i.status for i in tg.CheckpointManager(tmp_path, read_only=True).checkpoints()}[
        2
    ] == "valid"
    (d / "probe.json").write_bytes(old_probe)  # the old checkpoint's probe next to the new manifest
    target = _model(3)
    mgr = tg.CheckpointManager(tmp_path, probe=_probe_of(target))
    assert mgr.restore_latest({"model": target}) == 2  # the stale record neither vouches nor condemns
    mgr.close()


def test_count_nonfinite_is_exact_across_blocks_and_dtypes():
    from trainguard.validation.finite import BLOCK_ELEMS, count_nonfinite, scan

    t = torch.zeros(BLOCK_ELEMS + 10)
    t[5], t[BLOCK_ELEMS + 3], t[BLOCK_ELEMS + 4] = float("nan"), float("inf"), float("-inf")
    assert count_nonfinite(t) == 3
    big = torch.full((1000,), 6e4, dtype=torch.float16)  # its sum overflows: still no false positive
    assert count_nonfinite(big) == 0
    bf = torch.ones(10, dtype=torch.bfloat16)
    bf[2] = float("nan")
    assert scan({"a": bf, "b": torch.arange(5), "c": "text"}) == {"a": 1}


def test_infinite_bookkeeping_values_are_not_tensors_and_pass_the_check(tmp_path):
    """The HF Trainer's state (``TrainguardTrainer``): TrainerState is JSON text (``best_metric`` may be
    +-inf) and a scheduler's ``best`` (ReduceLROnPlateau) a Python float; only floating *tensors* are scanned, so
    neither rejects a save nor makes the checkpoint suspect. Only tensors are training state here."""
    state = {
        "model": {"w": torch.ones(2)},
        "trainer": {
            "scheduler": {"best": float("inf"), "mode": "min"},
            "trainer_state": json.dumps({"best_metric": float("-inf")}),
        },
    }
    with tg.CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, state)
    out: dict = {"model": {}, "trainer": {}}
    assert tg.CheckpointManager(tmp_path, read_only=True).restore_latest(out) == 1
    assert out["trainer"]["scheduler"]["best"] == float("inf")


def test_check_finite_only_scopes_the_scan_to_entries():
    from trainguard.validation.finite import in_scope, scan

    flat = {"lightning.state_dict.w": torch.ones(2), "lightning.callbacks.k": torch.tensor(float("inf"))}
    assert scan(flat) == {"lightning.callbacks.k": 1}
    assert scan(flat, ("lightning.state_dict",)) == {}
    assert in_scope("a.b", ("a",)) and in_scope("a", ("a",)) and not in_scope("ab.c", ("a",))


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.complex64, torch.complex128]
)
@pytest.mark.filterwarnings("error")  # an overflowing sum must not warn the user
def test_the_numpy_fast_path_finds_a_single_bad_value_in_any_block_and_never_flags_finite_extremes(dtype):
    """``all_finite_cpu`` (the scan's fast path, no torch worker threads) against the exact torch count: a
    NaN/+Inf/-Inf anywhere (first element, a later block, the last element) is found; the largest finite
    values of the dtype and sums that overflow are not reported; views and non-contiguous tensors work.
    ``count_nonfinite_buffer`` (a restore's per-block scan of the raw bytes) agrees with it on each case."""
    from trainguard.validation.finite import (
        BLOCK_ELEMS,
        HALF_BLOCK_ELEMS,
        all_finite_cpu,
        count_nonfinite,
        count_nonfinite_buffer,
    )

    def in_bytes(x: torch.Tensor) -> int:
        return count_nonfinite_buffer(memoryview(x.contiguous().view(torch.uint8).numpy()), x.dtype)

    n = (HALF_BLOCK_ELEMS if dtype in (torch.bfloat16, torch.float16) else BLOCK_ELEMS) * 2 + 7
    real = (
        torch.float32 if dtype == torch.complex64 else torch.float64 if dtype == torch.complex128 else dtype
    )
    top = torch.finfo(real).max
    t = torch.full((n,), top, dtype=dtype)  # every element finite, every sum overflows
    if dtype in (torch.bfloat16, torch.float16):
        assert all_finite_cpu(t)  # the exponent test is exact: no fall-back to the exact count
    assert count_nonfinite(t) == 0 and in_bytes(t) == 0
    assert count_nonfinite(-t) == 0  # the negative view (is_neg) goes to the exact count
    assert all_finite_cpu(torch.zeros(n, dtype=dtype))
    for where in (0, n // 2 + 1, n - 1):
        for bad in (float("nan"), float("inf"), float("-inf")):
            u = torch.zeros(n, dtype=dtype)
            u[where] = complex(0, bad) if dtype.is_complex else bad
            assert not all_finite_cpu(u), (where, bad)
            assert count_nonfinite(u) == 1 and in_bytes(u) == 1, (where, bad)
            assert in_bytes(u[where : where + 1]) == 1 and in_bytes(u[:where]) == 0, (where, bad)
    m = torch.zeros(64, 64, dtype=dtype)
    m[3, 60] = float("nan")
    assert count_nonfinite(m.t()) == 1 and count_nonfinite(m[:, :8]) == 0  # non-contiguous: copied, scanned
    one = m.t()[60, 3:4]  # one element, contiguous, stride 64: the fast path gives it stride 1 first
    assert one.stride() == (64,) and one.is_contiguous()
    assert count_nonfinite(one) == 1 and count_nonfinite(m.t()[60, 4:5]) == 0


def test_a_probe_of_one_column_of_a_batch_of_one_is_recorded_and_compared():
    """``logits[:, 0]`` of a batch of 1 is a one-element tensor with stride (vocab,): its bytes are taken."""
    logits = torch.linspace(-1, 1, 12).reshape(1, 12)
    out = compute(lambda: logits[:, 5])
    back = decode(encode(out))
    assert compare(back, compute(lambda: logits[:, 5])) is None
    assert "differs bitwise" in compare(back, compute(lambda: logits[:, 6]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_16_bit_fast_path_agrees_with_torch_on_every_one_of_the_65536_bit_patterns(dtype):
    """The max-based exponent test of bfloat16/float16 (a signed and an unsigned maximum per block) against
    ``torch.isfinite`` for each bit pattern alone, NaN payloads and signs included, and for all of them at
    once (the count)."""
    from trainguard.validation.finite import all_finite_cpu, count_nonfinite, count_nonfinite_buffer

    patterns = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = torch.isfinite(patterns.float())
    assert count_nonfinite(patterns) == int((~finite).sum()) > 0
    background = torch.zeros(1000, dtype=dtype)
    wrong = []
    for i in range(patterns.numel()):
        background[517] = patterns[i]
        if all_finite_cpu(background) != bool(finite[i]):
            wrong.append(hex(i - (1 << 15) & 0xFFFF))
        background[517] = 0
    assert not wrong, wrong[:10]
    raw = memoryview(patterns.view(torch.uint8).numpy())
    assert count_nonfinite_buffer(raw, dtype) == int((~finite).sum())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64])
def test_the_32_and_64_bit_fast_path_never_flags_finite_extremes_and_finds_every_nan_and_inf(dtype):
    """max/min per block: the largest and smallest finite values and denormals pass (exact: no fall-back to
    the exact count for a sum that overflows); NaN with any payload and either sign, +Inf and -Inf fail."""
    import numpy as np

    from trainguard.validation.finite import SCAN_BLOCK_BYTES, all_finite_cpu

    real = torch.float32 if dtype == torch.complex64 else dtype
    fi = torch.finfo(real)
    n = 3 * SCAN_BLOCK_BYTES // torch.empty(0, dtype=dtype).element_size() + 5
    extremes = torch.tensor(
        [fi.max, -fi.max, fi.tiny, -fi.tiny, fi.smallest_normal / 4, 0.0, -0.0], dtype=real
    )
    t = extremes.repeat(n // 7 + 1)[:n].to(dtype)
    assert all_finite_cpu(t)
    ints = np.uint32 if real == torch.float32 else np.uint64
    bits = 32 if real == torch.float32 else 64
    exp_all_ones = {32: 0x7F800000, 64: 0x7FF0000000000000}[bits]
    nans = [
        exp_all_ones | 1,
        exp_all_ones | (1 << (bits - 10)),
        exp_all_ones | ((1 << 23) - 1 if bits == 32 else (1 << 52) - 1),
    ]
    specials = [*nans, *[x | (1 << (bits - 1)) for x in nans], exp_all_ones, exp_all_ones | (1 << (bits - 1))]
    for where in (0, n // 2, n - 1):
        for pattern in specials:
            u = t.clone()
            flat = u.view(real) if not dtype.is_complex else torch.view_as_real(u).reshape(-1)
            k = where if not dtype.is_complex else 2 * where + 1  # the imaginary part of a complex value
            flat.numpy().view(ints)[k] = pattern
            assert not all_finite_cpu(u), (where, hex(pattern))
