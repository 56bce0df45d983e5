"""Per-rank state: a value that differs between ranks is never collapsed into one rank's value.

DCP treats every non-sharded tensor and value saved under the same key on several ranks as replicated and keeps
one copy. That is right for replicated state (buffers, step counters, hyperparameters) and silently wrong for
state that is genuinely per rank (an iterable loader's cursor, a per-rank counter). At every save under
torch.distributed the ranks therefore compare what they hold under each key with one all-gather of 128-bit
digests (xxh3) over trainguard's own control group:

- identical under a key on every rank that has it: stored once, as before;
- different on some rank (or wrapped in :class:`PerRank`): stored once per rank, as the per-rank entry
  ``<fqn>@rank<r>`` whose manifest entry records ``rank`` (docs/FORMAT.md, format version 2).

On restore at the saved world size each rank gets back exactly what it saved. At another world size there is
no right answer in general, so the user decides with ``PerRank(obj, reshard=fn)``; without a hook the restore
raises StateMismatchError naming the keys. DTensor (sharded) leaves are DCP's business and never compared.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import xxhash

from ..errors import ConfigError, SaveError, StateMismatchError
from .flatten import PathT, fqn_of, key_text
from .values import encode_value

if TYPE_CHECKING:
    from ..distributed.context import DistContext
    from ..format.manifest import Entry, Manifest

RANK_TAG = "r"  # leading path element ("r", rank) marking a per-rank leaf between the save and the manifest
Reshard = Callable[[list[Any], int, int], Any]


class PerRank:
    """State that is genuinely per rank: stored per rank at every save, and resharded by ``reshard`` when the
    world size changes.

    ``state = {"cursor": tg.PerRank(cursor, reshard=fn)}``. Plain tensors and values under a key that differ
    between ranks are stored per rank without this wrapper too; wrap an object to give the hook for a restore
    at another world size, or to store it per rank even when the ranks happen to agree.

    Args:
        obj: an object with ``state_dict()``/``load_state_dict()``, or a dict (updated in place on restore).
        reshard: ``fn(saved, rank, world_size) -> state`` called on restore at a world size other than the
            saved one: ``saved[r]`` is what rank ``r`` saved (nested, as its ``state_dict()`` returned it; the
            list has the saved world size), ``rank``/``world_size`` describe the restoring rank; it returns what
            this rank's ``obj`` loads. None: such a restore raises StateMismatchError.

    Raises:
        ConfigError: ``obj`` is neither Stateful nor a dict, or ``reshard`` is not callable.
    """

    def __init__(self, obj: Any, *, reshard: Reshard | None = None) -> None:
        stateful = callable(getattr(obj, "state_dict", None)) and callable(
            getattr(obj, "load_state_dict", None)
        )
        if not stateful and not isinstance(obj, dict):
            raise ConfigError(
                f"PerRank needs an object with state_dict()/load_state_dict() or a dict, got {type(obj).__name__}"
            )
        if reshard is not None and not callable(reshard):
            raise ConfigError(f"PerRank reshard must be callable, got {type(reshard).__name__}")
        self.obj = obj
        self.reshard = reshard
        self._stateful = stateful

    def state_dict(self) -> Any:
        return self.obj.state_dict() if self._stateful else self.obj

    def load_state_dict(self, sd: Any) -> None:
        if self._stateful:
            self.obj.load_state_dict(sd)
        else:
            self.obj.clear()
            self.obj.update(sd)

    def __repr__(self) -> str:
        return f"PerRank({self.obj!r}, reshard={self.reshard!r})"


def job_rank() -> tuple[int, int]:
    """``(rank, world_size)`` of this process in the job (0, 1 without torch.distributed)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def digest(x: Any, fqn: str) -> str | None:
    """128-bit digest of a leaf (dtype, shape and bytes of a tensor; the stored encoding of a value), or None
    for a sharded (DTensor) leaf."""
    from ..distributed.chunkwrite import tensor_bytes

    if isinstance(x, torch.Tensor):
        if hasattr(x, "placements"):
            return None
        h = xxhash.xxh3_128(f"{x.dtype}{tuple(x.shape)}".encode())
        h.update(tensor_bytes(x))
        return h.hexdigest()
    return xxhash.xxh3_128(encode_value(x, fqn)).hexdigest()


_RANK_SUFFIX = re.compile(r"@rank\d+$")


def _error_text(e: BaseException) -> str:
    """``"Type: message"``, also for an exception whose ``str()`` raises."""
    try:
        return f"{type(e).__name__}: {e}"
    except Exception:  # noqa: BLE001 - a broken __str__ must not stop the exchange
        return type(e).__name__


def exchange(
    dist: DistContext, step: int | None, digests: dict[str, str], failure: BaseException | None = None
) -> list[dict[str, str]]:
    """The first collective of a save: every rank's per-rank digests, its step and whether it failed so far
    (``failure``: raised again on this rank once every rank knows). A rank raising alone would leave the others
    waiting in the next collective until its timeout; ranks saving different steps would pair their
    collectives across steps and commit one checkpoint holding both.

    Returns:
        Every rank's digests, index = rank.

    Raises:
        ``failure`` on its rank; on the others ConfigError (SaveError when that rank's error was not a
        ConfigError) naming the rank; ConfigError on every rank when the steps differ.
    """
    sent = {"digests": digests, "step": step, "error": None if failure is None else _error_text(failure)}
    gathered = [json.loads(b) for b in dist.all_gather_bytes(json.dumps(sent).encode())]
    if failure is not None:
        raise failure
    failed = [(r, g["error"]) for r, g in enumerate(gathered) if g["error"]]
    if failed:
        r, why = failed[0]
        message = f"the save of step {step} was refused on rank {r}: {why[:2000]}"
        if why.startswith("ConfigError:"):
            raise ConfigError(message)
        raise SaveError(message, step=step)
    steps = [g["step"] for g in gathered]
    if len(set(steps)) > 1:
        shown = ", ".join(f"rank {r} step {s}" for r, s in enumerate(steps[:16]))
        raise ConfigError(
            f"the ranks saved different steps ({shown}): call save with the same step on every rank. If they "
            "did, an earlier save failed on some ranks only and the ranks' collectives are out of step: "
            "restart the job"
        )
    return [g["digests"] for g in gathered]


def split(
    flat: dict[str, Any],
    paths: dict[str, PathT],
    top: Mapping[str, Mapping[str, Any]],
    dist: DistContext,
    step: int | None = None,
) -> tuple[dict[str, Any], dict[str, PathT]]:
    """Rename the leaves that differ between ranks (or belong to a PerRank object) to per-rank entries.

    Collective on ``dist``'s control group (every rank calls it at every save); a no-op in one process.

    Returns:
        ``(flat, paths)`` where each per-rank leaf ``fqn`` became ``fqn@rank<r>`` with path
        ``(("r", r), *path)``.

    Raises:
        ConfigError: on every rank, naming the rank at fault: a state name ends in ``@rank<r>`` (the names of
            per-rank entries), the ranks save different steps (``step``), or a leaf cannot be stored (SaveError
            when that rank's error was another).
    """
    if not dist.enabled:
        return flat, paths
    forced = {key_text(k) for k, t in top.items() if t.get("per_rank")}
    failure: Exception | None = None
    try:
        reserved = [fqn for fqn in flat if _RANK_SUFFIX.search(fqn)]
        if reserved:
            raise ConfigError(
                f"state entry {reserved[0][:200]!r} ends like the name of a per-rank entry (@rank<r>), which "
                "torch.distributed saves reserve; rename that key"
            )
        mine = {fqn: d for fqn, v in flat.items() if (d := digest(v, fqn)) is not None}
    except Exception as e:  # noqa: BLE001 - every rank learns of it below, then raises
        mine, failure = {}, e
    everyone = exchange(dist, step, mine, failure)
    out_flat: dict[str, Any] = {}
    out_paths: dict[str, PathT] = {}
    for fqn, v in flat.items():
        path = paths[fqn]
        per_rank = fqn in mine and (
            key_text(path[0][1]) in forced or len({d[fqn] for d in everyone if fqn in d}) > 1
        )
        if not per_rank:
            out_flat[fqn], out_paths[fqn] = v, path
            continue
        name = f"{fqn}@rank{dist.rank}"  # no state name ends so: refused above
        out_flat[name], out_paths[name] = v, ((RANK_TAG, dist.rank), *path)
    return out_flat, out_paths


def strip_rank(path: PathT) -> tuple[PathT, int | None]:
    """The logical path and the rank of a per-rank leaf's path (rank None for a shared leaf)."""
    if path and path[0][0] == RANK_TAG:
        return tuple(path[1:]), int(path[0][1])
    return path, None


def plan_load(manifest: Manifest, state: Mapping[str, Any]) -> tuple[set[str], dict[str, list[str]]]:
    """Which per-rank entries this rank loads.

    Returns:
        ``(skip, reshard)``: per-rank FQNs to leave out of the load (other ranks' values), and for each
        top-level key restored through a PerRank hook at another world size, every per-rank FQN it needs.

    Raises:
        StateMismatchError: the world size differs from the saved one and a top-level key with per-rank
            entries has no ``PerRank(obj, reshard=fn)`` hook; the message names the keys.
    """
    rank, ws = job_rank()
    by_top: dict[str, list[Entry]] = {}
    for e in manifest.entries.values():
        if e.rank is not None:
            by_top.setdefault(str(e.path[0][1]), []).append(e)
    skip: set[str] = set()
    reshard: dict[str, list[str]] = {}
    for k, entries in by_top.items():
        if k not in state:
            continue
        if manifest.world_size == ws:
            skip |= {e.fqn for e in entries if e.rank != rank}
            continue
        obj = state[k]
        if isinstance(obj, PerRank) and obj.reshard is not None:
            reshard[k] = [e.fqn for e in entries]
            continue
        names = sorted({fqn_of(e.path) for e in entries})
        raise StateMismatchError(
            f"state entry {k!r} holds values that differ between ranks ({', '.join(names[:8])}"
            f"{', ...' if len(names) > 8 else ''}), saved per rank at world size {manifest.world_size}; "
            f"restoring at world size {ws} needs a rule: wrap it as tg.PerRank(obj, reshard=fn) where "
            "fn(saved, rank, world_size) returns this rank's state from the list of every saved rank's state"
        )
    return skip, reshard


def saved_by_rank(
    loaded: Mapping[str, Any], paths: Mapping[str, PathT], fqns: list[str], manifest: Manifest, key: str
) -> list[Any]:
    """Every saved rank's nested state of top-level ``key``: the shared leaves plus that rank's own."""
    from .flatten import unflatten

    shared = {f: p for f, p in paths.items() if str(p[0][1]) == key}
    out = []
    for r in range(manifest.world_size):
        own = {f: manifest.entries[f].path for f in fqns if manifest.entries[f].rank == r}
        merged = {**shared, **own}
        out.append(unflatten({f: loaded[f] for f in merged}, merged).get(key) if merged else None)
    return out
