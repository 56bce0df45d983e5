"""One job across nodes: the run id and the restart budget that every node's ``trainguard run`` shares.

A multi-node job runs one supervisor per node (``trainguard run -- torchrun --nnodes=1:2 ...`` on each), all
on one shared run root. They are one job when they share a run id: given with ``--run-id``, or taken from
torchrun's ``--rdzv-id`` in COMMAND (the id every node of a torchrun job already shares). Supervisors of one
run id:

- tag every event with it, so the merged event log under ``<root>/events/`` is one job's history, each
  supervisor's records also naming its ``host``;
- draw their restarts from one budget of ``max_restarts``: restart k of the job (whichever node makes it) is
  claimed by creating ``<root>/events/restarts/<run id>/restart-<k>.json`` with ``O_CREAT | O_EXCL``, which
  exactly one creator wins, also on NFS. A supervisor whose next claim would exceed ``max_restarts`` gives up
  (exit 3); the job-wide k is the attempt's ``TRAINGUARD_RESTART_COUNT``.

A run id is a path component: 1 to 128 characters of ``A-Z a-z 0-9 . _ -``, not starting with ``.`` or
``-``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Sequence
from pathlib import Path

from ..errors import ConfigError
from .events import EVENTS_DIR

RESTARTS_DIR = "restarts"
_RUN_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_RDZV_ID_FLAGS = ("--rdzv-id", "--rdzv_id")


def validate_run_id(run_id: str, *, origin: str = "--run-id") -> str:
    """Return ``run_id`` if it can name the job's folder, else raise.

    Args:
        run_id: the candidate.
        origin: where it came from, for the message (``--run-id``, ``torchrun --rdzv-id``).

    Raises:
        ConfigError: empty, too long, or with a character outside ``A-Z a-z 0-9 . _ -``.
    """
    if not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id):
        raise ConfigError(
            f"{origin} {run_id!r} cannot be a run id: use 1-128 characters of A-Z a-z 0-9 . _ - that do not "
            "start with '.' or '-' (e.g. the scheduler's job id)"
        )
    return run_id


def run_id_from_command(command: Sequence[str]) -> str | None:
    """The ``--rdzv-id`` of a torchrun COMMAND (``--rdzv-id X``, ``--rdzv-id=X``, ``--rdzv_id``), or None.

    Only torchrun's own options count: the scan stops at the first argument that is not an option of the
    launcher (the training script). torchrun's default id ``none`` counts as absent.

    Raises:
        ConfigError: the id given to torchrun cannot be a run id (see :func:`validate_run_id`).
    """
    value = torchrun_option(command, *_RDZV_ID_FLAGS)
    if value in (None, "", "none"):
        return None
    return validate_run_id(str(value), origin="torchrun --rdzv-id")


SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
"""Set to ``1`` for elastic torchrun jobs: with torch's default (the workers' store shares the c10d
rendezvous store's TCP server) a node joining a running job waits forever for ``MASTER_ADDR`` of the new round
(torch 2.13: both agents fail after the 60 s store timeout). With ``1`` every round gets its own store and
scale-up works."""


def torchrun_option(command: Sequence[str], *names: str) -> str | None:
    """The value of torchrun option ``names`` (``--opt V`` or ``--opt=V``) in COMMAND, or None."""
    args = list(command)
    launcher = os.path.basename(args[0]) if args else ""
    if launcher == "torchrun":
        i = 1
    elif (
        len(args) >= 3
        and args[1] == "-m"
        and args[2] in ("torch.distributed.run", "torch.distributed.launch")
    ):
        i = 3
    else:
        return None
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-"):
            return None  # the training script: its own arguments are not torchrun's
        name, eq, value = arg.partition("=")
        if name in names:
            if not eq:
                value = args[i + 1] if i + 1 < len(args) else ""
            return value
        if not eq and i + 1 < len(args) and not args[i + 1].startswith("-") and not _is_flag(name):
            i += 1  # the option's value
        i += 1
    return None


def is_elastic_torchrun(command: Sequence[str]) -> bool:
    """True when COMMAND is torchrun with a node range (``--nnodes=MIN:MAX``, MIN < MAX): nodes may leave
    and join while it runs."""
    nnodes = torchrun_option(command, "--nnodes")
    if nnodes is None or ":" not in nnodes:
        return False
    low, _, high = nnodes.partition(":")
    return low.strip().isdigit() and high.strip().isdigit() and int(low) < int(high)


_TORCHRUN_FLAGS = {"--standalone", "--no-python", "--no_python", "--module", "-m", "--run-path", "--run_path"}


def _is_flag(name: str) -> bool:
    """torchrun options that take no value (everything else takes one)."""
    return name in _TORCHRUN_FLAGS


class RestartBudget:
    """The job-wide restart budget of one run id, shared by every supervisor on the run root.

    Args:
        root: the run root (shared by the nodes).
        run_id: the job's run id (see :func:`validate_run_id`).
        max_restarts: restarts the whole job may make (>= 0).

    Concurrency: any number of processes on any number of hosts may call :meth:`claim` at once; each
    restart number is won by exactly one of them.
    """

    def __init__(self, root: str | os.PathLike[str], run_id: str, max_restarts: int) -> None:
        self.dir = Path(root) / EVENTS_DIR / RESTARTS_DIR / validate_run_id(run_id)
        self.max_restarts = max_restarts

    def used(self) -> int:
        """Restarts claimed so far by every supervisor of the job."""
        if not self.dir.is_dir():
            return 0
        return sum(1 for p in self.dir.glob("restart-*.json"))

    def claim(self, *, attempt: int) -> int | None:
        """Claim the job's next restart.

        Args:
            attempt: this supervisor's attempt that failed (recorded in the claim file).

        Returns:
            The job-wide restart number k (1-based), or None when the budget is spent (k would exceed
            ``max_restarts``).
        """
        self.dir.mkdir(parents=True, exist_ok=True)
        k = self.used() + 1
        while k <= self.max_restarts:
            path = self.dir / f"restart-{k:06d}.json"
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                k += 1  # another node won this number
                continue
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump({"restart": k, "host": socket.gethostname(), "pid": os.getpid(),
                           "attempt": attempt, "t": time.time()}, fh)  # fmt: skip
            return k
        return None
