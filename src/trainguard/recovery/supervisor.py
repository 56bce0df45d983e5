"""The recovery supervisor behind ``trainguard run``: launch, watch, kill, relaunch.

The supervisor runs COMMAND in its own process group (session), so one ``os.killpg`` reaches every process
it spawned (``torchrun`` and its workers, a shell and its children). Each attempt gets in its environment:

- ``TRAINGUARD_RESTART_COUNT``: 0 for the first attempt, k for the k-th restart;
- ``TRAINGUARD_RUN_ID``: the same for every attempt of one ``trainguard run``;
- ``TRAINGUARD_HEARTBEAT_FILE``: a fresh per-attempt file (see :mod:`.heartbeat`);
- ``TRAINGUARD_ROOT``: the run root (absolute) holding the event log.

Failures: a non-zero exit (cause ``"exit"``), death by a signal (``"signal"``), no heartbeat for
``heartbeat_timeout_s`` (``"hang"``: the group gets SIGTERM, then SIGKILL after ``grace_period_s``), or exit
code 75 after a preemption save that the supervisor did not ask for (``"preempted"``; it counts as a restart
like the others). After a failure the supervisor relaunches COMMAND (the training script's own
``restore_latest`` finds the newest valid checkpoint), after a backoff that doubles while restarts make no
progress and resets when one does.

Progress is the heartbeat step: a restart made progress when its attempt reported a step above every earlier
attempt's. An attempt that never beats makes no progress; the no-progress limit only applies once some
attempt has beaten, except that attempts dying within ``EARLY_DEATH_S`` of starting without a single heartbeat
(a job that cannot start: an ImportError, a typo) also count, so such a job stops after the no-progress limit
instead of backing off through every ``max_restarts`` (a job that never beats but runs longer is governed by
``max_restarts`` alone).

SIGTERM, SIGINT and every other catchable terminating signal (SIGHUP, SIGUSR1, SIGQUIT, ...: see
:mod:`.lifetime`) sent to the supervisor are forwarded to the job's process group; the supervisor then waits up
to ``grace_period_s`` (a second signal: SIGKILL at once), and exits without restarting. The job dies with the
supervisor (``PR_SET_PDEATHSIG``), and after each attempt every leftover descendant of the job, including
those in other sessions (re-parented to the supervisor, a child subreaper), is stopped.

Exit codes (:data:`EXIT_CODES`): 0 the job exited 0; 2 usage error; 3 gave up after ``max_restarts``
restarts; 4 gave up after ``max_no_progress_restarts`` restarts in a row without progress; 5 gave up at once
because the job's ``restore_latest`` raised NoValidCheckpointError (its ``restore_failed`` event in the run
root's event log: a relaunch would fail the same way); 127 COMMAND could not be started; 128 + N stopped by signal N (130 SIGINT, 143 SIGTERM).

Prefetch (``SupervisorConfig.prefetch``, on by default except for a multi-node command): while each attempt
starts, a background thread has the chunk files of the newest usable checkpoint under the root read into this
node's page cache (:mod:`.prefetch`), so the job's restore reads memory instead of the disk; a ``prefetch``
event records what was requested.

Concurrency: one :meth:`Supervisor.run` at a time per object. Signals are forwarded only when ``run`` is
called from the main thread (Python delivers signals there).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ._process import (
    ATTEMPT_ID_ENV,
    Job,
    carries_attempt,
    group_alive,
    other_live_jobs,
    register_live_job,
    signal_group,
    signal_name,
    spawn_problem,
)
from .config import (
    EARLY_DEATH_S,
    EXIT_MAX_RESTARTS,
    EXIT_NO_PROGRESS,
    EXIT_NO_VALID_CHECKPOINT,
    EXIT_OK,
    EXIT_SIGNAL_BASE,
    EXIT_SPAWN_FAILED,
    RESTART_COUNT_ENV,
    ROOT_ENV,
    RUN_ID_ENV,
    TAIL_INTERVAL_S,
    SupervisorConfig,
    config_fields,
    default_root,
    new_run_id,
)
from .events import EventLog
from .heartbeat import EXIT_PREEMPTED, HEARTBEAT_FILE_ENV, PREEMPT_SIGNALS_ENV, Heartbeat, read_heartbeats
from .job import SHARE_STORE_ENV, RestartBudget, is_elastic_torchrun, run_id_from_command
from .lifetime import (
    TERMINATING_SIGNALS,
    children,
    descendants,
    die_with_parent,
    reap_adopted,
    set_child_subreaper,
    stop_processes,
)
from .prefetch import NO_CHECKPOINT, Prefetch, PrefetchResult, multi_node_command
from .ttr import Attempt, EventTail, PendingRecovery, RecoveryTiming, RunResult


class Supervisor:
    """Run a command, restart it on failure, and account for every recovery.

    Args:
        command: the program and its arguments (e.g. ``["torchrun", "--nproc-per-node", "8", "train.py"]``).
        config: the settings; None: defaults.
        echo: receives one-line progress messages (default: print to stderr).

    Raises:
        ConfigError: when ``command`` is empty.
    """

    def __init__(
        self,
        command: Sequence[str],
        config: SupervisorConfig | None = None,
        *,
        echo: Callable[[str], None] | None = None,
    ) -> None:
        if not command:
            raise ConfigError("no command to supervise; usage: trainguard run [OPTIONS] -- COMMAND [ARGS]...")
        self.command = tuple(str(c) for c in command)
        self.config = config or SupervisorConfig()
        self.root = Path(self.config.root).absolute() if self.config.root is not None else default_root()
        self.run_id = self.config.run_id or run_id_from_command(self.command) or new_run_id()
        self._budget = RestartBudget(self.root, self.run_id, self.config.max_restarts)
        self._preempt_signal: int | None = None
        self._echo = echo or (lambda msg: print(msg, file=sys.stderr, flush=True))
        self._stop_signal: int | None = None
        self._no_valid: str | None = None  # the attempt's restore_failed problem (NoValidCheckpointError)
        self._job_used_root = False  # a record of the job (its CheckpointManager) arrived in the root's log
        self._root_mismatch: str | None = None  # the root a job's manager writes instead (root_mismatch)
        self._stop_t: float | None = None
        self._job: Job | None = None
        self._recoveries: list[RecoveryTiming] = []
        self._attempts: list[Attempt] = []
        self._children_before: set[int] = set()
        self._attempt_token = ""
        self._spawn_error: str | None = None
        self._metrics: Any = None
        self._prefetch: Prefetch | None = None
        self.metrics_url: str | None = None
        """The scrape URL while :meth:`run` serves metrics (``metrics_port`` set), else None."""

    # --- public ------------------------------------------------------------------------------------------

    def run(self) -> RunResult:
        """Supervise until the job succeeds, the limits are hit, or a stop signal arrives.

        Returns:
            The result; its ``exit_code`` is what ``trainguard run`` exits with.

        Raises:
            ConfigError: the run root cannot hold the event log (a file, read-only, an odd ``events``).
        """
        server = self._start_metrics()
        try:
            self._log = EventLog(self.root, "supervisor")
        except OSError as e:  # UnsafeFileError included: its message names the file and the fix
            if server is not None:
                server.close()
            raise ConfigError(f"cannot write the event log under the run root {self.root}: {e}") from None
        self._log.set_context(run_id=self.run_id, host=socket.gethostname())
        if self._metrics is not None:
            self._log.listeners.append(self._metrics.observe)
        self._tail = EventTail(self.root, self.run_id, ignore=self._log.path)
        unset = self.config.root is None and not os.environ.get(ROOT_ENV)
        hint = " (no --root given: pass the job's checkpoint root so its restore timings join the report)"
        self._echo(f"[trainguard] run {self.run_id}: event log {self._log.path}" + (hint if unset else ""))
        self._hb_dir = Path(tempfile.mkdtemp(prefix=f"trainguard-{self.run_id}-"))
        previous = self._install_signal_handlers()
        subreaper = set_child_subreaper(True)
        try:
            return self._loop()
        finally:
            if subreaper:
                set_child_subreaper(False)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._log.close()
            shutil.rmtree(self._hb_dir, ignore_errors=True)
            if server is not None:
                self._poll_tail(None)
                self._metrics.refresh()
                server.close()
                self.metrics_url = None

    def _start_metrics(self) -> Any:
        """Start the metrics endpoint when configured; return the server (None when off).

        Raises:
            ConfigError: the port cannot be bound.
        """
        if self.config.metrics_port is None:
            return None
        from ..observe.metrics import MetricsServer, RunMetrics

        self._metrics = RunMetrics()
        server = MetricsServer(self._metrics.registry, self.config.metrics_port)
        self.metrics_url = server.url
        self._echo(f"[trainguard] Prometheus metrics at {server.url}")
        return server

    def _poll_tail(self, pending: PendingRecovery | None) -> None:
        """Read the job's new events: feed the metrics and the recovery in progress, and note a
        ``restore_failed`` (no valid checkpoint: relaunching cannot help)."""
        records = self._tail.poll()
        for rec in records:
            if rec.get("event") == "restore_failed" and rec.get("error") == "NoValidCheckpointError":
                self._no_valid = str(rec.get("problem") or "no valid checkpoint")
            if rec.get("event") == "root_mismatch":
                if self._root_mismatch is None:
                    self._echo(
                        f"[trainguard] warning: the job's CheckpointManager writes {rec.get('root')}, not the run "
                        f"root {self.root}: restores there are invisible to this supervisor (pass --root "
                        f"{rec.get('root')})"
                    )
                self._root_mismatch = str(rec.get("root"))
            else:
                self._job_used_root = True
        if self._metrics is not None:
            self._metrics.observe_all(records)
        if pending is not None and not pending.done:
            for rec in records:
                pending.offer(rec)

    def request_preemption(self, signum: int = signal.SIGUSR1) -> None:
        """Stop for a scheduler's preemption notice: SIGTERM to the job, no restart, exit 75.

        Safe from a signal handler. A second notice or stop request kills the job's process group at once.
        """
        if self._stop_signal is None:
            self._preempt_signal = int(signum)
        self.request_stop(signal.SIGTERM)

    def request_stop(self, signum: int = signal.SIGTERM) -> None:
        """Stop as if ``signum`` had been received: forward it to the job and exit with 128 + signum.

        A second request kills the job's process group with SIGKILL at once. Safe from a signal handler.
        """
        job = self._job
        if self._stop_signal is not None:
            if job is not None:
                signal_group(job.pgid, signal.SIGKILL)
            return
        self._stop_signal = int(signum)
        self._stop_t = time.time()
        if job is not None and not job.done.is_set():
            job.forwarded = signal_group(job.pgid, signum) or job.forwarded

    # --- the loop ----------------------------------------------------------------------------------------

    def _loop(self) -> RunResult:
        cfg = self.config
        self._log.write(
            "supervisor_start", command=list(self.command), root=str(self.root), config=config_fields(cfg)
        )
        best_step: int | None = None
        no_progress = 0
        early_deaths = 0  # attempts in a row that died before any heartbeat, within EARLY_DEATH_S of starting
        pending: PendingRecovery | None = None
        attempt = restart_count = 0  # this supervisor's attempt; the job-wide restart number (see .job)
        while True:
            if self._stop_signal is not None:
                return self._finish("stopped", signal.Signals(self._stop_signal).name, None)
            self._no_valid = None
            job = self._spawn(attempt, restart_count)
            if job is None:
                return self._finish("spawn_failed", "spawn_failed", EXIT_SPAWN_FAILED)
            if pending is not None:
                pending.t_spawn = job.t_spawn
            prefetch = self._start_prefetch(attempt, restart_count)
            try:
                result = self._watch(job, pending)
            finally:
                if prefetch is not None:  # the relaunch does not wait for a read in flight
                    prefetch.stop(timeout=0.2)
            self._attempts.append(result)
            if pending is not None and not pending.done:
                self._record_recovery(pending)
            pending = None
            if result.outcome == "stopped":
                return self._finish("stopped", signal.Signals(self._stop_signal or signal.SIGTERM).name, None)
            if result.outcome == "success":
                self._log.write(
                    "success",
                    attempt=attempt,
                    restart_count=restart_count,
                    exit_code=0,
                    last_step=result.last_step,
                    runtime_s=result.t_end - result.t_start,
                )
                self._echo(f"[trainguard] attempt {attempt} succeeded (exit 0)")
                return self._finish("succeeded", None, EXIT_OK)
            progressed = result.last_step is not None and (best_step is None or result.last_step > best_step)
            if progressed:
                best_step = result.last_step
            if attempt > 0:
                no_progress = 0 if progressed else no_progress + 1
            early = result.last_step is None and result.t_end - result.t_start < EARLY_DEATH_S
            early_deaths = early_deaths + 1 if early else 0
            self._log.write(
                "failure",
                attempt=attempt,
                restart_count=restart_count,
                cause=result.outcome,
                exit_code=result.exit_code,
                signal=result.signal,
                last_step=result.last_step,
                t_death=result.t_death,
                detect_s=result.detect_s,
                teardown_s=result.teardown_s,
                runtime_s=result.t_end - result.t_start,
                progressed=progressed,
            )
            how = f"killed by {result.signal}" if result.signal else f"exit code {result.exit_code}"
            how = {"hang": f"hung, {how}", "preempted": "preempted, checkpoint saved"}.get(
                result.outcome, how
            )
            # "The step a failure hit" is always the last step the job reported done (its newest heartbeat).
            at = "before any heartbeat" if result.last_step is None else f"after step {result.last_step}"
            self._echo(f"[trainguard] attempt {attempt} failed ({how}), {at}")
            if self._stop_signal is not None:
                return self._finish("stopped", signal.Signals(self._stop_signal).name, None)
            if result.outcome == "exit" and self._no_valid is not None:
                # deterministic: every relaunch would restore_latest the same invalid checkpoints
                why = self._no_valid.rstrip().replace("\n", "\n[trainguard]   ")
                self._echo(
                    f"[trainguard] the job found no valid checkpoint to resume from:\n[trainguard]   {why}\n"
                    f"[trainguard] a relaunch would fail the same way: not restarting. `trainguard verify "
                    f"{self.root} --all` says why; restore a replica, `trainguard mark {self.root} STEP --clear` "
                    "a suspect one, or start a new run root"
                )
                return self._finish("gave_up", "no_valid_checkpoint", EXIT_NO_VALID_CHECKPOINT)
            limit = cfg.max_no_progress_restarts
            if limit and best_step is not None and no_progress >= limit:
                return self._finish("gave_up", "no_progress", EXIT_NO_PROGRESS)
            if limit and best_step is None and early_deaths > limit:
                # a job that cannot even start (an ImportError, a typo) fails fast instead of backing off for minutes
                self._echo(
                    f"[trainguard] the job died {early_deaths} times in a row before its first heartbeat, "
                    f"each within {EARLY_DEATH_S:.0f} s of starting"
                )
                return self._finish("gave_up", "no_progress", EXIT_NO_PROGRESS)
            claimed = self._budget.claim(attempt=attempt)  # one budget for every node's supervisor
            if claimed is None:
                if cfg.max_restarts:
                    self._echo(
                        f"[trainguard] run {self.run_id}: the job's {cfg.max_restarts} restarts are spent "
                        f"({self._budget.used()} claimed by this job's supervisors under {self._budget.dir}); a new "
                        "job needs its own --run-id (or torchrun --rdzv-id)"
                    )
                return self._finish("gave_up", "max_restarts", EXIT_MAX_RESTARTS)
            restart_count = claimed
            delay = cfg.backoff.delay_s(no_progress)
            self._log.write("restart", attempt=attempt + 1, restart_count=restart_count, backoff_s=delay)
            self._echo(f"[trainguard] restart {restart_count}/{cfg.max_restarts} in {delay:.2f} s")
            slept = self._sleep(delay)
            pending = PendingRecovery(
                restart_count=restart_count,
                t_death=result.t_death,
                detect_s=result.detect_s,
                teardown_s=result.teardown_s,
                backoff_s=slept,
                last_step=result.last_step,
            )
            attempt += 1

    def _spawn(self, attempt: int, restart_count: int) -> Job | None:
        hb_file = self._hb_dir / f"heartbeat-{attempt}"
        env = dict(os.environ)
        env.update(self.config.env)
        env.update(
            {
                RESTART_COUNT_ENV: str(restart_count),
                RUN_ID_ENV: self.run_id,
                HEARTBEAT_FILE_ENV: str(hb_file),
                ROOT_ENV: str(self.root),
            }
        )
        if is_elastic_torchrun(self.command) and SHARE_STORE_ENV not in env:
            env[SHARE_STORE_ENV] = "1"  # else a node joining a running torchrun job deadlocks (see .job)
        self._attempt_token = f"{self.run_id}-{attempt}-{secrets.token_hex(6)}"
        env[ATTEMPT_ID_ENV] = self._attempt_token  # marks the attempt's descendants (see _stop_leftovers)
        if self.config.preempt_signals:
            env[PREEMPT_SIGNALS_ENV] = ",".join(signal.Signals(s).name for s in self.config.preempt_signals)
        t_spawn = time.time()
        try:
            self._children_before = children(os.getpid())
            proc = subprocess.Popen(
                list(self.command), env=env, start_new_session=True, preexec_fn=die_with_parent(os.getpid())
            )
        except OSError as e:
            self._spawn_error = spawn_problem(self.command[0], e)
            self._log.write(
                "spawn_error", attempt=attempt, restart_count=restart_count, error=self._spawn_error
            )
            self._echo(f"[trainguard] cannot start the job: {self._spawn_error}")
            return None
        job = Job(proc, attempt, hb_file, t_spawn)
        register_live_job(job)
        self._job = job
        if self._stop_signal is not None and not job.forwarded:
            job.forwarded = signal_group(job.pgid, self._stop_signal)  # a stop raced the spawn
        self._log.write(
            "job_start",
            attempt=attempt,
            restart_count=restart_count,
            command=list(self.command),
            pid=proc.pid,
            t_spawn=t_spawn,
            heartbeat_file=str(hb_file),
        )
        self._echo(f"[trainguard] attempt {attempt} started: pid {proc.pid}, run {self.run_id}")
        return job

    def _prefetch_wanted(self) -> bool:
        if self.config.prefetch is not None:
            return self.config.prefetch
        return not multi_node_command(self.command)

    def _start_prefetch(self, attempt: int, restart_count: int) -> Prefetch | None:
        """Read the newest usable checkpoint into the page cache while the attempt starts (``prefetch``);
        a ``prefetch`` event records what was read. Nothing when there is no checkpoint yet, or while the
        previous attempt's prefetch is still running (one at a time)."""
        if not self._prefetch_wanted():
            return None
        if self._prefetch is not None and self._prefetch.running():
            return self._prefetch  # still choosing or reading for the previous attempt

        def done(result: PrefetchResult) -> None:
            if result.status == "skipped" and result.step is None and result.reason == NO_CHECKPOINT:
                return  # no checkpoint yet (a new run): nothing worth an event
            with contextlib.suppress(Exception):  # best effort from this thread (the log may be closed)
                self._log.write("prefetch", attempt=attempt, restart_count=restart_count, **result.to_dict())

        try:
            self._prefetch = Prefetch(self.root, on_done=done).start()
        except Exception:  # noqa: BLE001 - no thread to spare: the restore reads the disk as before
            self._prefetch = None
        return self._prefetch

    def _watch(self, job: Job, pending: PendingRecovery | None) -> Attempt:
        cfg = self.config
        newest: Heartbeat | None = None
        max_step: int | None = None
        next_tail = 0.0
        killed_for_stop = False
        t_death: float | None = None
        noticed = now = time.time()

        def observe() -> None:
            nonlocal newest, max_step
            beats = read_heartbeats(job.heartbeat_file)
            if not beats:
                return
            top = max(beats, key=lambda b: b.t)
            if newest is None or top.t > newest.t:
                newest = top
            high = max(b.step for b in beats)
            max_step = high if max_step is None else max(max_step, high)
            if pending is not None and not pending.done:
                pending.offer_heartbeats(beats)

        while True:
            exited = job.done.wait(cfg.poll_interval_s)
            now = time.time()
            observe()
            waiting = pending is not None and not pending.done
            if exited or ((waiting or self._metrics is not None) and time.monotonic() >= next_tail):
                next_tail = time.monotonic() + TAIL_INTERVAL_S
                self._poll_tail(pending)
                if pending is not None and not pending.done and pending.ready(now):
                    self._record_recovery(pending)
            if exited:
                break
            if self._stop_signal is not None:
                if not job.forwarded:
                    job.forwarded = signal_group(job.pgid, self._stop_signal)
                if not killed_for_stop and now - (self._stop_t or now) > cfg.grace_period_s:
                    self._echo("[trainguard] job still running after the grace period: SIGKILL")
                    signal_group(job.pgid, signal.SIGKILL)
                    killed_for_stop = True
                continue
            hang = self._hang_reference(job, newest)
            if hang is not None and now - hang[0] > hang[1]:
                self._echo(
                    f"[trainguard] attempt {job.attempt}: no heartbeat for {now - hang[0]:.1f} s "
                    f"(limit {hang[1]:g} s): killing process group {job.pgid}"
                )
                t_death, noticed = hang[0], now
                self._terminate(job)
                break
        hung = t_death is not None
        if t_death is None:
            noticed = now  # taken right after the waiter thread woke us
            t_death = job.t_exit or noticed
        observe()  # the beat flushed at exit
        rc = job.returncode if job.returncode is not None else -signal.SIGKILL
        if hung:
            outcome = "hang"
        elif self._stop_signal is not None and (rc != 0 or (self._stop_t or 0.0) <= t_death):
            outcome = "stopped"  # a job that had already exited 0 before the stop still succeeded
        elif rc == 0:
            outcome = "success"
        elif rc < 0:
            outcome = "signal"
        elif rc == EXIT_PREEMPTED:
            outcome = "preempted"
        else:
            outcome = "exit"
        if self._group_alive(job):
            # Leftovers (torchrun workers orphaned by a SIGKILLed agent) would hold GPUs and ports.
            self._terminate(job)
        self._stop_leftovers(job)
        return Attempt(
            attempt=job.attempt,
            pid=job.pgid,
            t_start=job.t_spawn,
            t_end=time.time(),
            outcome=outcome,
            exit_code=rc if rc >= 0 else None,
            signal=signal_name(rc),
            last_step=max_step,
            t_death=t_death,
            detect_s=max(0.0, noticed - t_death),
            teardown_s=time.time() - noticed,
        )

    def _group_alive(self, job: Job) -> bool:
        """Whether the job's process group still has members, once the members re-parented to the
        supervisor (a subreaper) that have exited are reaped: a zombie would count as alive."""
        reap_adopted(self._children_before | {job.proc.pid} | other_live_jobs(job.proc.pid))
        return group_alive(job.pgid)

    def _stop_leftovers(self, job: Job) -> None:
        """Stop what the attempt left outside its process group: descendants in other sessions, still below
        the job or re-parented to the supervisor since the spawn."""
        others = other_live_jobs(job.proc.pid)
        adopted = children(os.getpid()) - self._children_before - {job.proc.pid} - others
        # Only processes that inherited this attempt's id: children that another supervisor or the embedding
        # program started meanwhile are not this job's leftovers (exited ones are reaped, never signalled).
        reap_adopted(
            self._children_before
            | {job.proc.pid}
            | others
            | {p for p in adopted if carries_attempt(p, self._attempt_token)}
        )
        adopted = {p for p in adopted if carries_attempt(p, self._attempt_token)}
        left = (descendants([job.proc.pid, *adopted]) | adopted) - {job.proc.pid}
        if left:
            killed = stop_processes(left, self.config.grace_period_s, reap=adopted)
            self._log.write(
                "leftovers_stopped", attempt=job.attempt, pids=sorted(left), killed=sorted(killed)
            )

    def _hang_reference(self, job: Job, newest: Heartbeat | None) -> tuple[float, float] | None:
        """Return (time the liveness clock started, its limit in seconds), or None when not armed."""
        cfg = self.config
        if newest is not None:
            return (newest.t, cfg.heartbeat_timeout_s) if cfg.heartbeat_timeout_s is not None else None
        if cfg.startup_timeout_s is not None:
            return job.t_spawn, cfg.startup_timeout_s
        return None

    def _terminate(self, job: Job) -> None:
        """SIGTERM the job's group, SIGKILL it after the grace period, and wait (bounded) until it is gone."""
        grace = self.config.grace_period_s
        deadline = time.monotonic() + grace
        signal_group(job.pgid, signal.SIGTERM)
        while time.monotonic() < deadline:
            if job.done.is_set() and not self._group_alive(job):
                return
            time.sleep(min(0.02, max(0.0, deadline - time.monotonic())))
        signal_group(job.pgid, signal.SIGKILL)
        job.done.wait(5.0)
        end = time.monotonic() + 1.0
        while self._group_alive(job) and time.monotonic() < end:
            time.sleep(0.02)

    def _sleep(self, delay_s: float) -> float:
        """Sleep up to ``delay_s`` seconds, waking early on a stop request; return the time slept."""
        start = time.monotonic()
        end = start + delay_s
        while self._stop_signal is None:
            left = end - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(left, 0.05))
        return time.monotonic() - start

    def _record_recovery(self, pending: PendingRecovery) -> None:
        timing = pending.finish()
        self._recoveries.append(timing)
        self._log.write("recovery", **timing.to_dict())
        self._echo(f"[trainguard] {timing.describe()}")

    def _finish(self, status: str, reason: str | None, exit_code: int | None) -> RunResult:
        if status == "stopped" and self._preempt_signal is not None:
            # The scheduler gave notice: the job was told to save (SIGTERM) and the batch script requeues.
            status, reason, exit_code = "preempted", signal.Signals(self._preempt_signal).name, EXIT_PREEMPTED
            last = self._attempts[-1] if self._attempts else None
            self._log.write(
                "preempted",
                signal=reason,
                exit_code=exit_code,
                job_exit_code=last.exit_code if last else None,
                last_step=last.last_step if last else None,
            )
            self._echo(
                f"[trainguard] preemption notice ({reason}): job stopped, not restarting; exit 75 (requeue)"
            )
        elif status == "stopped":
            signum = self._stop_signal or signal.SIGTERM
            exit_code = EXIT_SIGNAL_BASE + signum
            last = self._attempts[-1] if self._attempts else None
            self._log.write(
                "stop",
                signal=signal.Signals(signum).name,
                exit_code=exit_code,
                job_exit_code=last.exit_code if last else None,
                job_signal=last.signal if last else None,
            )
            self._echo(f"[trainguard] stopped by {signal.Signals(signum).name}: not restarting")
        elif status in ("gave_up", "spawn_failed"):
            hint = self._root_hint() if status == "gave_up" else None
            self._log.write(
                "give_up", reason=reason, exit_code=exit_code, attempts=len(self._attempts), root_hint=hint
            )
            self._echo(f"[trainguard] giving up ({reason}): exit {exit_code}")
            if hint:
                self._echo(f"[trainguard] {hint}")
        return RunResult(
            exit_code=EXIT_SIGNAL_BASE if exit_code is None else exit_code,
            status=status,
            reason=reason,
            run_id=self.run_id,
            root=str(self.root),
            command=self.command,
            attempts=tuple(self._attempts),
            recoveries=tuple(self._recoveries),
            event_log=str(self._log.path),
            error=self._spawn_error,
        )

    def _root_hint(self) -> str | None:
        """When giving up: say that the job never used the run root (its restores were not seen), or None."""
        if self._root_mismatch is not None:
            return (
                f"the job's CheckpointManager wrote {self._root_mismatch}, not the run root {self.root}: this "
                f"supervisor never saw its restores (exit 5 for 'no valid checkpoint' could not fire); rerun with "
                f"--root {self._root_mismatch}, or open the manager with root=os.environ['TRAINGUARD_ROOT']"
            )
        if not self._job_used_root:
            return (
                f"the job never used the run root {self.root} (no event of a CheckpointManager there): if its "
                "checkpoints are elsewhere, pass that root with --root, or open the manager with "
                "root=os.environ['TRAINGUARD_ROOT']"
            )
        return None

    def _install_signal_handlers(self) -> dict[int, Any]:
        if not self.config.forward_signals or threading.current_thread() is not threading.main_thread():
            return {}
        previous: dict[int, Any] = {}
        for sig in TERMINATING_SIGNALS:  # SIGHUP, SIGUSR1, ... would end the supervisor and orphan the job
            if sig in self.config.preempt_signals:
                continue  # a preemption notice, handled below
            try:
                previous[sig] = signal.signal(sig, lambda signum, frame: self.request_stop(signum))
            except (OSError, ValueError):  # pragma: no cover - a signal this platform does not let us catch
                pass
        for notice in self.config.preempt_signals:
            previous[notice] = signal.signal(notice, lambda signum, frame: self.request_preemption(signum))
        return previous
