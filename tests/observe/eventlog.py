"""Hand-written event logs in the documented format (docs/FORMAT.md, "Event log"), with chosen times."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RUN = "20261130-120000-abcdef"
PHASES_1 = {
    "detection_s": 0.1,
    "teardown_s": 0.0,
    "backoff_s": 0.5,
    "relaunch_s": 1.3,
    "identification_s": 0.1,
    "load_s": 0.2,
    "validation_s": 0.0,
    "first_step_s": 1.0,
}


def ev(t: float, event: str, source: str = "manager", **fields: Any) -> dict[str, Any]:
    return {"t": t, "time": "", "event": event, "source": source, "pid": 1, **fields}


def sup(t: float, event: str, **fields: Any) -> dict[str, Any]:
    return ev(t, event, "supervisor", run_id=RUN, **fields)


def mgr(t: float, event: str, rc: int, **fields: Any) -> dict[str, Any]:
    return ev(t, event, "manager", run_id=RUN, restart_count=rc, **fields)


def save(
    t: float,
    step: int,
    rc: int,
    *,
    block: float = 0.2,
    persist: float = 1.0,
    nbytes: int = 1000,
    written: int = 1000,
) -> dict[str, Any]:
    return mgr(
        t,
        "save",
        rc,
        step=step,
        bytes=nbytes,
        bytes_written=written,
        block_s=block,
        persist_s=persist,
        chunks=2,
        staging_bytes=0,
        async_save=True,
    )


def one_failure_run() -> list[dict[str, Any]]:
    """A supervised run: steps 1-25 in attempt 0 (saves at 10 and 20), SIGKILL injected in step 26, attempt 1
    restores step 20 and trains to 30 (save at 30), retention deletes step 10; 100 s .. 140 s."""
    return [
        sup(100.0, "supervisor_start", command=["x"], root="r", config={}),
        sup(100.1, "job_start", attempt=0, restart_count=0, pid=11, t_spawn=100.1, heartbeat_file="/nope"),
        mgr(101.0, "manager_start", 0, root="r"),
        mgr(101.5, "restore", 0, step=None, scan_s=0.01, load_s=0.0, validate_s=0.0, bytes=0, skipped=[]),
        mgr(102.0, "first_step", 0, step=1),
        save(111.0, 10, 0),
        save(121.0, 20, 0, written=300),
        mgr(125.0, "fault_injected", 0, kind="kill_step", step=26),
        sup(
            125.1,
            "failure",
            attempt=0,
            restart_count=0,
            cause="signal",
            exit_code=None,
            signal="SIGKILL",
            last_step=25,
            t_death=125.0,
            detect_s=0.1,
            teardown_s=0.0,
            runtime_s=25.0,
            progressed=True,
        ),
        sup(125.2, "restart", attempt=1, restart_count=1, backoff_s=0.5),
        sup(125.7, "job_start", attempt=1, restart_count=1, pid=12, t_spawn=125.7, heartbeat_file="/nope"),
        mgr(127.0, "manager_start", 1, root="r"),
        mgr(127.5, "restore", 1, step=20, scan_s=0.1, load_s=0.2, validate_s=0.0, bytes=1000, skipped=[]),
        mgr(128.5, "first_step", 1, step=21),
        sup(
            128.6,
            "recovery",
            restart_count=1,
            t_death=125.0,
            last_step=25,
            restored_step=20,
            steps_lost=5,
            ttr_s=3.5,
            phases=PHASES_1,
            complete=True,
            first_step_source="manager",
        ),
        save(139.0, 30, 1),
        mgr(139.1, "retention_delete", 1, step=10),
        sup(140.0, "success", attempt=1, restart_count=1, exit_code=0, last_step=30, runtime_s=14.3),
    ]


def write_log(root: Path, records: list[dict[str, Any]], *, torn: str = "") -> Path:
    """Write the records as one event file under ``root/events`` (and a torn last line if given)."""
    d = root / "events"
    d.mkdir(parents=True, exist_ok=True)
    path = d / "manager-1-abcdef.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + torn)
    return path
