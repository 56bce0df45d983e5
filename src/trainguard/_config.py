"""Checking ``CheckpointManager``'s arguments and opening its run root, with errors that name the fix."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._lock import NOT_WRITABLE, RootLock
from .distributed.options import WriterOptions
from .errors import ConfigError, RootLockedError, UnsafeFileError
from .eventlog import EventLog
from .incremental.auto import CompressionChooser
from .incremental.delta import IncrementalState
from .policies import SavePolicy
from .storage.base import Storage
from .storage.local import LocalStorage


def open_storage(
    root: str | os.PathLike[str] | Storage, *, fsync: bool, durability: str, direct_io: bool = True
) -> Storage:
    """The storage of a manager's ``root`` argument.

    Raises:
        ConfigError: a URL (object stores are not run roots yet), an unknown ``durability``, a ``direct_io``
            that is not a bool, or a storage without a local directory.
    """
    if not isinstance(direct_io, bool):  # checked for a Storage root too: "no" must not pass silently
        raise ConfigError(f"direct_io must be True or False, got {direct_io!r}")
    if isinstance(root, str) and "://" in root:
        raise ConfigError(f"{root!r}: only local directories are supported as run roots so far")
    if isinstance(root, (str, os.PathLike)):
        try:
            return LocalStorage(root, fsync=fsync, durability=durability, direct_io=direct_io)
        except ValueError as e:  # the storage checks its own options
            raise ConfigError(str(e)) from None
    if isinstance(root, Storage) and root.local_path is not None:
        return root
    raise ConfigError(
        f"root must be a directory path or a trainguard.storage.Storage with a local directory, got {root!r}"
    )


def check_options(
    *,
    save_policy: Any,
    when_busy: str,
    dist_timeout_s: Any,
    collective: bool | None,
    read_only: bool,
    staging_buffers: int,
    save_timeout_s: Any,
) -> bool:
    """Check the manager's options that do not depend on torch.distributed; returns ``collective`` resolved
    (default: True for a writer, False for a read-only manager).

    Raises:
        ConfigError: naming the argument, the value given and what is accepted.
    """
    if not isinstance(save_policy, SavePolicy):
        raise ConfigError(
            f"save_policy must have should_save()/record_save() (e.g. tg.EveryNSteps(100)), got "
            f"{type(save_policy).__name__}"
        )
    if when_busy not in ("wait", "skip"):
        raise ConfigError(f"when_busy must be 'wait' or 'skip', got {when_busy!r}")
    if dist_timeout_s is not None and (
        isinstance(dist_timeout_s, bool)
        or not isinstance(dist_timeout_s, (int, float))
        or not 0 < dist_timeout_s < float("inf")
    ):
        raise ConfigError(f"dist_timeout_s must be a number of seconds > 0, got {dist_timeout_s!r}")
    if collective is None:
        collective = not read_only
    if not collective and not read_only:
        raise ConfigError(
            "a writing manager must be collective under torch.distributed (every rank writes its shards); "
            "collective=False is for read_only=True"
        )
    if staging_buffers < 1:
        raise ConfigError(f"staging_buffers must be >= 1, got {staging_buffers}")
    if save_timeout_s is not None and not (
        isinstance(save_timeout_s, (int, float))
        and not isinstance(save_timeout_s, bool)
        and save_timeout_s > 0
    ):
        raise ConfigError(f"save_timeout_s must be a number of seconds > 0 or None, got {save_timeout_s!r}")
    return collective


def check_distributed_options(*, dist_enabled: bool, when_busy: str, save_timeout_s: Any) -> None:
    """The options torch.distributed does not support yet.

    Raises:
        ConfigError: ``when_busy='skip'`` or ``save_timeout_s`` under torch.distributed.
    """
    if dist_enabled and when_busy == "skip":
        raise ConfigError(
            "when_busy='skip' is not supported under torch.distributed (ranks could skip "
            "different saves); use 'wait'"
        )
    if save_timeout_s is not None and dist_enabled:
        raise ConfigError(
            "save_timeout_s is not supported under torch.distributed yet (an abandoned save would leave the "
            "ranks' collectives out of step); rely on the supervisor's heartbeat timeout"
        )


def root_problem(root: Path) -> str | None:
    """Why ``root`` cannot be a run root (it exists but is not a directory), or None.

    One ``stat`` decides, so a root another rank creates meanwhile is never taken for a file."""
    try:
        st = os.stat(root)  # follows a symlink to its target
    except FileNotFoundError:
        if os.path.islink(root):
            return (
                f"run root {root} is a symlink to {os.readlink(root)!r}, which does not exist: fix the link "
                "or choose another root"
            )
        return None
    except OSError:
        return None  # the mkdir or the event log that follows reports it
    if stat.S_ISDIR(st.st_mode):
        return None
    if os.path.islink(root):
        return (
            f"run root {root} is a symlink to {os.readlink(root)!r}, which is not a directory: fix the link or "
            "choose another root"
        )
    return f"run root {root} is a file, not a directory: choose another root"


def open_root(root: Path) -> EventLog:
    """Create the run root of a writer (if missing) and its event log, with clear errors for odd roots."""
    problem = root_problem(root)
    if problem is not None:
        raise ConfigError(problem)
    try:
        root.mkdir(parents=True, exist_ok=True)
        return EventLog(root, "manager")
    except UnsafeFileError:
        raise
    except OSError as e:
        why = NOT_WRITABLE.get(e.errno or 0) or f"cannot be written ({e.strerror or e})"
        raise ConfigError(
            f"run root {root} {why}: choose a writable root, or open it with "
            "CheckpointManager(root, read_only=True) to list and restore only"
        ) from None


def save_options(
    *, chunk_size_bytes: int, compression: str, delta: bool, max_chain: int
) -> tuple[WriterOptions, CompressionChooser, IncrementalState]:
    """The writer's chunking options, compression chooser and delta state from the manager's arguments.

    With deltas, tensors of 64 KiB and more get chunks of their own (a delta needs the same piece in the
    previous save; a shared pack of many small tensors changes whenever any of them does).

    Raises:
        ConfigError: a bad ``chunk_size_bytes``, ``compression`` or ``max_chain``, or ``delta`` without
            compression.
    """
    options = WriterOptions(
        chunk_size_bytes=chunk_size_bytes,
        pack_threshold_bytes=min((64 << 10) if delta else (1 << 20), chunk_size_bytes),
    )
    try:
        chooser = CompressionChooser(compression, threads=options.threads)
        if isinstance(max_chain, bool) or not isinstance(max_chain, int):
            raise ValueError(f"max_chain must be an int >= 1, got {max_chain!r}")
        incremental = IncrementalState(delta=bool(delta), max_chain=max_chain)
    except ValueError as e:
        raise ConfigError(f"{e}; see the compression, delta and max_chain arguments") from None
    if delta and compression == "off":
        raise ConfigError("delta=True needs compressed saves; pass compression='auto' or 'zstd'")
    return options, chooser, incremental


def open_writer(
    root: Path,
    dist: Any,
    metrics_registry: Any,
    *,
    cleanup: Callable[[], None],
    name: str | None = None,
) -> tuple[EventLog, Any, RootLock | None]:
    """Open a writer's run root: its event log (with this rank's context), the save metrics listening to it
    and (rank 0) the write lock, cleaning up after a crash (``cleanup``) once the lock is held. ``name``: the
    URL of a URL run root whose local cache ``root`` is (lock errors name it first).

    Returns:
        (event log, :class:`~trainguard.observe.metrics.SaveMetrics`, the lock on rank 0 or None).

    Raises:
        ConfigError, UnsafeFileError: see :func:`open_root`.
        RootLockedError: another process holds the write lock (the event log is closed).
    """
    from .observe.metrics import SaveMetrics

    events = open_root(root)
    metrics = SaveMetrics(metrics_registry)
    events.listeners.append(metrics.observe)
    if dist.enabled:
        events.set_context(rank=dist.rank, world_size=dist.world_size)
    return events, metrics, lock_writer(root, dist, events, cleanup, name)


def check_supervisor_root(root: Path, events: EventLog, url: str | None = None) -> str | None:
    """Under ``trainguard run`` (``$TRAINGUARD_RUN_ID`` set): warn when this writer's run root is not the
    supervisor's (``$TRAINGUARD_ROOT``, its ``--root``), compared as resolved paths (a URL root by the local
    directory that holds its event log).

    The supervisor learns of restores (``restore_failed``: exit 5 at once; the restored step of its TTR report)
    only from the event log of its own root, so a job writing elsewhere burns its restarts. A job may open a
    second writer on purpose (an evaluation root), so this warns, never refuses: a ``RuntimeWarning``, a
    ``root_mismatch`` event in this root's log and one in the supervisor's (which names it when it gives up).

    Args:
        root: this writer's (local) run root.
        events: its event log.
        url: the URL of a URL run root whose local directory ``root`` is.

    Returns:
        The warning text, or None when the roots agree or no supervisor is watching.
    """
    import warnings

    from .recovery.config import ROOT_ENV, RUN_ID_ENV

    sup = os.environ.get(ROOT_ENV)
    if not sup or not os.environ.get(RUN_ID_ENV):
        return None
    try:
        if Path(sup).resolve() == root.resolve():
            return None
    except (OSError, RuntimeError):
        pass
    mine = url or str(root)
    msg = (
        f"trainguard: this CheckpointManager writes the run root {mine}, but `trainguard run` watches {sup} "
        f"($TRAINGUARD_ROOT, its --root): the supervisor does not see this job's restores, so a root with no "
        f"valid checkpoint cannot stop it (exit 5) and its restarts are spent; its report says 'restored step "
        f"unknown'. Fix: run `trainguard run --root {mine} -- ...`, or open the manager with "
        "root=os.environ['TRAINGUARD_ROOT']. (A second manager on purpose, e.g. for evaluation, may ignore this.)"
    )
    warnings.warn(msg, RuntimeWarning, stacklevel=3)
    events.write("root_mismatch", root=mine, supervisor_root=sup)
    try:  # in the supervisor's log too: it reads only its own root
        other = EventLog(Path(sup), "manager")
    except OSError:
        return msg
    try:
        other.write("root_mismatch", root=mine, supervisor_root=sup)
    finally:
        other.close()
    return msg


def lock_writer(
    root: Path, dist: Any, events: EventLog, cleanup: Callable[[], None], name: str | None = None
) -> RootLock | None:
    """One writer per root: rank 0 takes the root's write lock and cleans up after a crash (``cleanup``);
    every rank learns whether it succeeded.

    Returns:
        The held lock on rank 0 (None on the other ranks).

    Raises:
        RootLockedError: another process holds the lock (on every rank; ``events`` is closed first).
    """
    locked, lock = "", None
    if dist.is_coordinator:
        try:
            lock = RootLock(root, name)
            lock.acquire()
            cleanup()
        except RootLockedError as e:
            locked = str(e)
        except BaseException:
            events.close()
            raise
    if dist.enabled and dist.any(bool(locked)):
        events.close()
        raise RootLockedError(locked or f"rank 0 could not lock {root} (another writer holds it)")
    if locked:
        events.close()
        raise RootLockedError(locked)
    return lock


def validation_options(
    *,
    check_finite: str,
    probe: Any,
    probe_rtol: float,
    probe_atol: float,
    trajectory_steps: int,
    scrub_interval_s: float | None,
    scrub_max_bandwidth: float | str | None = None,
) -> dict[str, Any]:
    """Check the validation options (issue 11).

    Returns:
        The options as keyword arguments of :class:`~trainguard.validation.attach.Validation`, with
        ``scrub_max_bandwidth`` in bytes per second (None: uncapped).

    Raises:
        ConfigError: naming the option and what it accepts.
    """
    from .validation import CHECK_FINITE_MODES

    if check_finite not in CHECK_FINITE_MODES:
        raise ConfigError(f"check_finite must be one of {CHECK_FINITE_MODES}, got {check_finite!r}")
    if probe is not None and not callable(probe):
        raise ConfigError(f"probe must be a callable returning a tensor or a dict of tensors, got {probe!r}")
    for name, v in (("probe_rtol", probe_rtol), ("probe_atol", probe_atol)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
            raise ConfigError(f"{name} must be a number >= 0, got {v!r}")
    if isinstance(trajectory_steps, bool) or not isinstance(trajectory_steps, int) or trajectory_steps < 0:
        raise ConfigError(f"trajectory_steps must be an int >= 0 (0: off), got {trajectory_steps!r}")
    if scrub_interval_s is not None and (
        isinstance(scrub_interval_s, bool)
        or not isinstance(scrub_interval_s, (int, float))
        or not 0 < scrub_interval_s < float("inf")
    ):
        raise ConfigError(
            f"scrub_interval_s must be a number of seconds > 0 or None, got {scrub_interval_s!r}"
        )
    return {
        "check_finite": check_finite,
        "probe": probe,
        "probe_rtol": probe_rtol,
        "probe_atol": probe_atol,
        "trajectory_steps": trajectory_steps,
        "scrub_interval_s": scrub_interval_s,
        "scrub_max_bandwidth": scrub_bandwidth(scrub_max_bandwidth),
    }


def scrub_bandwidth(value: float | str | None) -> float | None:
    """``scrub_max_bandwidth`` in bytes per second: a number (bytes per second) or a rate with a unit as
    ``trainguard verify --max-bandwidth`` takes it (``"200MB/s"``, ``"1GiB/s"``); None is uncapped.

    Raises:
        ConfigError: not a finite rate > 0 (naming the accepted forms).
    """
    if value is None:
        return None
    from .planning.units import parse_bandwidth_bytes_per_s

    fix = "give bytes per second > 0 or a rate such as '200MB/s' (None: uncapped)"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise ConfigError(f"scrub_max_bandwidth must be a number or a string, got {value!r}; {fix}")
    try:
        rate = parse_bandwidth_bytes_per_s(value, what="scrub_max_bandwidth")
    except ConfigError as e:
        raise ConfigError(f"{e}; {fix}") from None
    if not 0 < rate < float("inf"):  # NaN and inf pass the parser's sign check
        raise ConfigError(f"scrub_max_bandwidth must be a finite rate > 0, got {value!r}; {fix}")
    return rate
