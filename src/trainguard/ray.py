"""Ray Train: trainguard checkpoints inside ``TorchTrainer`` workers, reported to Ray without a second copy.

Every worker builds a :class:`~trainguard.CheckpointManager` on a root all workers share, restores the newest
valid checkpoint with ``restore_latest`` (Ray has already initialised torch.distributed, so this works at any
``num_workers``, also one different from the run that saved it) and calls :func:`report` once per step on
every worker::

    def train_loop(config):
        mgr = tg.CheckpointManager(config["root"], save_policy=tg.EveryNSteps(100))
        start = mgr.restore_latest(state) or 0
        for step in range(start + 1, total + 1):
            loss = train_step(...)
            mgr.maybe_save(step, state, force=step == total)
            if step == total:
                mgr.wait()  # so the last report hands the final checkpoint to Ray
            tg.ray.report(mgr, step, {"loss": loss})
        mgr.close()

    TorchTrainer(train_loop, train_loop_config={"root": "/shared/ckpts/run1"},
                 scaling_config=ScalingConfig(num_workers=4),
                 run_config=RunConfig(failure_config=FailureConfig(max_failures=3))).fit()

When Ray restarts the worker group after a failure (``FailureConfig(max_failures=...)``), the new workers run
``train_loop`` again and ``restore_latest`` resumes from the newest valid trainguard checkpoint. Ray's result
metrics carry ``trainguard_step`` (the newest committed trainguard step) and ``trainguard_root``, and each newly
committed step is reported once (by rank 0) as a *pointer* ``ray.train.Checkpoint``: a directory holding only
``trainguard_checkpoint.json`` (``{"root", "step", "manifest"}``), Ray's documented pattern for checkpoints
stored elsewhere. Ray's view of the checkpoints (``result.checkpoint``, ``best_checkpoints``) stays meaningful
while the tensor bytes are written once, by trainguard.

Needs the ``ray`` extra: ``pip install 'trainguard[ray]'``.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._optional import require
from .errors import ConfigError
from .format.layout import MANIFEST_NAME, as_step, parse_step_dir, step_dir_name

if TYPE_CHECKING:
    from .manager import CheckpointManager

STEP_KEY = "trainguard_step"
"""Metric key of the newest committed trainguard step in every report (None before the first commit)."""
ROOT_KEY = "trainguard_root"
"""Metric key of the run root holding that checkpoint."""
POINTER_NAME = "trainguard_checkpoint.json"
"""The file of the pointer checkpoint reported to Ray: ``{"root", "step", "manifest"}`` (no tensor bytes)."""

_reported: dict[str, int] = {}  # root -> newest step already handed to Ray as a pointer checkpoint


def _ray_train() -> Any:
    return require("ray.train", feature="trainguard.ray (Ray Train)")


def committed_step(root: str | os.PathLike[str]) -> int | None:
    """The newest step under ``root`` whose manifest is published (the commit), or None.

    One directory listing: it never waits for a save in flight and reads no chunk, so an async save still
    persisting is reported once it commits, at a later step. ``trainguard verify`` checks the data itself.
    """
    steps = []
    try:
        names = os.listdir(root)
    except OSError:
        return None
    for name in names:
        parsed = parse_step_dir(name)
        if parsed is not None and not parsed[1] and os.path.exists(os.path.join(root, name, MANIFEST_NAME)):
            steps.append(parsed[0])
    return max(steps) if steps else None


def report(manager: CheckpointManager, step: int, metrics: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Report ``step``'s metrics to Ray Train with the newest committed trainguard checkpoint's step and root.

    Call on every worker at the same steps (Ray Train expects every worker to report). Nothing is copied: the
    checkpoint stays where trainguard committed it.

    Args:
        manager: the worker's manager (its root is reported).
        step: the step just done (int >= 0), reported as ``step``.
        metrics: JSON-able numbers of the step (e.g. ``{"loss": 0.31}``).

    Returns:
        The metrics dict given to ``ray.train.report``: ``metrics`` plus ``step``, :data:`STEP_KEY` (the newest
        committed step: see :func:`committed_step`) and :data:`ROOT_KEY`.

    Raises:
        MissingDependencyError: Ray Train is not installed (names ``pip install 'trainguard[ray]'``).
        ConfigError: a metric uses a reserved key, or ``step`` is not an int in ``[0, 2**62]``.
    """
    step = as_step(step)
    train = _ray_train()
    out = dict(metrics or {})
    clash = {"step", STEP_KEY, ROOT_KEY} & set(out)
    if clash:
        raise ConfigError(f"metrics keys {sorted(clash)} are set by trainguard.ray.report; rename them")
    newest = committed_step(manager.root)
    out.update({"step": step, STEP_KEY: newest, ROOT_KEY: str(manager.root)})
    key = str(Path(manager.root).absolute())
    if newest is None or _reported.get(key) == newest or train.get_context().get_world_rank() != 0:
        train.report(out)
        return out
    # A pointer checkpoint (Ray's documented pattern for checkpoints stored elsewhere): Ray keeps its own
    # record of each committed step, and copies only this small JSON, never the checkpoint's bytes.
    with tempfile.TemporaryDirectory(prefix="trainguard-ray-") as tmp:
        pointer = {"root": key, "step": newest, "manifest": f"{step_dir_name(newest)}/{MANIFEST_NAME}"}
        (Path(tmp) / POINTER_NAME).write_text(json.dumps(pointer))
        train.report(out, checkpoint=train.Checkpoint.from_directory(tmp))
    _reported[key] = newest
    return out
