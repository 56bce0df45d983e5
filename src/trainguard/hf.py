"""Hugging Face Transformers: a ``Trainer`` that saves and resumes its checkpoints through trainguard.

The Trainer's resume (start epoch, batches to skip, RNG reload point) is driven by a ``resume_from_checkpoint``
*directory*, so a ``TrainerCallback`` alone cannot resume it. The smallest hook is a subclass (or mixin) that
replaces the Trainer's checkpoint save and the five loaders its resume path calls; everything else, the
training loop included, is the Trainer's own::

    import trainguard as tg
    trainer = tg.hf.TrainguardTrainer(model=model, args=args, train_dataset=ds, trainguard_root="ckpts/run1")
    trainer.train(resume_from_checkpoint=True)  # newest VALID trainguard checkpoint, or a fresh start

Every save the Trainer makes (``save_strategy``/``save_steps``) becomes the trainguard step ``global_step``
(async, CRC32C, atomic commit): model state_dict, optimizer, LR scheduler, gradient scaler, ``TrainerState``
(as its JSON text) and the RNG states (Python, numpy, torch CPU and CUDA). No ``checkpoint-N`` directory and
no pickle file is written; loading never unpickles anything.

With your own Trainer subclass (``Seq2SeqTrainer``, TRL's trainers, ...) put the mixin first::

    class MyTrainer(tg.hf.TrainguardMixin, Seq2SeqTrainer): ...

Requires the ``hf`` extra: ``pip install 'trainguard[hf]'``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
from collections.abc import Mapping
from typing import Any

from ._optional import require

require("transformers", feature="trainguard.hf")
require("accelerate", feature="trainguard.hf (the Trainer needs accelerate)")

from transformers import Trainer as _Trainer  # noqa: E402
from transformers import TrainerCallback as _TrainerCallback  # noqa: E402

from .errors import ConfigError  # noqa: E402
from .format import MANIFEST_NAME, step_dir_name  # noqa: E402

log = logging.getLogger("trainguard")

TRAINER_STATE_NAME = "trainer_state.json"  # the one file the Trainer's resume reads from its directory


class TrainguardMixin:
    """Mixin for a ``transformers.Trainer`` (sub)class: checkpoints go to a trainguard run root.

    Keyword args (the Trainer's own arguments pass through unchanged):
        trainguard_root: the trainguard run root (a local directory; created at the first ``train()``).
        trainguard_keep: trainguard retention (an int N keeps the newest N valid checkpoints, or a
            RetentionPolicy); default: ``args.save_total_limit`` (None: keep all). The newest valid checkpoint
            is never deleted.
        trainguard_options: more :class:`~trainguard.CheckpointManager` options (``async_save``,
            ``durability``, ``chunk_size_bytes``, ``save_on_preemption``, ...) as a dict; not ``save_policy``
            (the Trainer's ``save_strategy`` decides when to save). With ``save_on_preemption=True`` a
            preemption notice makes the Trainer save the step it is at and stop, and ``train()`` exits 75.

    ``train(resume_from_checkpoint=...)``:
        ``True``: the newest VALID checkpoint of the root (a save killed before its commit, or a checkpoint that
        fails its CRC32C check, falls back to the previous one); a fresh start when the root holds none (so the
        same command serves the first attempt and every restart). An ``int``: exactly that step. A ``str``: a
        Trainer ``checkpoint-N`` directory, loaded by the Trainer's own code (to migrate a run); later saves
        go to trainguard. ``None``/``False``: a fresh start.

    Raises:
        ConfigError: (at ``train()``) a setup the hook does not support yet: more than one process (DDP,
            FSDP, DeepSpeed), ``load_best_model_at_end``, ``save_only_model``, ``push_to_hub``, a hyperparameter
            search trial; (at construction) a run root that is a URL, or a ``save_policy`` option.
    """

    args: Any  # the Trainer's TrainingArguments

    def __init__(
        self,
        *args: Any,
        trainguard_root: str | os.PathLike[str],
        trainguard_keep: Any = None,
        trainguard_options: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(trainguard_root, str) and "://" in trainguard_root:
            raise ConfigError(
                f"{trainguard_root!r}: only local directories are supported as run roots so far"
            )
        self.trainguard_root = os.fspath(trainguard_root)
        self.trainguard_keep = trainguard_keep
        self.trainguard_options = dict(trainguard_options or {})
        if "save_policy" in self.trainguard_options:
            raise ConfigError(
                "trainguard_options takes no save_policy: the Trainer's save_strategy/save_steps decide when to save"
            )
        self.add_callback(_StepHook(self))  # type: ignore[attr-defined]
        self._tg_manager: Any = None
        self._tg_resume: dict[str, Any] | None = None  # the restored checkpoint while train() resumes from it
        self._tg_preempted = False  # a preemption notice stopped train() after saving

    # ---- the manager -------------------------------------------------------------------------------------

    @property
    def trainguard_manager(self) -> Any:
        """The :class:`~trainguard.CheckpointManager` of ``trainguard_root`` (open during ``train()``)."""
        if self._tg_manager is None:
            from .manager import CheckpointManager

            keep = self.trainguard_keep if self.trainguard_keep is not None else self.args.save_total_limit
            self._tg_manager = CheckpointManager(
                self.trainguard_root, keep=keep, save_policy=_TrainerDecides(), **self.trainguard_options
            )
        return self._tg_manager

    def _tg_check_supported(self, trial: Any) -> None:
        a = self.args
        problems = []
        if (
            a.world_size > 1
            or getattr(self, "is_deepspeed_enabled", False)
            or getattr(self, "is_fsdp_enabled", False)
        ):
            problems.append(
                "more than one process (DDP/FSDP/DeepSpeed): the Trainer saves from every rank with its own "
                "file layout, while trainguard's distributed save is collective; use tg.CheckpointManager with "
                "tg.ModelOptimizerState in a plain loop"
            )
        if a.load_best_model_at_end:
            problems.append(
                "load_best_model_at_end (it reloads a checkpoint-N directory); use tg.KeepBest retention"
            )
        if a.save_only_model:
            problems.append(
                "save_only_model (a trainguard checkpoint is the full state; export weights with "
                "`trainguard export`)"
            )
        if a.push_to_hub:
            problems.append("push_to_hub (it uploads checkpoint-N directories)")
        if trial is not None or getattr(self, "hp_search_backend", None) is not None:
            problems.append("hyperparameter search trials")
        if problems:
            raise ConfigError("tg.hf.TrainguardTrainer does not support " + "; ".join(problems))

    # ---- train: resume through the Trainer's own path ----------------------------------------------------

    def train(
        self, resume_from_checkpoint: str | bool | int | None = None, trial: Any = None, **kwargs: Any
    ) -> Any:
        """Train, resuming from the trainguard checkpoint ``resume_from_checkpoint`` names (see the class).

        The restored ``TrainerState`` is handed to the Trainer's own resume path (epoch, batches to skip, RNG
        reload point) through a temporary directory that holds only its JSON; the model, optimizer, scheduler,
        scaler and RNG states come from the trainguard checkpoint. Pending saves commit before this returns.

        Returns:
            The Trainer's ``TrainOutput``.

        Raises:
            ConfigError: an unsupported setup (see the class), or ``resume_from_checkpoint`` of another type.
            NoValidCheckpointError: ``True``: the root holds checkpoints but none is valid.
            CheckpointNotFoundError / CorruptCheckpointError: an ``int`` step that is missing or corrupt.
            SaveError: a background save failed.
        """
        self._tg_check_supported(trial)
        resume = resume_from_checkpoint
        if resume is False:
            resume = None
        ok = False
        try:
            self.trainguard_manager  # noqa: B018  (the root's lock, and the preemption handler from the start)
            if resume is True or (isinstance(resume, int) and not isinstance(resume, bool)):
                step = self._tg_restore(None if resume is True else int(resume))
                if step is None:
                    log.info("%s holds no checkpoint; starting a fresh run", self.trainguard_root)
                    out = super().train(resume_from_checkpoint=None, trial=trial, **kwargs)  # type: ignore[misc]
                else:
                    with tempfile.TemporaryDirectory(prefix="trainguard-hf-resume-") as tmp:
                        assert self._tg_resume is not None
                        with open(os.path.join(tmp, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
                            f.write(self._tg_resume["trainer"]["trainer_state"])
                        out = super().train(resume_from_checkpoint=tmp, trial=trial, **kwargs)  # type: ignore[misc]
            elif resume is None or isinstance(resume, (str, os.PathLike)):
                out = super().train(resume_from_checkpoint=resume, trial=trial, **kwargs)  # type: ignore[misc]
            else:
                raise ConfigError(
                    f"resume_from_checkpoint must be True (newest valid trainguard checkpoint), a step (int), a "
                    f"Trainer checkpoint directory (str) or None, got {resume!r}"
                )
            ok = True
        finally:
            self._tg_resume = None
            mgr, self._tg_manager = self._tg_manager, None
            if mgr is not None:
                if ok:
                    mgr.close()  # waits for pending saves; raises a background SaveError
                else:
                    try:
                        mgr.close()
                    except Exception as e:  # the training error is the one to see
                        log.error("closing the checkpoint manager after a failed train(): %s", e)
        if self._tg_preempted:  # the Trainer saved this step and stopped; the save has committed (close)
            from .recovery.heartbeat import exit_after_preemption_save

            self._tg_preempted = False
            exit_after_preemption_save()  # SystemExit(75): `trainguard run` reads "preempted, requeue"
        return out

    def _tg_restore(self, step: int | None) -> int | None:
        """Read checkpoint ``step`` (None: the newest valid one) into ``self._tg_resume``; return its step."""
        from .errors import StateMismatchError

        mgr = self.trainguard_manager
        state: dict[str, Any] = {
            "model": {},
            "trainer": {},
            "rng": {},
        }  # no templates: the saved structure comes back
        try:
            if step is None:
                step = mgr.restore_latest(state)
                if step is None:
                    return None
            else:
                mgr.restore(step, state)
            if not isinstance(state["trainer"].get("trainer_state"), str):
                raise StateMismatchError("no 'trainer_state' in its 'trainer' entry")
        except StateMismatchError as e:
            raise ConfigError(
                f"the checkpoint{'' if step is None else f' of step {step}'} in {self.trainguard_root} was not "
                f"written by tg.hf.TrainguardTrainer ({e}); resume from a root the Trainer wrote, or start a "
                "fresh run in another root"
            ) from e
        self._tg_resume = state
        return step

    # ---- the loaders the Trainer's resume path calls -----------------------------------------------------

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if self._tg_resume is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)  # type: ignore[misc]
        target = model if model is not None else self.model  # type: ignore[attr-defined]
        target.load_state_dict(self._tg_resume["model"])

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if self._tg_resume is None:
            return super()._load_optimizer_and_scheduler(checkpoint)  # type: ignore[misc]
        saved = self._tg_resume["trainer"]
        self.optimizer.load_state_dict(saved["optimizer"])  # type: ignore[attr-defined]
        if saved.get("scheduler") is not None and self.lr_scheduler is not None:  # type: ignore[attr-defined]
            self.lr_scheduler.load_state_dict(saved["scheduler"])  # type: ignore[attr-defined]

    def _load_scaler(self, checkpoint: str | None) -> None:
        if self._tg_resume is None:
            return super()._load_scaler(checkpoint)  # type: ignore[misc]
        scaler = getattr(self.accelerator, "scaler", None)  # type: ignore[attr-defined]
        if scaler is not None and self._tg_resume["trainer"].get("scaler") is not None:
            scaler.load_state_dict(self._tg_resume["trainer"]["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        if self._tg_resume is None:
            return super()._load_rng_state(checkpoint)  # type: ignore[misc]
        # called by the Trainer where its own resume reloads RNG: after the skipped batches were drawn
        if self._tg_resume["rng"]:
            from .state.rng import RNGState

            RNGState().load_state_dict(self._tg_resume["rng"])

    # ---- save ----------------------------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        """Save the Trainer's whole state as trainguard step ``global_step`` (replaces ``checkpoint-N``)."""
        step = int(self.state.global_step)  # type: ignore[attr-defined]
        mgr = self.trainguard_manager
        # a step committed by an attempt that died after it (and was resumed from an older checkpoint) is redone
        committed = os.path.exists(os.path.join(self.trainguard_root, step_dir_name(step), MANIFEST_NAME))
        if committed:
            mgr.wait()
        mgr.save(step, self._tg_state(), metrics=_metrics(self.state), overwrite=committed)  # type: ignore[attr-defined]

    def _tg_state(self) -> dict[str, Any]:
        """The trainguard state of a checkpoint: entries ``model``, ``trainer`` and ``rng``."""
        self.store_flos()  # type: ignore[attr-defined]
        state = self.state  # type: ignore[attr-defined]
        # the stateful callbacks' state goes into TrainerState, as the Trainer's own save does
        from transformers.trainer_callback import ExportableState

        for cb in [c for c in self.callback_handler.callbacks + [self.control]  # type: ignore[attr-defined]
                   if isinstance(c, ExportableState)]:  # fmt: skip
            name = cb.__class__.__name__
            if isinstance(state.stateful_callbacks.get(name), list):
                state.stateful_callbacks[name].append(cb.state())
            else:
                state.stateful_callbacks[name] = cb.state()
        from .state.rng import RNGState

        trainer: dict[str, Any] = {
            "optimizer": self.optimizer.state_dict(),  # type: ignore[attr-defined]
            "scheduler": None if self.lr_scheduler is None else self.lr_scheduler.state_dict(),  # type: ignore[attr-defined]
            "trainer_state": json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n",
        }
        scaler = getattr(self.accelerator, "scaler", None)  # type: ignore[attr-defined]
        if scaler is not None:
            trainer["scaler"] = scaler.state_dict()
        # the weights as the entry ``model``: `trainguard export ROOT --format safetensors OUT` takes them as they are
        return {"model": self.model.state_dict(), "trainer": trainer, "rng": RNGState()}  # type: ignore[attr-defined]


class _TrainerDecides:
    """The manager's save policy under the Trainer: never due (the Trainer's ``save_strategy`` decides)."""

    step_based = True

    def should_save(self, step: int, *, now_s: float) -> bool:
        return False

    def record_save(self, step: int, *, now_s: float, block_s: float, persist_s: float | None) -> None:
        pass


class _StepHook(_TrainerCallback):  # type: ignore[misc]
    """After every optimizer step: ``maybe_save`` with a policy that is never due, so the step beats the
    heartbeat of ``trainguard run`` (hang detection, progress, TTR's first step). With
    ``trainguard_options={"save_on_preemption": True}`` a preemption notice (SIGTERM, ``--preempt-signal``)
    makes the Trainer save this step (after logging it) and stop, and ``train()`` exits 75 once the save has
    committed."""

    def __init__(self, trainer: TrainguardMixin) -> None:
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        from .recovery.heartbeat import heartbeat, preemption_requested

        t = self.trainer
        if t._tg_manager is None:
            return
        if t.trainguard_options.get("save_on_preemption") and preemption_requested():
            # through the Trainer's own save (after it logs this step), then stop; train() exits 75
            heartbeat(int(state.global_step))
            control.should_save = True
            control.should_training_stop = True
            t._tg_preempted = True
            return
        t._tg_manager.maybe_save(int(state.global_step), _Lazy(t._tg_state))


class _Lazy(Mapping[str, Any]):
    """The checkpoint state, built only when ``maybe_save`` reads it (a preemption save), not at every step."""

    def __init__(self, build: Any) -> None:
        self._build = build
        self._state: dict[str, Any] | None = None

    def _get(self) -> dict[str, Any]:
        if self._state is None:
            self._state = self._build()
        return self._state

    def __getitem__(self, key: str) -> Any:
        return self._get()[key]

    def __iter__(self) -> Any:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


def _metrics(state: Any) -> dict[str, float]:
    """The numbers logged at this step (loss, eval metrics), recorded in the manifest for ``tg.KeepBest``."""
    out: dict[str, float] = {}
    for entry in state.log_history:
        if entry.get("step") == state.global_step:
            out.update({k: float(v) for k, v in entry.items()
                        if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"})  # fmt: skip
    return out


class TrainguardTrainer(TrainguardMixin, _Trainer):  # type: ignore[misc]  # train() takes a step too
    """``transformers.Trainer`` whose checkpoints are trainguard checkpoints; see :class:`TrainguardMixin`."""


__all__ = ["TrainguardMixin", "TrainguardTrainer"]
