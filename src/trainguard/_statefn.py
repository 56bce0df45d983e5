"""Collecting state for a save and applying loaded state on restore (the Stateful protocol of torch DCP).

Restore loads what was *saved*, not only what the live object happens to contain: the load template is built
from the manifest, reusing the live tensor wherever one exists with the same FQN and shape (so parameters are
filled in place and tied weights stay tied) and allocating a new tensor for every saved entry the live object
lacks (e.g. the ``exp_avg`` of an optimizer that has not stepped yet, a data loader's grown state). The nested
result is then handed to ``load_state_dict``.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from .errors import ConfigError, StateMismatchError
from .format import Manifest, TensorEntry
from .state.dtypes import dtype_from_name
from .state.flatten import PathT, flatten, fqn_of, unflatten
from .state.per_rank import PerRank, job_rank, plan_load, saved_by_rank


def is_stateful(obj: Any) -> bool:
    return (
        not isinstance(obj, (torch.Tensor, Mapping, list, tuple))
        and callable(getattr(obj, "state_dict", None))
        and callable(getattr(obj, "load_state_dict", None))
    )


STATEFUL_DATALOADER_WARNING = (
    "torchdata StatefulDataLoader with a shuffling sampler: resuming mid-epoch continues that epoch correctly, "
    "but torchdata 0.11 shuffles the FOLLOWING epochs differently from an uninterrupted run (and drifts further "
    "with every resume). For bit-exact resume across epochs use trainguard.ResumableLoader, or accept the drift."
)
_warned_stateful_loader = False


def _warn_if_unsafe_loader(obj: Any) -> None:
    global _warned_stateful_loader
    if _warned_stateful_loader or not type(obj).__module__.startswith("torchdata.stateful_dataloader"):
        return
    sampler = getattr(obj, "sampler", None)
    if type(sampler).__name__ == "RandomSampler":
        _warned_stateful_loader = True
        warnings.warn(STATEFUL_DATALOADER_WARNING, UserWarning, stacklevel=4)


def collect(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, PathT], dict[str, dict[str, Any]]]:
    """``state_dict()`` of every Stateful value, then flatten. Returns ``(flat, paths, top_level)``."""
    if not isinstance(state, Mapping):
        raise ConfigError(f"state must be a dict of name -> object, got {type(state).__name__}")
    resolved: dict[str, Any] = {}
    top: dict[str, dict[str, Any]] = {}
    for k, v in state.items():
        if is_stateful(v):
            inner = v.obj if isinstance(v, PerRank) else v
            _warn_if_unsafe_loader(inner)
            resolved[k] = v.state_dict()
            top[k] = {"stateful": True, "type": f"{type(inner).__module__}.{type(inner).__qualname__}"}
            if isinstance(v, PerRank):
                top[k]["per_rank"] = True
        else:
            resolved[k] = v
            top[k] = {"stateful": False, "type": type(v).__name__}
    flat, paths = flatten(resolved)
    return flat, paths, top


def build_template(
    manifest: Manifest, state: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, PathT], dict[str, list[str]]]:
    """The flat ``{fqn: destination}`` DCP loads into, the saved paths of the entries handed to the state, and
    the per-rank entries each PerRank-resharded top-level key needs (see :func:`per_rank.plan_load`).

    Per-rank entries: at the saved world size only this rank's own are loaded (under their logical path);
    at another world size every rank's are loaded for a ``PerRank(obj, reshard=fn)`` hook.

    Raises:
        StateMismatchError: a requested top-level key is not in the checkpoint, a live tensor has a
            different shape than the saved one, or per-rank values would need a reshard hook that is missing.
    """
    skip, reshard = plan_load(manifest, state)
    resharded = {f for fqns in reshard.values() for f in fqns}
    saved_top: dict[str, list[str]] = {}
    for fqn, e in manifest.entries.items():
        tag, key = e.path[0]
        saved_top.setdefault(str(key), []).append(fqn)
    template: dict[str, Any] = {}
    paths: dict[str, PathT] = {}
    for k, obj in state.items():
        if k not in saved_top:
            raise StateMismatchError(
                f"the checkpoint of step {manifest.step} has no state entry {k!r} (it holds "
                f"{sorted(saved_top)}); remove {k!r} from the state passed to restore, or restore a checkpoint "
                "saved with it"
            )
        live = obj.state_dict() if is_stateful(obj) else obj
        live_flat, _ = flatten({k: live})
        for fqn in saved_top[k]:
            if fqn in skip:
                continue
            e = manifest.entries[fqn]
            if fqn not in resharded:
                paths[fqn] = e.path
            if isinstance(e, TensorEntry):
                if fqn in resharded:  # every saved rank's value: each needs a buffer of its own
                    cur = None
                elif (
                    e.rank is not None
                ):  # this rank's own value of a per-rank leaf: the live one has its path
                    cur = live_flat.get(fqn_of(e.path))
                else:
                    cur = live_flat.get(fqn)
                if isinstance(cur, torch.Tensor):
                    if tuple(cur.shape) != tuple(e.shape):
                        raise StateMismatchError(
                            f"{fqn!r}: checkpoint of step {manifest.step} has shape {tuple(e.shape)} but the live "
                            f"tensor has {tuple(cur.shape)}; build the model with the configuration it was saved with"
                        )
                    template[fqn] = cur
                else:
                    template[fqn] = torch.empty(e.shape, dtype=dtype_from_name(e.dtype))
            else:
                template[fqn] = None
    return template, paths, reshard


def apply(
    loaded_flat: Mapping[str, Any],
    paths: Mapping[str, PathT],
    state: MutableMapping[str, Any],
    step: int,
    manifest: Manifest | None = None,
    reshard: Mapping[str, list[str]] | None = None,
) -> None:
    """Hand loaded values to the live state: ``load_state_dict`` for Stateful objects, in-place updates of
    dicts/lists, replacement of immutable values. Top-level keys in ``reshard`` get what their PerRank hook
    returns from every saved rank's state."""
    nested = unflatten(loaded_flat, paths)
    for k, fqns in (reshard or {}).items():
        assert manifest is not None
        obj = state[k]
        assert isinstance(obj, PerRank) and obj.reshard is not None
        rank, ws = job_rank()
        nested[k] = obj.reshard(saved_by_rank(loaded_flat, paths, fqns, manifest, k), rank, ws)
    for k in list(state.keys()):
        obj = state[k]
        new = nested[k]
        if is_stateful(obj):
            try:
                obj.load_state_dict(new)
            except (RuntimeError, KeyError, ValueError, TypeError) as e:
                raise StateMismatchError(
                    f"{k}.load_state_dict() rejected the checkpoint of step {step}: {e}"
                ) from e
        elif isinstance(obj, torch.Tensor):
            if new is not obj:
                with torch.no_grad():
                    obj.copy_(new)
        elif isinstance(obj, (dict, list)):
            _merge(obj, new, state, k)
        else:
            state[k] = new


def _merge(live: Any, new: Any, parent: Any, key: Any) -> None:
    if isinstance(live, dict) and isinstance(new, dict):
        for kk, vv in new.items():
            if kk in live and live[kk] is vv:
                continue
            if kk in live and isinstance(live[kk], (dict, list)):
                _merge(live[kk], vv, live, kk)
            else:
                live[kk] = vv
    elif isinstance(live, list) and isinstance(new, list) and len(live) == len(new):
        for i, vv in enumerate(new):
            if live[i] is vv:
                continue
            if isinstance(live[i], (dict, list)):
                _merge(live[i], vv, live, i)
            else:
                live[i] = vv
    else:
        parent[key] = new
