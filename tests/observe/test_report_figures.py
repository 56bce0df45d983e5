"""`trainguard report` figures from hand-written event logs whose every number is worked out by hand here."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys

import pytest

from trainguard.observe.figures import compute_figures, report_figures, wall_spans
from trainguard.planning import daly_interval_s, optimal_interval_s

from .eventlog import PHASES_1, RUN, mgr, one_failure_run, save, sup, write_log


def test_a_failure_is_joined_with_its_injected_kind_and_its_recovery():
    figs = compute_figures(one_failure_run())
    [f] = figs["failures"]
    assert (f["kind"], f["cause"], f["injected"]) == ("kill_step", "signal", True)
    # killed in step 26: the failure hit after step 25, the last one the job reported (as `trainguard run` says)
    assert (f["step"], f["injected_step"], f["last_step"]) == (25, 26, 25)
    assert (f["restored_step"], f["steps_lost"], f["ttr_s"]) == (20, 5, 3.5)
    assert f["phases"] == PHASES_1
    assert f["t_s"] == pytest.approx(25.0)  # t_death since the run's first event


def test_a_failure_that_was_not_injected_takes_its_cause_as_kind():
    recs = [r for r in one_failure_run() if r["event"] != "fault_injected"]
    [f] = compute_figures(recs)["failures"]
    assert (f["kind"], f["injected"], f["step"], f["injected_step"]) == ("signal", False, 25, None)


def test_goodput_is_the_time_spent_on_surviving_steps_less_save_stalls_over_wall_time():
    figs = compute_figures(one_failure_run())
    # attempt 1: steps 21..30 survive. 9 steps in 128.5 -> 138 s (save 30 started at 139 - 1), so step 21 began
    # one step time before 128.5; its save of step 30 stalled 0.2 s.
    per1 = (138.0 - 128.5) / 9
    prod1 = 138.0 - (128.5 - per1) - 0.2
    # attempt 0: steps 1..20 survive (21..25 were lost): step 1 done at 102, step 25 at 125 (t_death), step 20
    # at 120 (save start); two saves stalled 0.2 s each.
    per0 = (125.0 - 102.0) / 24
    prod0 = 120.0 - (102.0 - per0) - 0.4
    assert figs["goodput"] == pytest.approx((prod0 + prod1) / 40.0)
    curve = figs["goodput_timeline"]
    assert curve[-1][0] == pytest.approx(40.0) and curve[-1][1] == pytest.approx(figs["goodput"])
    assert all(0 <= g <= 1 for _, g in curve)


def test_saves_and_checkpoints_list_every_commit_with_its_times_sizes_and_retention():
    figs = compute_figures(one_failure_run())
    assert [
        (s["step"], s["block_s"], s["persist_s"], s["bytes"], s["bytes_written"]) for s in figs["saves"]
    ] == [
        (10, 0.2, 1.0, 1000, 1000),
        (20, 0.2, 1.0, 1000, 300),
        (30, 0.2, 1.0, 1000, 1000),
    ]
    assert [s["start_s"] for s in figs["saves"]] == pytest.approx([10.0, 20.0, 38.0])
    ck = figs["checkpoints"]
    assert (ck["count"], ck["bytes"], ck["bytes_written"]) == (3, 3000, 2300)
    assert (ck["retained"], ck["deleted"]) == ([20, 30], [10])
    assert ck["mean_block_s"] == pytest.approx(0.2) and ck["mean_persist_s"] == pytest.approx(1.0)
    assert [(r["step"], r["from_s"], r["to_s"]) for r in ck["retention"]] == [
        (10, pytest.approx(11.0), pytest.approx(39.1)),
        (20, pytest.approx(21.0), None),
        (30, pytest.approx(39.0), None),
    ]


def test_the_interval_is_compared_with_daly_for_the_runs_own_c_l_and_mtbf():
    iv = compute_figures(one_failure_run())["interval"]
    # C = median block 0.2 s, L = median persist 1.0 s, MTBF = 40 s wall / 1 failure; the saves of attempt 0
    # started 10 s apart, so 9.8 s of compute between them.
    assert (iv["checkpoint_s"], iv["persist_s"], iv["mtbf_s"], iv["failures"]) == (0.2, 1.0, 40.0, 1)
    assert iv["measured_s"] == pytest.approx(9.8)
    x = 0.2 / 80
    by_hand = math.sqrt(2 * 0.2 * 40) * (1 + math.sqrt(x) / 3 + x / 9) - 0.2
    assert iv["optimal_s"] == pytest.approx(by_hand) == daly_interval_s(0.2, 40.0)
    assert iv["optimal_s"] == optimal_interval_s(0.2, 40.0, persist_s=1.0)
    assert iv["ratio"] == pytest.approx(9.8 / by_hand) and "too rare" in iv["reason"]
    assert iv["restart_s"] == pytest.approx(3.4) and iv["detect_s"] == pytest.approx(0.1)
    assert 0 < iv["waste_optimal"] < iv["waste_measured"]


def test_without_a_failure_the_optimum_is_unknown_and_says_why():
    recs = [r for r in one_failure_run() if r["event"] not in ("failure", "recovery", "fault_injected")]
    iv = compute_figures(recs)["interval"]
    assert iv["optimal_s"] is None and iv["mtbf_s"] is None and "no failure" in iv["reason"]


def test_a_root_still_being_written_reports_the_recovery_in_progress(tmp_path):
    recs = one_failure_run()
    cut = next(i for i, r in enumerate(recs) if r["event"] == "first_step" and r.get("restart_count") == 1)
    write_log(tmp_path, recs[:cut], torn='{"t": 128.5, "event": "first_st')
    figs = report_figures(str(tmp_path))
    [f] = figs["failures"]
    assert f["ttr_s"] is None and f["steps_lost"] is None and f["kind"] == "kill_step"
    assert figs["run"]["status"] == "running" and figs["run"]["last_step"] == 25
    assert figs["goodput"] is not None and 0 < figs["goodput"] <= 1


def test_wall_time_spans_each_run_and_skips_the_idle_gap_between_two_runs():
    a = [sup(100.0, "supervisor_start"), sup(140.0, "success")]
    b = [dict(r, run_id="other", t=r["t"] + 1000) for r in a]
    assert wall_spans(a + b) == [(100.0, 140.0), (1100.0, 1140.0)]
    assert compute_figures(a + b)["run"]["wall_s"] == pytest.approx(80.0)


def test_an_unsupervised_run_gets_its_figures_from_the_manager_alone():
    recs = [
        {"t": 10.0, "event": "manager_start", "source": "manager", "pid": 5},
        {"t": 10.5, "event": "restore", "source": "manager", "pid": 5, "step": None},
        {"t": 11.0, "event": "first_step", "source": "manager", "pid": 5, "step": 1},
        {"t": 21.0, "event": "progress", "source": "manager", "pid": 5, "step": 11},
        {
            "t": 30.0,
            "event": "save",
            "source": "manager",
            "pid": 5,
            "step": 20,
            "block_s": 0.0,
            "persist_s": 0.0,
            "bytes": 10,
            "bytes_written": 10,
        },
    ]
    figs = compute_figures(recs)
    assert figs["run"]["status"] == "unsupervised" and figs["failures"] == []
    # 20 steps in 20 s: step 1 took one step time (0.95 s) before its first_step event at 11 s
    assert figs["goodput"] == pytest.approx((30.0 - (11.0 - 19.0 / 19)) / 20.0)
    assert figs["timeline"]["attempts"][0]["points"][1] == [11.0, 11]


def test_report_json_cli_prints_the_documented_keys_and_writes_html_only_with_o(tmp_path):
    write_log(tmp_path, one_failure_run())
    r = subprocess.run(
        [sys.executable, "-m", "trainguard", "report", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= {"failures", "goodput", "saves", "checkpoints", "interval"}
    assert set(out["failures"][0]) >= {"kind", "cause", "step", "steps_lost", "ttr_s", "phases"}
    assert 0 < out["goodput"] <= 1 and not (tmp_path / "report.html").exists()
    html = tmp_path / "sub" / "r.html"
    html.parent.mkdir()
    r = subprocess.run(
        [sys.executable, "-m", "trainguard", "report", str(tmp_path), "-o", str(html), "--json"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0 and json.loads(r.stdout)["report"] == str(html)
    text = html.read_text()
    assert text.count('<figure class="plot"') == 6 and 'id="failures"' in text and "kill_step" in text
    assert "http://" not in text.replace("http://www.w3.org", "") and "https://" not in text


def test_report_of_a_missing_root_or_one_without_events_is_a_usage_error(tmp_path):
    for root in (tmp_path / "missing", tmp_path):
        r = subprocess.run(
            [sys.executable, "-m", "trainguard", "report", str(root)], capture_output=True, text=True
        )
        assert r.returncode == 2 and ("does not exist" in r.stderr or "no event log" in r.stderr), r.stderr


def test_report_to_an_unwritable_place_is_a_usage_error_naming_it(tmp_path):
    write_log(tmp_path, one_failure_run())
    target = tmp_path / "no" / "such" / "dir" / "r.html"
    r = subprocess.run(
        [sys.executable, "-m", "trainguard", "report", str(tmp_path), "-o", str(target)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "cannot write the report" in r.stderr and not target.exists()


def test_record_fields_of_other_runs_do_not_leak_into_a_failure_join():
    recs = one_failure_run()
    other = mgr(124.0, "fault_injected", 0, kind="hang", step=24)
    other["run_id"] = "someone-else"
    [f] = compute_figures([*recs, other])["failures"]
    assert f["kind"] == "kill_step" and RUN in compute_figures(recs)["run"]["run_ids"]


def test_text_from_the_event_log_is_escaped_in_the_html_and_cannot_close_the_figures_script():
    from trainguard.observe.html import render_html

    recs = one_failure_run()
    evil = "<img src=x onerror=alert(1)></script><!--"
    for r in recs:
        if r["event"] == "fault_injected":
            r["kind"] = evil
    page = render_html(compute_figures(recs))
    assert evil not in page and "&lt;img src=x onerror=alert(1)&gt;" in page
    blob = page.split('id="trainguard-figures">', 1)[1].split("</script>", 1)[0]
    assert json.loads(blob)["failures"][0]["kind"] == evil


def test_odd_files_in_the_event_log_folder_are_skipped_not_read(tmp_path):
    import os

    write_log(tmp_path, one_failure_run())
    os.mkfifo(tmp_path / "events" / "stuck.jsonl")  # would block a reader forever
    (tmp_path / "events" / "zero.jsonl").symlink_to("/dev/zero")  # would never end
    r = subprocess.run(
        [sys.executable, "-m", "trainguard", "report", str(tmp_path), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["failures"][0]["kind"] == "kill_step"


def test_the_supervisors_tail_skips_a_fifo_in_the_event_log_folder(tmp_path):
    import os

    from trainguard.recovery.ttr import EventTail

    tail = EventTail(tmp_path, RUN)
    write_log(tmp_path, one_failure_run())
    os.mkfifo(tmp_path / "events" / "stuck.jsonl")  # opening it for reading would block the supervisor
    got = tail.poll()
    assert [r["event"] for r in got][:2] == ["supervisor_start", "job_start"] and len(got) == 18


def test_a_long_run_keeps_the_report_small_and_its_goodput_exact():
    from trainguard.observe.figures import TIMELINE_POINTS
    from trainguard.observe.html import render_html

    recs = [sup(0.0, "supervisor_start"), sup(0.1, "job_start", restart_count=0)]
    recs += [mgr(1.0, "restore", 0, step=None), mgr(2.0, "first_step", 0, step=1)]
    for i in range(1, 30_000):  # a step per second, progress every 10 s, a 0.5 s save every 1000 steps
        if i % 10 == 0:
            recs.append(mgr(2.0 + i, "progress", 0, step=1 + i))
        if (1 + i) % 1000 == 0:
            recs.append(save(2.0 + i + 3.0, 1 + i, 0, block=0.5, persist=3.0))
    recs.append(sup(30_010.0, "success", restart_count=0, last_step=30_000))
    figs = compute_figures(recs)
    points = figs["timeline"]["attempts"][0]["points"]
    assert len(points) <= TIMELINE_POINTS and points[0] == [2.0, 1] and points[-1][1] == 30_000
    # 30 000 steps, 30 saves stalling 0.5 s each, over 30 010 s; step 1 took one step time (1 s) before t = 2
    assert figs["goodput"] == pytest.approx((30_001.0 - 1.0 - 15.0) / 30_010.0, rel=1e-6)
    page = render_html(figs)
    assert len(page) < 1_500_000
    # no failure: the recovery plot and the interval plot say so instead of plotting
    empty = re.findall(r'id="plot-(\w+)" data-has-data="no"', page)
    assert empty == ["recoveries", "interval"] and page.count('data-has-data="yes"') == 4


def test_a_step_saved_again_replaces_its_first_checkpoint_and_suspect_skips_are_not_called_corrupt():
    """Attempt 1 resumes from step 10 and saves step 20 again: the first step-20 checkpoint is replaced at that
    second commit (not "still kept" from its first). A step skipped as suspect is listed apart from corrupt."""
    recs = one_failure_run()
    at = next(i for i, r in enumerate(recs) if r["event"] == "save" and r["step"] == 30)
    recs.insert(at, save(136.0, 20, 1))  # attempt 1 redoes step 20 (replacing the first checkpoint of it)
    recs.insert(at, mgr(127.4, "restore_skipped", 1, step=20, problem="suspect: the probe loss 9.1 > 2.0"))
    recs.insert(
        at, mgr(127.3, "restore_skipped", 1, step=15, problem="chunk chunks/ab/x of step 15 fails CRC32C")
    )
    figs = compute_figures(sorted(recs, key=lambda r: r["t"]))
    ck = figs["checkpoints"]
    assert (ck["corrupt_detected"], ck["suspect_detected"]) == ([15], [20])
    rows = [(r["step"], r["from_s"], r["to_s"], r["replaced"]) for r in ck["retention"]]
    assert rows == [
        (10, pytest.approx(11.0), pytest.approx(39.1), False),
        (20, pytest.approx(21.0), pytest.approx(36.0), True),  # replaced at the second commit of step 20
        (20, pytest.approx(36.0), None, False),
        (30, pytest.approx(39.0), None, False),
    ]
