"""What an export takes from a checkpoint, and reading it into full (consolidated) tensors.

A checkpoint saved at N ranks holds each sharded tensor as N shards; reading goes through trainguard's own
DCP ``StorageReader`` into full-size tensors allocated here, one group at a time, so shards are consolidated
and every chunk is CRC32C-checked as it is read. Nothing is unpickled: values are JSON or
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..catalog import inspect_step, read_manifest, scan
from ..errors import ConfigError, CorruptCheckpointError, NoValidCheckpointError
from ..format import Manifest, TensorEntry, ValueEntry, step_dir_name
from ..format.layout import as_step
from ..incremental.chunkstore import ChunkStore
from ..state.dtypes import dtype_from_name
from ..state.flatten import PathT, fqn_of

MODEL_OPTIMIZER_STATE = "trainguard.distributed.state.ModelOptimizerState"
GROUP_BYTES = 256 << 20  # tensors are read in groups of about this many bytes (progress, bounded memory)


def open_checkpoint(root: str | os.PathLike[str], step: int | None) -> tuple[ChunkStore, Manifest]:
    """The chunk store and manifest of ``step`` (default: the newest valid checkpoint) under ``root``.

    Raises:
        ConfigError: ``root`` is not a directory, or ``step`` is not an int in ``[0, 2**62]``.
        CheckpointNotFoundError: no committed checkpoint of ``step``.
        NoValidCheckpointError: ``step`` is None and no checkpoint is valid.
        CorruptCheckpointError: the checkpoint of ``step`` is not valid (the message says why).
    """
    if step is not None:
        step = as_step(step)
    r = Path(root)
    if not r.is_dir():
        raise ConfigError(f"run root {str(root)!r} does not exist or is not a directory")
    store = ChunkStore(r)
    if step is None:
        infos = scan(r, store)
        valid = [i.step for i in infos if i.usable]  # valid or unverified (export reads every byte)
        if not valid:
            if infos:
                raise NoValidCheckpointError(
                    f"{r} holds {len(infos)} checkpoint(s) but none is valid; run `trainguard ls {r}`"
                )
            raise NoValidCheckpointError(f"{r} holds no committed checkpoint (run `trainguard ls {r}`)")
        step = valid[-1]
    m = read_manifest(r, step)
    info, _ = inspect_step(r, step, r / step_dir_name(step), store)
    if not info.usable:
        raise CorruptCheckpointError(
            f"the checkpoint of step {step} under {r} is {info.status}: {info.problem}; it is not exported "
            f"(`trainguard ls {r}` lists the valid ones)",
            step=step,
            chunk=info.chunk,
        )
    return store, m


@dataclass(frozen=True)
class Selection:
    """The entries an export writes.

    Attributes:
        name: what was selected, for messages (``"model"``, ``"app.model"``, ``"the whole state"``).
        keys: output key -> manifest FQN, in manifest order. For a model, the keys are the model's own
            ``state_dict`` keys (no ``model.`` prefix); for the whole state, the FQNs.
        paths: output key -> path of nested keys that rebuilds the nested structure (``torch`` output).
        prefix: the path of keys of the selected part (empty for the whole state).
    """

    name: str
    keys: dict[str, str]
    paths: dict[str, PathT]
    prefix: PathT = ()


def _top_level_names(m: Manifest) -> list[str]:
    names: list[str] = []
    for e in m.entries.values():
        k = str(e.path[0][1])
        if k not in names:
            names.append(k)
    return names


LIGHTNING_WEIGHTS = "lightning.state_dict"  # the model weights inside a TrainguardCheckpointIO checkpoint


def _is_lightning(m: Manifest, names: list[str]) -> bool:
    """A checkpoint written by ``tg.lightning.TrainguardCheckpointIO``: a ``lightning`` dict with a
    ``state_dict`` (the LightningModule's weights)."""
    return "lightning" in names and any(
        tuple(e.path[:2]) == (("s", "lightning"), ("s", "state_dict")) for e in m.entries.values()
    )


def _children(m: Manifest, prefix: PathT) -> list[str]:
    """The keys one level below ``prefix``, in manifest order."""
    out: list[str] = []
    for e in m.entries.values():
        if len(e.path) > len(prefix) and tuple(e.path[: len(prefix)]) == prefix:
            k = str(e.path[len(prefix)][1])
            if k not in out:
                out.append(k)
    return out


def resolve_entry(m: Manifest, entry: str) -> PathT:
    """The path of keys named by ``entry``: a top-level state entry (``model``) or a dotted path to a part
    of one (``lightning.state_dict``, ``app.model``).

    Raises:
        ConfigError: nothing in the checkpoint has that name (the message lists what exists at the deepest
            level that matched).
    """
    names = _top_level_names(m)
    if entry in names:
        return (("s", entry),)
    for e in m.entries.values():  # a nested part: the shortest path prefix whose FQN is ``entry``
        for i in range(2, len(e.path) + 1):
            if fqn_of(e.path[:i]) == entry:
                return tuple(e.path[:i])
    # the deepest prefix that exists, to list what is there
    prefix: PathT = ()
    known = names
    parts = entry.split(".")
    for j in range(1, len(parts)):
        here = ".".join(parts[:j])
        hit = next(
            (
                tuple(e.path[:i])
                for e in m.entries.values()
                for i in range(1, len(e.path))
                if fqn_of(e.path[:i]) == here
            ),
            None,
        )
        if hit is None:
            break
        prefix, known = hit, _children(m, hit)
    where = f"{fqn_of(prefix)!r} holds" if prefix else "its entries are"
    raise ConfigError(
        f"the checkpoint of step {m.step} has no state entry {entry!r}; {where} {known} (a part of an entry is "
        "named by its dotted path, e.g. 'lightning.state_dict')"
    )


def select(m: Manifest, entry: str | None = None, *, all_state: bool = False) -> Selection:
    """Choose what to export from the checkpoint ``m``.

    Args:
        m: the checkpoint's manifest.
        entry: a top-level state entry, or a dotted path to a part of one (``lightning.state_dict``); default
            ``model``, the only ``ModelOptimizerState`` entry, or ``lightning.state_dict`` in a checkpoint of
            ``tg.lightning.TrainguardCheckpointIO``. The weights inside a ``ModelOptimizerState`` entry are its
            ``model`` part. The output keys are the keys below ``entry`` (the model's own ``state_dict`` keys).
        all_state: every entry (model, optimizer, RNG, loader position, ...), keyed by FQN.

    Raises:
        ConfigError: the entry does not exist, or no default applies (the message lists the entries).
    """
    if all_state:
        if entry is not None:
            raise ConfigError("give either an entry or the whole state (--all), not both")
        return Selection(
            "the whole state",
            {fqn: fqn for fqn in m.entries},
            {fqn: e.path for fqn, e in m.entries.items()},
        )
    names = _top_level_names(m)
    mos = [n for n in names if m.top_level.get(n, {}).get("type") == MODEL_OPTIMIZER_STATE]
    if entry is None:
        if "model" in names:
            entry = "model"
        elif len(mos) == 1:
            entry = mos[0]
        elif not mos and _is_lightning(m, names):
            entry = LIGHTNING_WEIGHTS
        else:
            why = f"several ModelOptimizerState entries ({', '.join(mos)})" if mos else "no entry 'model'"
            raise ConfigError(
                f"the checkpoint of step {m.step} has {why}; its entries are {names}: choose one with "
                "--entry NAME (entry=...; a dotted path names a part of an entry, e.g. 'app.model'), or export "
                "everything with --all"
            )
    prefix = resolve_entry(m, entry)
    name = entry
    if len(prefix) == 1 and m.top_level.get(entry, {}).get("type") == MODEL_OPTIMIZER_STATE:
        prefix = (*prefix, ("s", "model"))
        name = f"{entry}.model"
    keys: dict[str, str] = {}
    paths: dict[str, PathT] = {}
    for fqn, e in m.entries.items():
        if tuple(e.path[: len(prefix)]) != prefix:
            continue
        rest = tuple(e.path[len(prefix) :])
        key = fqn_of(rest) if rest else fqn
        keys[key] = fqn
        paths[key] = rest if rest else e.path
    if not keys:
        raise ConfigError(f"the state entry {name!r} of step {m.step} holds nothing to export")
    return Selection(name, keys, paths, prefix)


def tensor_parts(m: Manifest, sel: Selection) -> list[str]:
    """Dotted paths of the parts one level below ``sel`` that hold tensors only (what safetensors can take)."""
    kinds: dict[str, set[str]] = {}
    n = len(sel.prefix)
    if not n:
        return []
    for e in m.entries.values():
        if len(e.path) > n and tuple(e.path[:n]) == sel.prefix:
            kinds.setdefault(fqn_of(e.path[: n + 1]), set()).add(e.kind)
    return [k for k, v in kinds.items() if v == {"tensor"}]


def tensor_bytes(m: Manifest, fqn: str) -> int:
    """Bytes of the full tensor ``fqn`` (its shards together)."""
    e = m.entries[fqn]
    return sum(sh.nbytes for sh in e.shards) if isinstance(e, TensorEntry) else 0


def groups(m: Manifest, keys: Iterable[str], sel: Selection, limit: int = GROUP_BYTES) -> list[list[str]]:
    """Output keys in order, cut into groups of at most ``limit`` bytes (a larger tensor is a group alone)."""
    out: list[list[str]] = []
    size = 0
    for k in keys:
        n = tensor_bytes(m, sel.keys[k])
        if not out or (size + n > limit and out[-1]):
            out.append([])
            size = 0
        out[-1].append(k)
        size += n
    return out


def read_tensors(store: ChunkStore, m: Manifest, fqns: Iterable[str]) -> dict[str, torch.Tensor]:
    """Full tensors of ``fqns`` (shards consolidated, CRC32C checked), on CPU, in their saved dtype.

    Raises:
        CorruptCheckpointError: a chunk is missing, short or fails its CRC32C (naming it).
    """
    import torch.distributed.checkpoint as dcp

    from .._persist import quiet_dcp, unwrap
    from ..distributed import TrainguardLoadPlanner, TrainguardReader

    template: dict[str, Any] = {}
    for fqn in fqns:
        e = m.entries[fqn]
        assert isinstance(e, TensorEntry)
        template[fqn] = torch.empty(e.shape, dtype=dtype_from_name(e.dtype))
    if not template:
        return {}
    try:
        with quiet_dcp():
            dcp.load(
                template,
                storage_reader=TrainguardReader(store, m),
                planner=TrainguardLoadPlanner(),
                no_dist=True,
            )
    except BaseException as e:
        raise unwrap(e, m.step, prefer=CorruptCheckpointError) from None
    return template


def read_selection(
    store: ChunkStore,
    m: Manifest,
    sel: Selection,
    keys: Iterable[str] | None = None,
    *,
    progress: Callable[[int, int], None] | None = None,
    done: list[int] | None = None,
    total: int = 0,
) -> dict[str, Any]:
    """Output key -> tensor or decoded value, for ``keys`` (default: all of ``sel``), read group by group.

    ``progress(bytes_done, bytes_total)`` is called after each group; ``done`` (a one-item list) carries the
    bytes done across calls, ``total`` the bytes of the whole export.
    """
    from ..integrity.verify import read_value

    keys = list(sel.keys) if keys is None else list(keys)
    done = [0] if done is None else done
    total = total or sum(tensor_bytes(m, sel.keys[k]) for k in keys)
    out: dict[str, Any] = {}
    cache: dict[str, bytearray] = {}
    tensor_keys = [k for k in keys if isinstance(m.entries[sel.keys[k]], TensorEntry)]
    for k in keys:
        e = m.entries[sel.keys[k]]
        if isinstance(e, ValueEntry):
            out[k] = read_value(store, m, e, cache=cache)
    for group in groups(m, tensor_keys, sel):
        got = read_tensors(store, m, [sel.keys[k] for k in group])
        for k in group:
            out[k] = got[sel.keys[k]]
            done[0] += tensor_bytes(m, sel.keys[k])
        if progress is not None:
            progress(done[0], total)
    return {k: out[k] for k in keys}
