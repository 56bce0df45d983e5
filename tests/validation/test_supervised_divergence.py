"""Under the supervisor: a launch whose loss diverges after resume exits with ResumeDivergedError, the
supervisor relaunches it, and the next launch resumes from an older checkpoint (issue 11)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from trainguard.recovery.config import Backoff
from trainguard.recovery.events import read_events
from trainguard.recovery.supervisor import Supervisor, SupervisorConfig

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import torch
    import trainguard as tg

    root, = sys.argv[1:]
    attempt = int(os.environ["TRAINGUARD_RESTART_COUNT"])
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    state = {"model": model, "optim": optim}
    w_true = torch.arange(6, dtype=torch.float32).reshape(6, 1) / 6
    end = {0: 18}.get(attempt, 25)
    with tg.CheckpointManager(root, save_policy=tg.EveryNSteps(5)) as mgr:
        start = mgr.restore_latest(state) or 0
        print(f"attempt {attempt} resumed from {start}", flush=True)
        for step in range(start + 1, end + 1):
            g = torch.Generator().manual_seed(step)
            x = torch.randn(32, 6, generator=g)
            y = x @ w_true * (10.0 if attempt == 1 else 1.0)  # attempt 1: the data changed
            loss = torch.nn.functional.mse_loss(model(x), y)
            optim.zero_grad()
            loss.backward()
            optim.step()
            mgr.maybe_save(step, state, metrics={"loss": loss.item()})
    sys.exit(1 if attempt == 0 else 0)  # attempt 0 dies after step 18
    """
)


@pytest.mark.slow  # three launches of a torch process
def test_a_diverging_launch_is_relaunched_and_resumes_from_an_older_checkpoint(tmp_path: Path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    root = tmp_path / "root"
    config = SupervisorConfig(
        root=root,
        backoff=Backoff(initial_s=0.01, max_s=0.05, factor=2.0),
        grace_period_s=0.5,
        poll_interval_s=0.05,
        max_restarts=5,
    )
    messages: list[str] = []
    result = Supervisor([sys.executable, str(script), str(root)], config, echo=messages.append).run()
    assert result.exit_code == 0, messages
    assert [a.outcome for a in result.attempts] == ["exit", "exit", "success"]
    restores = {e["restart_count"]: e["step"] for e in read_events(root, event="restore")}
    assert restores == {0: None, 1: 15, 2: 10}
    [diverged] = read_events(root, event="resume_diverged")
    assert diverged["restored_step"] == 15 and diverged["steps"] == [16]
