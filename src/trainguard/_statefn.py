"""Collecting state for a save and applying loaded state on restore (the Stateful protocol of torch DCP).

Restore loads what was *saved*, not only what the live object happens to contain: the load template is built
from the manifest, reusing the live tensor wherever one exists with the same FQN and shape (so parameters are
filled in place and tied weights stay tied) and allocating a new tensor for every saved entry the live object
lacks (e.g. the ``exp_avg`` of an optimizer that has not stepped yet, a data loader's grown state). The nested
result is then handed to ``load_state_dict``.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from .errors import ConfigError, InsufficientMemoryError, SaveError, StateMismatchError
from .format import Manifest, TensorEntry
from .state.dtypes import dtype_from_name
from .state.flatten import PathT, flatten, unflatten


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
            _warn_if_unsafe_loader(v)
            resolved[k] = v.state_dict()
            top[k] = {"stateful": True, "type": f"{type(v).__module__}.{type(v).__qualname__}"}
        else:
            resolved[k] = v
            top[k] = {"stateful": False, "type": type(v).__name__}
    flat, paths = flatten(resolved)
    return flat, paths, top


def check_savable(flat: Mapping[str, Any], step: int) -> None:
    """Refuse tensors no checkpoint can hold as they are, with the fix, before anything is staged or written
    (the same error in synchronous and asynchronous saves).

    Raises:
        SaveError: a sparse, quantized, nested or meta tensor (naming the entry and what to save instead).
    """
    for fqn, t in flat.items():
        if not isinstance(t, torch.Tensor):
            continue
        problem = None
        if t.is_nested:
            problem = "a nested tensor; save its unbind() list of tensors instead"
        elif t.layout != torch.strided:
            problem = (
                f"a {str(t.layout).removeprefix('torch.')} tensor; save t.to_dense(), or its indices() and "
                "values() as separate tensors"
            )
        elif t.is_quantized:
            problem = "a quantized tensor; save t.int_repr() with t.q_scale() and t.q_zero_point(), or t.dequantize()"
        elif t.device.type == "meta":
            problem = "a tensor on the meta device (it has no data); materialize it (to_empty + init) first"
        if problem is not None:
            raise SaveError(
                f"cannot save step {step}: state entry {fqn!r} is {problem}; nothing was written",
                step=step,
            )


def build_template(manifest: Manifest, state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, PathT]]:
    """The flat ``{fqn: destination}`` DCP loads into, and the saved paths of those entries.

    Raises:
        StateMismatchError: a requested top-level key is not in the checkpoint, or a live tensor has a
            different shape than the saved one.
        InsufficientMemoryError: the tensors to allocate (saved entries the live state lacks) need more
            memory than is available; nothing is allocated.
    """
    saved_top: dict[str, list[str]] = {}
    for fqn, e in manifest.entries.items():
        tag, key = e.path[0]
        saved_top.setdefault(str(key), []).append(fqn)
    template: dict[str, Any] = {}
    paths: dict[str, PathT] = {}
    fresh: list[tuple[str, TensorEntry]] = []  # allocated after the memory check, all together
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
            e = manifest.entries[fqn]
            paths[fqn] = e.path
            if isinstance(e, TensorEntry):
                cur = live_flat.get(fqn)
                if isinstance(cur, torch.Tensor):
                    if tuple(cur.shape) != tuple(e.shape):
                        raise StateMismatchError(
                            f"{fqn!r}: checkpoint of step {manifest.step} has shape {tuple(e.shape)} but the live "
                            f"tensor has {tuple(cur.shape)}; build the model with the configuration it was saved with"
                        )
                    template[fqn] = cur
                else:
                    fresh.append((fqn, e))
            else:
                template[fqn] = None
    need = sum(math.prod(e.shape) * dtype_from_name(e.dtype).itemsize for _, e in fresh)
    check_memory(need, manifest.step, [fqn for fqn, _ in fresh])
    for fqn, e in fresh:
        template[fqn] = torch.empty(e.shape, dtype=dtype_from_name(e.dtype))
    return template, paths


def available_memory_bytes() -> int | None:
    """Memory this process can still allocate, in bytes: the smaller of the system's available memory
    (``MemAvailable`` + ``SwapFree`` of /proc/meminfo) and the headroom under ``RLIMIT_AS``; None where neither
    is known."""
    limits: list[int] = []
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            info = {k: int(v.split()[0]) * 1024 for k, v in (ln.split(":", 1) for ln in f if ":" in ln)}
        if "MemAvailable" in info:
            limits.append(info["MemAvailable"] + info.get("SwapFree", 0))
    except (OSError, ValueError):
        pass
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_AS)
        if soft != resource.RLIM_INFINITY:
            with open("/proc/self/status", encoding="ascii") as f:
                vm = next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmSize:")), None)
            if vm is not None:
                limits.append(max(0, soft - vm))
    except (OSError, ValueError, ImportError):
        pass
    return min(limits) if limits else None


def check_memory(need_bytes: int, step: int, fqns: list[str]) -> None:
    """Refuse a restore whose new tensors (entries the live state lacks) need more memory than is available,
    before allocating any of them.

    Raises:
        InsufficientMemoryError: naming the bytes needed and available and the largest entries.
    """
    if need_bytes <= 0:
        return
    avail = available_memory_bytes()
    if avail is None or need_bytes <= avail:
        return
    shown = ", ".join(fqns[:5]) + (" ..." if len(fqns) > 5 else "")
    raise InsufficientMemoryError(
        f"restoring step {step} needs {need_bytes} bytes for tensors the live state lacks ({shown}) but only "
        f"{avail} bytes are available; build those tensors in the state passed to restore (they are then "
        "loaded in place), free memory, or restore on a larger machine",
        step=step,
        need_bytes=need_bytes,
        available_bytes=avail,
    )


def apply(
    loaded_flat: Mapping[str, Any], paths: Mapping[str, PathT], state: MutableMapping[str, Any], step: int
) -> None:
    """Hand loaded values to the live state: ``load_state_dict`` for Stateful objects, in-place updates of
    dicts/lists, replacement of immutable values."""
    nested = unflatten(loaded_flat, paths)
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
