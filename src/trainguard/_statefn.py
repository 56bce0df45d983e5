"""Collecting state for a save and applying loaded state on restore (the Stateful protocol of torch DCP).

Restore loads what was *saved*, not only what the live object happens to contain: the load template is built
from the manifest, reusing the live tensor wherever one exists with the same FQN and shape (so parameters are
filled in place and tied weights stay tied) and allocating a new tensor for every saved entry the live object
lacks (e.g. the ``exp_avg`` of an optimizer that has not stepped yet, a data loader's grown state). The nested
result is then handed to ``load_state_dict``.
"""

from __future__ import annotations

import functools
import logging
import math
import sys
import warnings
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ._lazy import is_dtensor
from ._prefault import MemoryMaps
from .errors import ConfigError, InsufficientMemoryError, StateMismatchError
from .format import Manifest, TensorEntry
from .state import optim
from .state.dtypes import dtype_from_name
from .state.flatten import PathT, flatten, fqn_of, unflatten
from .state.matching import MAX_LISTED, match_names, mismatch_message
from .state.per_rank import PerRank, job_rank, plan_load, saved_by_rank

log = logging.getLogger("trainguard")


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
    """``state_dict()`` of every Stateful value, then flatten. Returns ``(flat, paths, top_level)``.

    Raises:
        ConfigError: the state is not a dict, or holds a tensor whose elements alone do not give its value
            (quantized, sparse, nested, meta tensors, tensor subclasses other than DTensor), or an object with
            ``state_dict``/``load_state_dict`` below the top level: refused here, before anything is written.
    """
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
        cov = optim.coverage(resolved[k])
        if cov:
            top[k]["optimizer_state"] = cov
            top[k]["optimizer_state_names"] = "value"  # sections named as entries are (key_text)
    flat, paths = flatten(resolved)
    for fqn, v in flat.items():
        if isinstance(v, torch.Tensor):
            check_storable(v, fqn)
        elif is_stateful(v):  # nested beside tensors: only top-level entries are restored by load_state_dict
            raise ConfigError(
                f"state entry {fqn!r} is a {type(v).__name__} (it has state_dict() and load_state_dict()) inside "
                "a container: trainguard calls load_state_dict only on top-level entries of the state, so this "
                "one would come back as a plain dict and the object would not be restored. Make it a top-level "
                f"entry (state[{fqn.rsplit('.', 1)[-1]!r}] = obj) or put its state_dict() into its parent's "
                "state_dict()"
            )
    return flat, paths, top


def check_storable(t: torch.Tensor, fqn: str) -> None:
    """Refuse a tensor whose value is more than its elements in C order (they would come back different).

    Raises:
        ConfigError: naming the entry, what it is and how to store it instead.
    """
    if getattr(t, "is_quantized", False):
        what, fix = (
            f"a quantized tensor ({t.dtype})",
            "store t.int_repr() with t.q_scale()/t.q_zero_point() (or t.q_per_channel_scales(), "
            "t.q_per_channel_zero_points(), t.q_per_channel_axis()), or t.dequantize()",
        )
    elif getattr(t, "is_nested", False):
        what, fix = "a nested tensor", "store t.unbind() as a list of tensors"
    elif t.layout != torch.strided:
        what, fix = f"a {t.layout} tensor", "store t.to_dense(), or its indices and values as tensors"
    elif t.device.type == "meta":
        what, fix = (
            "a meta tensor (it has no data)",
            "materialize it (e.g. module.to_empty() and initialize it)",
        )
    elif not storable_dtype(t.dtype):
        what, fix = (
            f"of dtype {t.dtype}, which this torch cannot copy or size on the CPU (a bit or sub-byte dtype)",
            f"store its bytes, t.view(torch.uint8), and view them back as {t.dtype} after restore",
        )
    elif is_traceable_wrapper_subclass(t) and not is_dtensor(t):
        what, fix = (
            f"a tensor subclass ({type(t).__qualname__}) whose data lives in inner tensors (e.g. torchao's quantized "
            "and float8 tensors)",
            "store its inner tensors and parameters (t.__tensor_flatten__()), or a plain tensor (e.g. t.dequantize())",
        )
    else:
        return
    raise ConfigError(
        f"state entry {fqn!r} is {what}: trainguard stores a tensor's elements, dtype and shape only, so it "
        f"would not come back as it is; {fix}. Nothing was written."
    )


@functools.cache
def storable_dtype(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` can be checkpointed: torch gives its element size (DCP's planner asks) and
    copies it on the CPU (staging). False for the bit and sub-byte dtypes (``bits8``, ``uint1``-``uint7``,
    ``int1``-``int4``, ...) of this torch."""
    try:
        torch._utils._element_size(dtype)
        # complex32 warns "ComplexHalf support is experimental": the caller's own tensor warned already
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = torch.empty(2, dtype=dtype)
            torch.empty_like(t).copy_(t)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return True


def unloadable(t: torch.Tensor, maps: MemoryMaps | None = None) -> str | None:
    """Why a live tensor cannot be loaded into in place (None when it can): no memory (meta), a layout other
    than strided, nested or quantized, or elements sharing memory (an expanded view: stride 0 on a dim longer
    than 1, in a tensor with elements), an uninitialized parameter of a lazy module, or (given ``maps``, this
    process's mappings) host memory mapped read-only."""
    if isinstance(t, (UninitializedParameter, UninitializedBuffer)):
        return (
            "an uninitialized parameter of a lazy module (e.g. nn.LazyLinear); run one forward pass (a dummy "
            "batch) to give it its shape, then restore"
        )
    if t.device.type == "meta":
        return "on the meta device (it has no memory to load into); materialize it first (e.g. module.to_empty())"
    if getattr(t, "is_quantized", False) or getattr(t, "is_nested", False) or t.layout != torch.strided:
        kind = "quantized" if t.is_quantized else "nested" if t.is_nested else str(t.layout)
        return f"a {kind} tensor; restore into a dense tensor (or an empty container) and convert it"
    if (
        not is_dtensor(t)
        and t.numel() > 1
        and any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape, strict=True))
    ):
        return (
            "an expanded view (several elements share one memory location); restore into a tensor with memory "
            "of its own (e.g. t.contiguous()) or an empty container"
        )
    if maps is not None and t.device.type == "cpu" and not is_dtensor(t):
        # the mapping holding its first element (0.7 us a tensor; its storage object would cost 6 us): one
        # allocation never spans mappings of different permissions, and numel x itemsize from there could
        # overrun the storage for an overlapping view (unfold), into a neighbouring mapping
        try:
            start, size = t.data_ptr(), t.nbytes
        except (RuntimeError, NotImplementedError):  # a tensor without plain storage: nothing to look up
            return None
        if size and maps.read_only(start, 1):
            return (
                "on read-only memory (e.g. a tensor over np.memmap(mode='r') or a file mapped read-only: "
                "writing into it would crash the process); restore into a writable copy (t.clone()) or an "
                "empty container"
            )
    return None


def build_template(
    manifest: Manifest, state: Mapping[str, Any], *, strict: bool = True
) -> tuple[dict[str, Any], dict[str, PathT], dict[str, list[str]]]:
    """The flat ``{fqn: destination}`` DCP loads into, the paths that rebuild the nested state for
    ``apply`` (the target's spelling of a name wherever it matched a saved one by its canonical name), and the
    per-rank entries each PerRank-resharded top-level key needs (see :func:`per_rank.plan_load`).

    Per-rank entries (:mod:`trainguard.state.per_rank`): at the saved world size only this rank's own are
    loaded, matched under their logical path; at another world size every rank's are loaded, into buffers of
    their own, for the key's ``PerRank(obj, reshard=fn)`` hook (without one: StateMismatchError).

    Within each requested state entry, saved and live names are matched (:mod:`trainguard.state.matching`). A
    plain entry (dict, list, tensor) must match the checkpoint key for key, dtype for dtype; an empty container
    in the target takes everything saved beneath it as saved. A Stateful's own ``load_state_dict`` judges its
    keys (saved entries it does not hold yet are handed to it), but a live tensor of another dtype is a mismatch
    too, except optimizer state, which is replaced by what was saved, dtype included.

    Raises:
        StateMismatchError: a requested top-level key is not in the checkpoint; live tensors have different
            shapes or cannot be loaded into (meta, sparse, nested, quantized, expanded: :func:`unloadable`),
            strict or not; or, with ``strict``, keys, dtypes or recorded optimizer state differ. Every
            difference of an entry is listed in one message (:func:`~trainguard.state.matching.mismatch_message`).
        InsufficientMemoryError: the tensors to allocate (saved entries the target lacks, optimizer state of
            another dtype) need more memory than is available; nothing is allocated.
    """
    saved_top: dict[str, list[str]] = {}
    for fqn, e in manifest.entries.items():
        tag, key = e.path[0]
        saved_top.setdefault(str(key), []).append(fqn)
    template: dict[str, Any] = {}
    paths: dict[str, PathT] = {}
    reports: list[str] = []
    shape_mismatch = False
    unloadable_: list[str] = []  # live tensors that cannot take the loaded values (see unloadable)
    maps: MemoryMaps | None = None  # this process's read-only mappings, read at the first host tensor
    fresh: list[
        tuple[str, TensorEntry]
    ] = []  # tensors to allocate: checked against the memory available first
    skip, reshard = plan_load(manifest, state)
    for k, obj in state.items():
        if k not in saved_top:
            raise StateMismatchError(
                f"the checkpoint of step {manifest.step} has no state entry {k!r} (it holds "
                f"{sorted(saved_top)}); remove {k!r} from the state passed to restore, or restore a checkpoint "
                "saved with it"
            )
        if k in reshard:  # every saved rank's state, for the PerRank hook; the hook's result is what loads
            for f in saved_top[k]:
                e = manifest.entries[f]
                if e.rank is None:
                    paths[f] = e.path
                template[f] = (
                    torch.empty(e.shape, dtype=dtype_from_name(e.dtype))
                    if isinstance(e, TensorEntry)
                    else None
                )
            continue
        stateful = is_stateful(obj)
        live = obj.state_dict() if stateful else obj
        live_flat, live_paths = flatten({k: live})
        saved = [f for f in saved_top[k] if f not in skip]  # not other ranks' per-rank values
        empties = [f for f, v in live_flat.items() if isinstance(v, (Mapping, list, tuple)) and len(v) == 0]
        filled = {e for e in empties for f in saved if f.startswith(e + ".")}
        # an empty live container that saved entries fill is no match for a saved leaf: the leaf at key ""
        # beneath it has the same relative name (k's own container is "", and so is {"": t} inside it)
        match = match_names(
            {f: fqn_of(manifest.entries[f].path[1:]) for f in saved},
            {f: fqn_of(p[1:]) for f, p in live_paths.items() if f not in filled},
        )
        record = (
            (manifest.top_level.get(k) or {}).get("optimizer_state")
            if isinstance(manifest.top_level.get(k), dict)
            else None
        )
        live_sections = {optim.section_name(p) for p in optim.optimizer_sections(live)}
        # a record from a save before sections were named as entries are ("Role.GEN" for the entries gen.*)
        legacy = record is not None and manifest.top_level[k].get("optimizer_state_names") != "value"
        record = optim.renamed_sections(record, live)
        sections = live_sections | set(record or {})
        opt_prefixes = tuple(p for s in sections for p in optim.state_prefixes(k, s))
        only_saved = [] if stateful else [f for f in saved if f not in match and not _beneath(f, empties)]
        used = set(match.values()) | filled
        only_live = [] if stateful else [f for f in live_flat if f not in used]
        dtypes: list[tuple[str, str, str]] = []
        shapes: list[tuple[str, tuple[int, ...], tuple[int, ...]]] = []
        for f in saved:
            e = manifest.entries[f]
            lf = match.get(f)
            paths[f] = live_paths[lf] if lf is not None else e.path
            cur = live_flat.get(lf) if lf is not None else None
            if not isinstance(e, TensorEntry):
                template[f] = None
                if isinstance(cur, torch.Tensor) and not stateful:
                    dtypes.append((f, "a value", str(cur.dtype).removeprefix("torch.")))
                continue
            dtype = dtype_from_name(e.dtype)
            if not isinstance(cur, torch.Tensor):
                if lf is not None and not stateful and lf not in empties:
                    dtypes.append((f, e.dtype, f"a {type(cur).__name__}"))
                template[f] = None
                fresh.append((f, e))  # allocated after the memory check
                continue
            if maps is None and cur.device.type == "cpu":
                maps = MemoryMaps()  # once per restore, before the first byte is written
            why = unloadable(cur, maps)
            if why is not None:
                name = f if lf == f else f"{f} (target {lf})"
                unloadable_.append(f"{name}: the live tensor is {why}")
                continue
            if tuple(cur.shape) != tuple(e.shape):  # listed with every other difference, strict or not
                name = f if lf == f else f"{f} (target {lf})"
                shapes.append((name, tuple(e.shape), tuple(cur.shape)))
            template[f] = cur
            if cur.dtype != dtype:
                if stateful and (f.startswith(opt_prefixes) or str(lf).startswith(opt_prefixes)):
                    template[f] = None  # replaced by what was saved (allocated after the memory check)
                    fresh.append((f, e))
                else:
                    name = f if lf == f else f"{f} (target {lf})"
                    dtypes.append((name, e.dtype, str(cur.dtype).removeprefix("torch.")))
        if only_saved or only_live or dtypes or shapes:
            reports.append(
                mismatch_message(
                    manifest.step, k, only_saved=only_saved, only_live=only_live, dtypes=dtypes, shapes=shapes
                )
            )
            shape_mismatch = shape_mismatch or bool(shapes)
        missing = optim.missing_in_manifest(
            k, record, [fqn_of(manifest.entries[f].path) for f in saved], live_sections if legacy else None
        )
        if missing:
            reports.append(
                mismatch_message(
                    manifest.step,
                    k,
                    missing_optim=missing,
                    fix="The checkpoint lacks optimizer state that its manifest recorded at save time (an altered "
                    "manifest?): restore an older checkpoint, or pass strict=False to continue with that state "
                    "empty.",
                )
            )
    if unloadable_:
        more = len(unloadable_) - MAX_LISTED
        shown = "\n  ".join(unloadable_[:MAX_LISTED]) + (f"\n  ... and {more} more" if more > 0 else "")
        reports.insert(
            0,
            f"cannot restore step {manifest.step} into the state passed: {len(unloadable_)} live tensor(s) cannot "
            f"be loaded into in place:\n  {shown}",
        )
        raise StateMismatchError("\n".join(reports) + "\nNothing was loaded.")
    if reports:
        if strict or shape_mismatch:  # a shape cannot be converted: strict=False does not load it either
            raise StateMismatchError("\n".join(reports))
        log.warning("strict=False: loading what matches; %s", "\n".join(reports))
    check_memory(
        sum(math.prod(e.shape) * dtype_from_name(e.dtype).itemsize for _, e in fresh),
        manifest.step,
        [f for f, _ in fresh],
    )
    for f, e in fresh:
        template[f] = torch.empty(e.shape, dtype=dtype_from_name(e.dtype))
    return template, paths, reshard


def _beneath(fqn: str, containers: list[str]) -> bool:
    return any(fqn.startswith(c + ".") for c in containers)


def available_memory_bytes() -> int | None:
    """Memory this process can still allocate, in bytes: the smaller of the system's available memory
    (``MemAvailable`` + ``SwapFree`` of /proc/meminfo) and the headroom under ``RLIMIT_AS``; None where neither
    is known."""
    from .storage.local import meminfo

    limits: list[int] = []
    info = meminfo()
    if info is not None and "MemAvailable" in info:
        limits.append(info["MemAvailable"] + info.get("SwapFree", 0))
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
    loaded_flat: Mapping[str, Any],
    paths: Mapping[str, PathT],
    state: MutableMapping[str, Any],
    manifest: Manifest,
    *,
    strict: bool = True,
    reshard: Mapping[str, list[str]] | None = None,
) -> None:
    """Hand loaded values to the live state: ``load_state_dict`` for Stateful objects (then the optimizer
    checks of :mod:`trainguard.state.optim`), in-place updates of dicts/lists, replacement of immutable values.
    Top-level keys in ``reshard`` get what their PerRank hook returns from every saved rank's state.

    Raises:
        StateMismatchError: a ``load_state_dict`` rejected the state, or (with ``strict``) an optimizer lacks
            state that it had at save time.
    """
    step = manifest.step
    nested = unflatten(loaded_flat, paths)
    for k, fqns in (reshard or {}).items():
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
            top = manifest.top_level.get(k)
            _after_optimizer_load(
                k, obj, new, top.get("optimizer_state") if isinstance(top, dict) else None, step, strict
            )
        elif isinstance(obj, torch.Tensor):
            if new is not obj:
                with torch.no_grad():
                    obj.copy_(new)
        elif isinstance(obj, (dict, list)):
            _merge(obj, new, state, k)
        else:
            state[k] = new


def _after_optimizer_load(k: str, obj: Any, new: Any, record: Any, step: int, strict: bool) -> None:
    """Saved dtypes back into a torch optimizer, then every parameter with state at save time must have it."""
    mos = sys.modules.get("trainguard.distributed.state")  # no instance exists before it is imported
    model_optimizer_state = mos.ModelOptimizerState if mos is not None else ()

    if (
        isinstance(obj, torch.optim.Optimizer)
        and isinstance(new, Mapping)
        and optim.optimizer_sections(new) == [()]
    ):
        params = optim.param_map_by_order(new["param_groups"], obj)
        optim.restore_saved_dtypes(obj, new, params)
        missing = optim.missing_after_load(obj, record, "", params)
    elif isinstance(obj, model_optimizer_state) and obj.optimizer is not None:
        missing = optim.missing_after_load(obj.optimizer, record, "optim", obj.params_by_name())
    else:
        return
    if missing:
        msg = mismatch_message(
            step,
            k,
            missing_optim=missing,
            fix=f"{k}.load_state_dict() did not keep the saved state of these parameters (a wrapper or hook that "
            "drops state?); fix that, or pass strict=False to continue with their state empty.",
        )
        if strict:
            raise StateMismatchError(msg)
        log.warning("strict=False: %s", msg)


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
