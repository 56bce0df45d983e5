"""Coordinated commit under torchrun: a save that fails on one rank publishes nothing and fails on every rank
with that rank named; the next save succeeds; an asynchronous commit never holds up training collectives."""

from __future__ import annotations

from typing import Any

import pytest

from trainguard.catalog import scan
from trainguard.format import MANIFEST_NAME, step_dir_name
from trainguard.integrity.verify import verify

from .launch import run_workers

pytestmark = pytest.mark.distributed

# mode -> the rank that fails: rank 1's chunk writes (async or sync saves), or rank 0's manifest publish
MODES = {"async": 1, "sync": 1, "commit": 0}


@pytest.fixture(scope="module")
def failed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two ranks; one save fails per mode: rank 1's chunk writes (async, then sync saves), then rank 0's
    manifest publish; each followed by a save that must succeed."""
    d = tmp_path_factory.mktemp("fail")
    return {"root": d / "root", "ranks": run_workers(2, "fail", d, root=str(d / "root"))}


@pytest.mark.parametrize("mode", MODES)
def test_a_save_failing_on_one_rank_raises_save_error_naming_that_rank_on_every_rank(failed, mode):
    ranks, bad = failed["ranks"], MODES[mode]
    assert ranks[bad][mode]["injected"] >= 1, "the injected fault never fired"
    assert ranks[1 - bad][mode]["injected"] == 0
    failed_step = ranks[0][mode]["steps"][1]
    for res in ranks:
        err = res[mode]["error"]
        assert err is not None, f"rank {res['rank']}: the failed save did not raise"
        assert err["is_save_error"], err
        assert list(err["rank_errors"]) == [str(bad)]
        assert "injected write failure" in err["rank_errors"][str(bad)]
        assert f"rank {bad}" in err["message"] and err["step"] == failed_step
        if mode != "sync":  # save() returned a handle; the failure surfaced on wait()
            assert res[mode]["returned"] is True


@pytest.mark.parametrize("mode", MODES)
def test_a_failed_distributed_save_publishes_nothing_and_earlier_checkpoints_stay_valid(failed, mode):
    r0 = failed["ranks"][0][mode]
    ok_step, failed_step, _ = r0["steps"]
    assert r0["failed_step_dir"] is False
    assert not (failed["root"] / step_dir_name(failed_step) / MANIFEST_NAME).exists()
    assert r0["verify_after_failure"]["ok"] and ok_step in r0["verify_after_failure"]["checked"]
    assert failed_step not in r0["verify_after_failure"]["checked"]


@pytest.mark.parametrize("mode", MODES)
def test_the_save_after_a_failed_one_succeeds_on_every_rank(failed, mode):
    next_step = failed["ranks"][0][mode]["steps"][2]
    assert [r[mode]["next"] for r in failed["ranks"]] == [next_step, next_step]
    after = failed["ranks"][0][mode]["verify_after_next"]
    assert after["ok"] and next_step in after["checked"]


def test_only_the_successful_saves_are_listed_and_every_one_verifies(failed):
    infos = scan(failed["root"])
    assert [(i.step, i.status) for i in infos] == [(s, "valid") for s in (1, 3, 4, 6, 7, 9, 10)]
    report = verify(failed["root"])
    assert report.ok and report.checked == [1, 3, 4, 6, 7, 9, 10]


def test_a_background_commit_waiting_on_rank_1_does_not_block_training_collectives(failed):
    for res in failed["ranks"]:
        o = res["overlap"]
        # three FSDP training steps and an all_reduce ran while rank 1's chunk writes were held back
        assert o["done_while_training"] is False and o["all_reduce"] == 2.0
        assert o["committed"] == 10
    assert failed["ranks"][1]["overlap"]["gated_writes"] >= 1
