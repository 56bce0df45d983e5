"""The time-to-resume join on synthetic supervisor facts and manager events."""

from __future__ import annotations

import json

import pytest

from trainguard.recovery.events import EventLog
from trainguard.recovery.heartbeat import Heartbeat
from trainguard.recovery.ttr import (
    HEARTBEAT_FALLBACK_DELAY_S,
    PHASES,
    EventTail,
    PendingRecovery,
    compute_recovery,
)

T0 = 1_700_000_000.0


def manager_events(restored: int | None = 40) -> dict[str, dict]:
    return {
        "manager_start": {"event": "manager_start", "t": T0 + 3.0, "restart_count": 1},
        "restore": {
            "event": "restore",
            "t": T0 + 4.0,
            "restart_count": 1,
            "step": restored,
            "scan_s": 0.1,
            "load_s": 0.6,
            "validate_s": 0.2,
        },
        "first_step": {"event": "first_step", "t": T0 + 4.5, "restart_count": 1, "step": 41},
    }


def supervisor_facts(**overrides) -> dict:
    facts = dict(
        restart_count=1,
        t_death=T0,
        detect_s=0.01,
        teardown_s=0.05,
        backoff_s=1.0,
        last_step=50,
        t_spawn=T0 + 1.1,
    )
    facts.update(overrides)
    return facts


def test_every_phase_is_joined_and_ttr_covers_their_sum():
    rec = compute_recovery(**supervisor_facts(), **manager_events())
    assert rec.phases == pytest.approx(
        {
            "detection_s": 0.01,
            "teardown_s": 0.05,
            "backoff_s": 1.0,
            "relaunch_s": 1.9,
            "identification_s": 0.1,
            "load_s": 0.6,
            "validation_s": 0.2,
            "first_step_s": 0.5,
        }
    )
    assert rec.ttr_s == pytest.approx(4.5) and rec.ttr_s >= sum(rec.phases.values())
    assert (rec.restored_step, rec.steps_lost, rec.complete, rec.first_step_source) == (
        40,
        10,
        True,
        "manager",
    )
    assert list(rec.phases) == list(PHASES)
    assert json.loads(json.dumps(rec.to_dict()))["phases"]["load_s"] == 0.6


def test_a_restore_that_found_no_checkpoint_loses_every_step():
    rec = compute_recovery(**supervisor_facts(), **manager_events(restored=None))
    assert (rec.restored_step, rec.steps_lost) == (0, 50)


def test_steps_lost_is_never_negative_when_the_heartbeat_lagged_the_save():
    rec = compute_recovery(**supervisor_facts(last_step=39), **manager_events(restored=40))
    assert rec.steps_lost == 0


def test_without_manager_events_the_first_heartbeat_stands_for_the_first_step():
    beat = Heartbeat(step=41, t=T0 + 6.0, pid=1, first_step=41, first_t=T0 + 2.5, slot=0)
    rec = compute_recovery(
        **supervisor_facts(), manager_start=None, restore=None, first_step=None, first_beat=beat
    )
    assert rec.ttr_s == pytest.approx(2.5) and rec.first_step_source == "heartbeat"
    assert rec.restored_step is None and rec.steps_lost is None
    assert [p for p in PHASES if rec.phases[p] is None] == list(PHASES[3:])


def test_without_any_first_step_the_recovery_is_incomplete():
    rec = compute_recovery(**supervisor_facts(), manager_start=None, restore=None, first_step=None)
    assert rec.ttr_s is None and not rec.complete
    assert "unknown" in rec.describe()


def test_the_one_line_description_lists_ttr_phases_and_steps_lost():
    line = compute_recovery(**supervisor_facts(), **manager_events()).describe()
    assert line.startswith("recovery 1: ttr 4.50 s = detection 0.01 + teardown 0.05 + backoff 1.00")
    assert "load 0.60" in line and "restored step 40, steps lost 10" in line


def test_a_pending_recovery_keeps_only_rank_zero_records_of_its_own_attempt():
    pending = PendingRecovery(**{k: v for k, v in supervisor_facts().items() if k != "t_spawn"})
    pending.offer({"event": "first_step", "t": T0 + 9, "restart_count": 2})  # a later attempt
    pending.offer({"event": "first_step", "t": T0 + 8, "restart_count": 1, "rank": 3})  # another rank
    pending.offer({"event": "save", "t": T0 + 7, "restart_count": 1})  # not a TTR event
    assert pending.records == {} and not pending.ready(T0 + 100)
    pending.offer({"event": "first_step", "t": T0 + 5, "restart_count": 1, "rank": 0})
    pending.offer({"event": "first_step", "t": T0 + 6, "restart_count": 1})  # only the first one counts
    assert pending.ready(T0 + 5) and pending.records["first_step"]["t"] == T0 + 5


def test_a_pending_recovery_waits_for_the_manager_once_it_has_started():
    pending = PendingRecovery(**{k: v for k, v in supervisor_facts().items() if k != "t_spawn"})
    beat = Heartbeat(step=41, t=T0 + 3, pid=1, first_step=41, first_t=T0 + 3, slot=0)
    pending.offer_heartbeats([beat])
    assert not pending.ready(T0 + 3 + HEARTBEAT_FALLBACK_DELAY_S / 2)
    assert pending.ready(T0 + 3 + HEARTBEAT_FALLBACK_DELAY_S)  # no manager: the heartbeat decides
    pending.offer({"event": "manager_start", "t": T0 + 2, "restart_count": 1})
    assert not pending.ready(T0 + 100)  # a manager exists: wait for its first_step event
    rec = pending.finish()
    assert pending.done and rec.first_step_source == "heartbeat"


def test_the_event_tail_reads_only_new_complete_lines_of_its_own_run(tmp_path):
    old = EventLog(tmp_path, "manager")
    old.write("restore", run_id="earlier-run", restart_count=1)
    tail = EventTail(tmp_path, "this-run")
    old.write("first_step", run_id="this-run", restart_count=1, step=3)
    new = EventLog(tmp_path, "manager")
    new.write("manager_start", run_id="this-run", restart_count=1)
    new.write("save", run_id="another-run", restart_count=1)
    assert [r["event"] for r in tail.poll()] == ["first_step", "manager_start"]
    assert tail.poll() == []
    with open(new.path, "a", encoding="utf-8") as f:  # a line being written: wait for its end
        f.write('{"event": "restore", "run_id": "this-run", "t": 1')
    assert tail.poll() == []
    with open(new.path, "a", encoding="utf-8") as f:
        f.write("}\n")
    assert [r["event"] for r in tail.poll()] == ["restore"]
    old.close()
    new.close()
