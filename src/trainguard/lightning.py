"""PyTorch Lightning: a ``CheckpointIO`` plugin that saves Lightning's checkpoints through trainguard.

Lightning's documented extension point for checkpoint storage is ``CheckpointIO``; this plugin implements it over
:class:`~trainguard.CheckpointManager`, so there is no second save path::

    import trainguard as tg
    trainer = Trainer(plugins=[tg.lightning.TrainguardCheckpointIO("ckpts/run1")],
                      callbacks=[ModelCheckpoint(dirpath="ckpts/run1/lightning", every_n_train_steps=50,
                                                 save_last=True)])
    trainer.fit(model, ckpt_path="last")      # newest VALID trainguard checkpoint, or a fresh start

Every checkpoint dict Lightning hands over is saved as the trainguard step ``global_step`` (async, CRC32C,
atomic commit), with the process's RNG states beside it (Lightning does not save them). The file Lightning
names (``epoch=0-step=50.ckpt``, ``last.ckpt``) becomes a small JSON pointer to that step, so Lightning's own
bookkeeping (``save_top_k``, ``ckpt_path="last"``) keeps working; loading never unpickles anything.

Requires the ``lightning`` extra: ``pip install 'trainguard[lightning]'``.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .errors import MissingDependencyError

try:  # the standalone package first (what the extra installs), then the unified ``lightning`` package
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
    from pytorch_lightning.strategies import DDPStrategy as _DDPStrategy
except ImportError:  # pragma: no cover - depends on what is installed
    try:
        from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO  # type: ignore[no-redef]
        from lightning.pytorch.strategies import DDPStrategy as _DDPStrategy  # type: ignore[no-redef]
    except ImportError:
        raise MissingDependencyError(
            "trainguard.lightning needs the optional package 'pytorch_lightning', which is not installed; "
            "install it with `pip install 'trainguard[lightning]'`",
            name="pytorch_lightning",
        ) from None

import torch

from .catalog import is_committed
from .errors import CheckpointNotFoundError, ConfigError
from .format import MANIFEST_NAME
from .state.data import ResumableLoader as _ResumableLoader
from .storage.local import atomic_write
from .validation.hooks import FINITE_SCOPE_KEY

log = logging.getLogger("trainguard")

POINTER_FORMAT = "trainguard-lightning-pointer"
_LAST = re.compile(r"^last(-v?\d+)?$")  # ModelCheckpoint's CHECKPOINT_NAME_LAST and its versioned variants


def _plain(x: Any) -> Any:
    """Dict subclasses Lightning puts in a checkpoint (``AttributeDict`` hparams) as plain dicts, so they are
    stored as JSON/weights_only values; OrderedDicts stay (weights_only loads them)."""
    if isinstance(x, Mapping) and type(x) not in (dict, OrderedDict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, dict):
        return type(x)((k, _plain(v)) for k, v in x.items())
    if isinstance(x, list):
        return [_plain(v) for v in x]
    if isinstance(x, tuple) and type(x) is tuple:
        return tuple(_plain(v) for v in x)
    return x


def read_pointer(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read the pointer file Lightning knows as a checkpoint path.

    Returns:
        ``{"format", "version", "root", "step"}``.

    Raises:
        CheckpointNotFoundError: no file at ``path``.
        ConfigError: the file is not a trainguard pointer (e.g. a ``torch.save`` Lightning checkpoint, which
            this plugin never unpickles).
    """
    p = Path(path)
    if not p.is_file():
        raise CheckpointNotFoundError(f"no checkpoint file at {p}")
    raw = p.read_bytes()[: 1 << 16]
    try:
        ptr = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        ptr = None
    if not isinstance(ptr, dict) or ptr.get("format") != POINTER_FORMAT or type(ptr.get("step")) is not int:
        raise ConfigError(
            f"{p} is not a trainguard checkpoint pointer (it looks like a plain Lightning/torch.save checkpoint, "
            "which TrainguardCheckpointIO never unpickles); load it without the plugin, or resume from a "
            "checkpoint written by TrainguardCheckpointIO"
        )
    return ptr


class TrainguardCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` that stores checkpoints in a trainguard run root.

    Lightning calls ``save_checkpoint`` from ``ModelCheckpoint`` (or ``trainer.save_checkpoint``) with its
    checkpoint dict (``state_dict``, ``optimizer_states``, ``lr_schedulers``, ``loops``, ``callbacks``, ...); the
    dict is saved as the trainguard step ``checkpoint["global_step"]`` together with ``tg.RNGState()``, and
    ``path`` receives a JSON pointer ``{"format", "version", "root", "step"}``, written atomically once that save
    has committed (asynchronous saves: from a background thread), so no file Lightning finds names an
    uncommitted checkpoint.

    ``load_checkpoint`` of a ``last*.ckpt`` pointer (what ``ckpt_path="last"`` resolves to) restores the newest
    VALID checkpoint of the root, whatever step the pointer names (a save killed before its commit, or a
    corrupt checkpoint, falls back to the previous one); any other pointer restores exactly its step. RNG
    states are restored too. The data position is Lightning's own: a train dataloader with
    ``state_dict()``/``load_state_dict()`` (``tg.lightning.LightningLoader``) is saved inside ``loops`` and restored
    mid-epoch.

    ``remove_checkpoint`` (``save_top_k``) removes the pointer only; the trainguard checkpoints follow ``keep``.

    Args:
        root: the trainguard run root (a local directory; created if missing). Need not be the directory
            ``ModelCheckpoint`` writes its pointers to.
        keep: trainguard retention (an int N keeps the newest N valid checkpoints, a RetentionPolicy, or None to
            keep all, the default); the newest valid checkpoint is never deleted.
        rng: save and restore the RNG states (Python, numpy, torch CPU and CUDA) with each checkpoint.
        check_finite_entries: the entries of Lightning's checkpoint dict that the manager's ``check_finite``
            scans for NaN/Inf (at save and after a restore): the training state, ``("state_dict",
            "optimizer_states")`` by default. The other entries are bookkeeping where an infinity is legitimate
            (``ModelCheckpoint``'s ``kth_value``/``best_model_score`` start at +-inf, ``ReduceLROnPlateau``'s
            ``best`` too) and are not scanned. None: scan every entry. ``check_finite="off"`` (a manager
            option) turns the check off.
        **manager_kwargs: more :class:`~trainguard.CheckpointManager` options (``async_save``, ``durability``,
            ``chunk_size_bytes``, ...).

    Raises:
        ConfigError: (at the first save or load) used under a multi-process strategy other than
            :class:`TrainguardDDPStrategy`: Lightning's strategies save from rank 0 alone, while trainguard's
            distributed save is collective. FSDP/DeepSpeed are not supported yet.

    The manager (and its write lock on ``root``) is created at the first save or load and closed by Lightning's
    ``teardown`` at the end of ``fit``, which waits for pending asynchronous saves.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        keep: Any = None,
        rng: bool = True,
        check_finite_entries: Sequence[str] | None = ("state_dict", "optimizer_states"),
        **manager_kwargs: Any,
    ) -> None:
        super().__init__()
        if isinstance(root, str) and "://" in root:
            raise ConfigError(f"{root!r}: only local directories are supported as run roots so far")
        self.root = Path(root)
        self.keep = keep
        self.rng = bool(rng)
        if isinstance(check_finite_entries, str):
            raise ConfigError(
                f"check_finite_entries takes a sequence of entry names, e.g. ('state_dict',), not the string "
                f"{check_finite_entries!r}"
            )
        self.check_finite_entries = None if check_finite_entries is None else tuple(check_finite_entries)
        self.manager_kwargs = dict(manager_kwargs)
        self._mgr: Any = None
        self._saved: dict[int, tuple[str, Any]] = {}  # step -> (training position key, PendingSave)
        self._pointers: queue.Queue[Any] = queue.Queue()
        self._pointer_thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._cancelled: set[Path] = set()  # removed by Lightning before their save committed
        self.all_ranks = False  # set by TrainguardDDPStrategy: every rank calls save/load (collective)

    @property
    def manager(self) -> Any:
        """The :class:`~trainguard.CheckpointManager` of ``root`` (created on first use)."""
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and not self.all_ranks:
            raise ConfigError(
                "TrainguardCheckpointIO under a multi-process strategy needs "
                "strategy=tg.lightning.TrainguardDDPStrategy(): Lightning's own strategies save from rank 0 only, "
                "while trainguard's distributed save is collective (every rank takes part); FSDP/DeepSpeed are "
                "not supported yet (use tg.CheckpointManager with tg.ModelOptimizerState in a plain loop)"
            )
        if self._mgr is None:
            from .manager import CheckpointManager

            mgr: Any = CheckpointManager(self.root, keep=self.keep, **self.manager_kwargs)
            mgr.check_finite_only = (  # the training state only (see check_finite_entries); None: everything
                None
                if self.check_finite_entries is None
                else tuple(f"lightning.{e}" for e in self.check_finite_entries)
            )
            self._mgr = mgr
        return self._mgr

    def _state(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        from .state.rng import RNGState

        state: dict[str, Any] = {"lightning": checkpoint}
        if self.rng:
            state["rng"] = RNGState()
        return state

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        """Save ``checkpoint`` as trainguard step ``checkpoint["global_step"]``; write a pointer at ``path``.

        Lightning often saves the same training position twice in one hook (a top-k file and ``last.ckpt``):
        the second time only the pointer is written. A different position at a step already saved (an
        end-of-epoch save after a batch-end save) replaces that step once the earlier save has committed.

        Args:
            checkpoint: Lightning's checkpoint dict (tensors on any device; values plain Python).
            path: the file Lightning names; receives the pointer.
            storage_options: not supported (must be None).

        Raises:
            ConfigError: ``storage_options`` given, the checkpoint has no ``global_step``, or a value cannot be
                stored without pickle (the message names it).
            SaveError: the save failed (also raised later, by the next save or ``teardown``, for async saves);
                earlier checkpoints are intact.
        """
        if storage_options is not None:
            raise ConfigError(
                "TrainguardCheckpointIO does not take storage_options; pass CheckpointManager options to the "
                "plugin instead"
            )
        step = checkpoint.get("global_step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise ConfigError(f"Lightning checkpoint without an int 'global_step' (got {step!r})")
        key = json.dumps(
            [checkpoint.get("epoch"), checkpoint.get("loops")], sort_keys=True, default=repr
        )  # the training position; the callbacks' own bookkeeping may differ between two saves of it
        mgr = self.manager
        previous = self._saved.get(step)
        if previous is None or previous[0] != key:
            state = self._state(_plain(checkpoint))
            scope = mgr.check_finite_only
            # recorded with the checkpoint: any reader's scan after load covers the same entries
            meta = None if scope is None else {FINITE_SCOPE_KEY: list(scope)}
            if previous is None:
                committed = is_committed(self.root, step)  # e.g. before a crash
                handle = mgr.save(
                    step, state, metrics=_metrics(checkpoint), metadata=meta, overwrite=committed
                )
            else:
                mgr.wait()
                handle = mgr.save(step, state, metrics=_metrics(checkpoint), metadata=meta, overwrite=True)
            self._saved[step] = (key, handle)
        else:
            handle = previous[1]
        if _rank() != 0:
            return  # the pointers are rank 0's (one file per checkpoint on a shared filesystem)
        ptr = {"format": POINTER_FORMAT, "version": 1, "root": str(self.root.resolve()), "step": step}
        data = json.dumps(ptr).encode() + b"\n"
        if _LAST.match(Path(path).stem) and (
            mgr.saves or next(self.root.glob(f"step-*/{MANIFEST_NAME}"), None)
        ):
            # ``last`` loads the newest valid checkpoint whatever step it names: publish it now, so a crash
            # before this save commits still resumes from the previous one
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            atomic_write(Path(path), data, fsync=mgr.fsync)
        with self._lock:
            self._cancelled.discard(Path(path))
        self._pointers.put((handle, Path(path), data, mgr.fsync))
        if self._pointer_thread is None or not self._pointer_thread.is_alive():
            self._pointer_thread = threading.Thread(
                target=self._write_pointers, name="trainguard-lightning-pointers", daemon=True
            )
            self._pointer_thread.start()

    def _write_pointers(self) -> None:
        """Publish each pointer once its save has committed, in save order, so a file Lightning finds (and
        ``ckpt_path="last"``) never names a checkpoint that was not committed. A failed save gets no pointer
        (its error is raised by the manager)."""
        while True:
            job = self._pointers.get()
            try:
                if job is None:
                    return
                handle, path, data, fsync = job
                handle._event.wait()
                if handle.error is not None or handle.skipped:
                    continue
                with self._lock:  # remove_checkpoint of a pointer not yet written cancels it
                    if path in self._cancelled:
                        continue
                    path.parent.mkdir(parents=True, exist_ok=True)
                    atomic_write(path, data, fsync=fsync)
            except OSError as e:  # one failed pointer must not stop the later ones
                log.error("could not write the checkpoint pointer %s: %s", job[1], e)
            finally:
                self._pointers.task_done()

    def wait(self) -> None:
        """Block until every pending save has committed and its pointer file is written.

        Raises:
            SaveError: a background save failed.
        """
        if self._mgr is not None:
            self._mgr.wait()
        if self._pointer_thread is not None:
            self._pointers.join()

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Load the checkpoint a pointer names (``last*.ckpt``: the newest valid one) and restore RNG states.

        Args:
            path: a pointer written by :meth:`save_checkpoint`.
            map_location: a device (or str) to move the tensors to; tensors load on the CPU otherwise.
            weights_only: ignored: nothing is ever unpickled (values are JSON or ``weights_only`` loads).

        Returns:
            Lightning's checkpoint dict.

        Raises:
            CheckpointNotFoundError: no pointer at ``path``, or its step has no committed checkpoint.
            NoValidCheckpointError: ``last``: checkpoints exist but none is valid.
            CorruptCheckpointError: a specific step failed its CRC32C check (never loaded).
            ConfigError: ``path`` is not a trainguard pointer.
        """
        from .catalog import read_manifest

        ptr = read_pointer(path)
        mgr = self.manager
        step = int(ptr["step"])
        if _LAST.match(Path(path).stem):
            latest = _latest_valid(mgr)
            if latest is None:
                raise CheckpointNotFoundError(
                    f"{path} points to {self.root}, which holds no committed checkpoint"
                )
            if latest != step:
                log.warning(
                    "%s names step %d; resuming from the newest valid checkpoint, step %d", path, step, latest
                )
            step = latest
        state: dict[str, Any] = {"lightning": {}}
        if self.rng and "rng" in read_manifest(self.root, step).top_level:
            from .state.rng import RNGState

            state["rng"] = RNGState()
        if _LAST.match(Path(path).stem):
            restored = mgr.restore_latest(state)  # falls back past a checkpoint that fails its CRC32C on read
            assert restored is not None
        else:
            mgr.restore(step, state)
        ckpt: dict[str, Any] = state["lightning"]
        if map_location is not None and not callable(map_location) and not isinstance(map_location, dict):
            ckpt = _to_device(ckpt, torch.device(map_location))
        return ckpt

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer at ``path`` (``save_top_k``); trainguard's checkpoints follow ``keep``."""
        p = Path(path)
        with self._lock:
            self._cancelled.add(p)  # a pointer still waiting for its commit is not written
            try:
                read_pointer(p)
            except CheckpointNotFoundError:
                return
            p.unlink()

    def teardown(self) -> None:
        """Wait for pending saves and release the root (Lightning calls this at the end of ``fit``).

        Raises:
            SaveError: a background save failed.
        """
        mgr, self._mgr = self._mgr, None
        self._saved.clear()
        try:
            if mgr is not None:
                mgr.close()
        finally:
            if self._pointer_thread is not None:
                self._pointers.put(None)
                self._pointer_thread.join()
                self._pointer_thread = None


class TrainguardDDPStrategy(_DDPStrategy):  # type: ignore[misc]
    """Lightning's ``DDPStrategy`` with checkpoint saves on every rank, for :class:`TrainguardCheckpointIO`.

    Lightning's strategies call ``CheckpointIO.save_checkpoint`` on global rank 0 only; trainguard's save under
    torch.distributed is collective (every rank writes its part and the commit is one for all ranks), so this
    strategy hands every save to the plugin on every rank. Each rank saves its own RNG states
    (``tg.RNGState`` keys them by rank) and its own data position; the replicated model and optimizer states
    are written once. Pointer files are written by rank 0, and ``ckpt_path="last"`` restores the newest valid
    checkpoint on every rank (each rank gets its own RNG states back)::

        trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=tg.lightning.TrainguardDDPStrategy(),
                             plugins=[tg.lightning.TrainguardCheckpointIO("ckpts/run1")], ...)

    Takes ``DDPStrategy``'s arguments (``process_group_backend``, ``timeout``, ...).

    Raises:
        ConfigError: (at the first save or load) the strategy's ``checkpoint_io`` is not a
            ``TrainguardCheckpointIO``.
    """

    def _trainguard_io(self) -> TrainguardCheckpointIO:
        io = self.checkpoint_io
        if not isinstance(io, TrainguardCheckpointIO):
            raise ConfigError(
                "TrainguardDDPStrategy saves through tg.lightning.TrainguardCheckpointIO; pass it as "
                f"plugins=[tg.lightning.TrainguardCheckpointIO(root)] (got {type(io).__name__})"
            )
        io.all_ranks = True
        return io

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Save on every rank (collective); see :meth:`TrainguardCheckpointIO.save_checkpoint`."""
        self._trainguard_io().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        """Load on every rank (collective); see :meth:`TrainguardCheckpointIO.load_checkpoint`."""
        return self._trainguard_io().load_checkpoint(checkpoint_path, weights_only=weights_only)


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


class LightningLoader(_ResumableLoader):
    """``tg.ResumableLoader`` for Lightning's ``train_dataloader``: the same arguments and saved position.

    Lightning ends an epoch by counting ``len(loader)`` batches rather than by exhausting the iterator, so the
    plain loader would never see its epoch end and would yield an empty next epoch. This one starts the next
    epoch at the next ``iter()`` once the current one is fully consumed. Lightning does not fetch ahead from a
    loader with a length, so the position it saves in the checkpoint's ``loops`` (``state_dict()``: epoch and
    samples delivered) is exactly the samples trained on, and it is restored mid-epoch on resume.
    """

    def __iter__(self) -> Any:
        s = self.sampler
        if len(s) == 0 or (self.drop_last and len(s) < self.batch_size):  # ended by count: start the next one
            s.epoch, s.start = s.epoch + 1, 0
        return super().__iter__()


def _latest_valid(mgr: Any) -> int | None:
    valid = [i.step for i in mgr.checkpoints() if i.usable]  # what restore_latest would use
    return max(valid) if valid else None


def _metrics(checkpoint: Mapping[str, Any]) -> dict[str, float]:
    """The monitored value of each ``ModelCheckpoint`` state (``current_score``), for ``KeepBest``."""
    out: dict[str, float] = {}
    for state in (checkpoint.get("callbacks") or {}).values():
        if isinstance(state, Mapping) and state.get("monitor") and state.get("current_score") is not None:
            score = state["current_score"]
            out[str(state["monitor"])] = float(score.item() if isinstance(score, torch.Tensor) else score)
    return out


def _to_device(x: Any, device: torch.device) -> Any:
    if isinstance(x, torch.Tensor):
        return x.to(device)
    if isinstance(x, dict):
        return type(x)((k, _to_device(v, device)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return type(x)(_to_device(v, device) for v in x)
    return x


__all__ = ["LightningLoader", "TrainguardCheckpointIO", "TrainguardDDPStrategy", "read_pointer"]
