"""``import_checkpoint``: an existing checkpoint (a DCP directory, a ``torch.save`` file, safetensors) becomes
a trainguard checkpoint that ``CheckpointManager.restore`` loads.

Nothing from the source runs: a ``torch.save`` file is read with ``torch.load(weights_only=True)`` and refused
with the reason when that fails; a DCP directory's pickled ``.metadata`` is read by an unpickler that builds
only DCP's own metadata records (anything else is refused), its relative paths are checked to stay inside the
directory, and its values are read with ``weights_only=True``; safetensors holds no code.
"""

from __future__ import annotations

import io
import json
import os
import pickle
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .._optional import require
from ..errors import CheckpointExistsError, ConfigError, RunConflictError, UnsafeCheckpointError, plain_text
from ..format import validate_relpath
from ..format.layout import as_step

FORMATS = ("dcp", "torch", "safetensors")


@dataclass
class ImportResult:
    """What ``import_checkpoint`` committed.

    Attributes:
        step: the step of the new checkpoint.
        root: the run root it was committed under.
        format: the source's format.
        entries: the state entries of the new checkpoint (``["model"]`` by default).
        tensors: number of tensors imported.
        values: number of non-tensor values imported.
        bytes: bytes of tensor data imported.
    """

    step: int
    root: str
    format: str
    entries: list[str]
    tensors: int
    values: int
    bytes: int

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def import_checkpoint(
    src: str | os.PathLike[str],
    root: str | os.PathLike[str],
    *,
    format: str,  # noqa: A002 - the CLI's option name
    step: int,
    entry: str = "model",
    key: str | None = None,
    all_state: bool = False,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> ImportResult:
    """Read ``src`` and commit it under ``root`` as the checkpoint of ``step``.

    The source must be a flat ``state_dict`` (str -> tensor), which becomes the state entry ``entry``;
    for a nested source (``{"model": ..., "optimizer": ..., "epoch": 3}``) pick one part with ``key`` or
    import each top-level key as an entry of its own with ``all_state``. Restore with
    ``CheckpointManager(root).restore(step, {"model": model})``.

    Args:
        src: a ``torch.save`` file, a DCP checkpoint directory, or a ``.safetensors`` file / a directory of
            them (with ``model.safetensors.index.json``, or holding exactly one ``.safetensors`` file).
        root: the run root (created if missing; must not be locked by a running job).
        format: ``"dcp"``, ``"torch"`` or ``"safetensors"``.
        step: the step of the new checkpoint (int >= 0).
        entry: the state entry the imported tensors become.
        key: take ``src[key]`` of a nested source as the state dict.
        all_state: import every top-level key of a nested source as an entry (``entry`` is ignored).
        overwrite: replace an existing checkpoint of ``step``.
        progress: called as ``progress(bytes_done, bytes_total)`` while reading.

    Returns:
        An :class:`ImportResult`.

    Raises:
        ConfigError: a bad argument, a missing ``src``, or a source whose layout does not fit (the message
            lists its keys and the option to use).
        UnsafeCheckpointError: ``src`` would need code execution to load (a pickle ``weights_only`` refuses,
            DCP metadata naming other classes, a path leaving the directory); nothing is imported.
        CheckpointExistsError: ``step`` is committed under ``root`` and ``overwrite`` is False.
        RunConflictError: ``root`` holds a checkpoint after ``step`` (an import continues the root's history:
            after its newest checkpoint it continues that run; with ``overwrite`` it replaces ``step`` as a run of
            its own, the older checkpoints kept apart).
        RootLockedError: a running job holds ``root``.
        MissingDependencyError: safetensors input without the ``safetensors`` package.
    """
    from ..manager import CheckpointManager

    if format not in FORMATS:
        raise ConfigError(f"unknown import format {format!r}; use one of {', '.join(FORMATS)}")
    step = as_step(step)
    if key is not None and all_state:
        raise ConfigError("give either --key or --all, not both")
    if format == "safetensors":
        require("safetensors", feature="import --format safetensors")
    src = Path(src)
    if not src.exists():
        raise ConfigError(f"{src} does not exist")
    replaces = _check_root(root, step, overwrite)
    if format == "torch":
        obj = read_torch(src)
    elif format == "dcp":
        obj = read_dcp(src, progress=progress)
    else:
        obj = read_safetensors(src, progress=progress)
    state = _as_state(obj, src, format, entry=entry, key=key, all_state=all_state)
    tensors = [t for t in _leaves(state) if isinstance(t, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    # An import is a save that did not restore. After every existing checkpoint it continues the root's newest
    # run (the lineage records it as the parent); replacing a checkpoint (overwrite) starts a run of its own at
    # that step, the older checkpoints kept apart. The manager's own run check still guards against a job that
    # saved meanwhile.
    with CheckpointManager(root, async_save=False, keep=None, new_run=replaces) as mgr:
        mgr.save(
            step,
            state,
            metadata={"imported_from": str(src.resolve()), "import_format": format},
            overwrite=overwrite,
        )
    n_values = sum(1 for v in _leaves(state) if not isinstance(v, torch.Tensor))
    return ImportResult(step, str(root), format, list(state), len(tensors), n_values, nbytes)


def _check_root(root: str | os.PathLike[str], step: int, overwrite: bool) -> bool:
    """Refuse an import that would collide with the root's checkpoints, before reading the source; returns
    whether the import replaces the committed checkpoint of ``step`` (``overwrite``).

    Raises:
        CheckpointExistsError: ``step`` is committed and ``overwrite`` is False.
        RunConflictError: the root holds a checkpoint after ``step``: the import would interleave with that run
            (a later resume or retention would mix the two).
    """
    from ..catalog import committed_split

    committed, _ = committed_split(root)
    exists = step in committed
    if exists and not overwrite:
        raise CheckpointExistsError(
            f"step {step} already has a committed checkpoint under {root}; pass overwrite=True (--overwrite) to "
            "replace it, or import at another step"
        )
    later = [s for s in committed if s > step]
    if later:
        raise RunConflictError(
            f"{root} holds checkpoints after step {step} (steps {later[0]}..{later[-1]}); an import at step {step} "
            "would interleave with that run (a restart or retention would mix the two). Import at a step after "
            f"{later[-1]} to continue that run, or import into a new run root."
        )
    return exists


def _leaves(x: Any) -> list[Any]:
    if isinstance(x, Mapping):
        return [leaf for v in x.values() for leaf in _leaves(v)]
    if isinstance(x, (list, tuple)) and any(isinstance(v, (torch.Tensor, Mapping)) for v in x):
        return [leaf for v in x for leaf in _leaves(v)]
    return [x]


def _is_flat_state_dict(obj: Any) -> bool:
    return isinstance(obj, Mapping) and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()
    )


def _as_state(
    obj: Any, src: Path, fmt: str, *, entry: str, key: str | None, all_state: bool
) -> dict[str, Any]:
    """The state to save: ``{entry: state_dict}``, or each top-level key of ``obj`` with ``all_state``."""
    if not isinstance(obj, Mapping):
        raise ConfigError(
            f"{src} holds a {type(obj).__name__}, not a dict; import needs a state_dict (str -> tensor) or a "
            "dict of them"
        )
    keys = [str(k) for k in obj]
    if all_state:
        if not all(isinstance(k, str) for k in obj):
            raise ConfigError(f"{src}: --all needs str keys at the top level, got {keys[:10]}")
        return dict(obj)
    if key is not None:
        if key not in obj:
            raise ConfigError(f"{src} has no key {key!r}; its keys are {keys[:20]}")
        obj = obj[key]
        if not isinstance(obj, Mapping):
            raise ConfigError(f"{src}[{key!r}] holds a {type(obj).__name__}, not a state_dict")
    if not _is_flat_state_dict(obj):
        where = f"{src}[{key!r}]" if key is not None else str(src)
        raise ConfigError(
            f"{where} is not a flat state_dict (str -> tensor); its keys are {keys[:20]}"
            + (
                ""
                if key is not None
                else "; pass --key NAME to import one of them, or --all to import each as an entry"
            )
        )
    if not entry:
        raise ConfigError("entry must be a non-empty name")
    return {entry: dict(obj)}


# -- torch.save files -----------------------------------------------------------------------------------------
def read_torch(src: Path) -> Any:
    """``torch.load(src, weights_only=True)`` on CPU.

    Raises:
        UnsafeCheckpointError: ``weights_only`` refuses the file (it needs arbitrary classes or code to load);
            the message names what it contains and how to re-save it.
    """
    if src.is_dir():
        raise ConfigError(
            f"{src} is a directory; --format torch takes a torch.save file (a DCP directory: --format dcp)"
        )
    try:
        return torch.load(src, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any refusal means it would need unpickling arbitrary objects
        why = refusal_reason(e)
        raise UnsafeCheckpointError(
            f"refusing to import {src}: {why}. trainguard loads torch.save files only with "
            "torch.load(weights_only=True), which never runs code from the file; re-save it as plain tensors "
            "(torch.save(model.state_dict(), path)) where it was made, or as safetensors"
        ) from None


def refusal_reason(e: BaseException) -> str:
    """Why ``torch.load(weights_only=True)`` refused: the global it would build, else torch's first line of
    fact. torch's own advice (``weights_only=False``) would run the file's code, so it is left out."""
    import re

    text = plain_text(str(e))
    found = re.search(r"GLOBAL (\S+)", text)
    if found:
        return f"it contains {found.group(1)}, which torch.load(weights_only=True) refuses to build"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    facts = [ln for ln in lines if not ln.startswith(("Weights only load failed", "Check the documentation"))]
    return (facts[0] if facts else type(e).__name__)[:200]


# -- DCP directories ------------------------------------------------------------------------------------------
# The classes DCP's .metadata pickle may build (torch 2.x); anything else is refused, never imported.
_DCP_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", n)
    for n in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("torch", "Size"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
}


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP's metadata records and dtypes only (the Python docs' "restricting globals")."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(
            f"the DCP metadata names {module}.{name}, which is not one of DCP's metadata records; refusing to "
            "build it (it could run code)"
        )


def read_dcp_metadata(src: Path) -> Any:
    """DCP's ``Metadata`` of the checkpoint directory ``src``, read without running code from it.

    Raises:
        ConfigError: ``src`` is not a DCP checkpoint directory.
        UnsafeCheckpointError: the metadata names other classes, or a storage path leaves ``src``.
    """
    from torch.distributed.checkpoint.metadata import Metadata

    meta = src / ".metadata"
    if not src.is_dir() or not meta.is_file():
        raise ConfigError(f"{src} is not a DCP checkpoint directory (no .metadata file in it)")
    try:
        md = _MetadataUnpickler(io.BytesIO(meta.read_bytes())).load()
    except UnsafeCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged pickle
        raise UnsafeCheckpointError(
            f"{meta} does not parse as DCP metadata ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(md, Metadata):
        raise UnsafeCheckpointError(f"{meta} holds a {type(md).__name__}, not DCP Metadata")
    for info in (md.storage_data or {}).values():
        validate_relpath(getattr(info, "relative_path", None), src)  # type: ignore[arg-type]
    return md


def read_dcp(src: Path, *, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Every entry of the DCP checkpoint ``src`` as full CPU tensors and values, nested as it was saved.

    Raises:
        ConfigError / UnsafeCheckpointError: as :func:`read_dcp_metadata`; a value ``weights_only`` refuses.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from .._persist import quiet_dcp
    from ..state.flatten import PathT, unflatten

    md = read_dcp_metadata(src)

    class SafeReader(dcp.FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            return md

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            try:
                self.state_dict[fqn] = torch.load(value, weights_only=True)
            except Exception as e:  # noqa: BLE001
                raise UnsafeCheckpointError(
                    f"refusing to import {src}: its value {fqn!r} is refused by torch.load(weights_only=True) "
                    f"({refusal_reason(e)}); nothing from it was run or imported"
                ) from None

    template: dict[str, Any] = {}
    total = 0
    for fqn, tmd in md.state_dict_metadata.items():
        if isinstance(tmd, TensorStorageMetadata):
            template[fqn] = torch.empty(tuple(tmd.size), dtype=tmd.properties.dtype)
            total += template[fqn].numel() * template[fqn].element_size()
        else:
            template[fqn] = None
    try:
        with quiet_dcp():
            dcp.load(
                template,
                storage_reader=SafeReader(str(src)),
                planner=SafePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                no_dist=True,
            )
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        from .._persist import unwrap

        raise unwrap(e) from None
    if progress is not None:
        progress(total, total)
    # DCP records how it flattened nested dicts (planner_data: fqn -> keys); rebuild that nesting.
    paths: dict[str, PathT] = {}
    for fqn in template:
        keys = (md.planner_data or {}).get(fqn)
        if isinstance(keys, (tuple, list)) and keys and all(isinstance(k, (str, int)) for k in keys):
            paths[fqn] = tuple(("s" if isinstance(k, str) else "l", k) for k in keys)
        else:
            paths[fqn] = (("s", fqn),)
    try:
        return unflatten(template, paths)
    except Exception:  # noqa: BLE001 - inconsistent nesting: keep the flat keys
        return template


# -- safetensors ----------------------------------------------------------------------------------------------
def _safetensors_files(src: Path) -> list[Path]:
    if src.is_file():
        return [src]
    index = src / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ConfigError(f"{index} is not a safetensors index ({type(e).__name__}: {e})") from None
        for n in names:
            if not isinstance(n, str) or "/" in n:
                raise UnsafeCheckpointError(
                    f"{index} names the file {n!r}; only files beside the index are read"
                )
            validate_relpath(n, src)
        return [src / n for n in names]
    found = sorted(src.glob("*.safetensors"))
    if len(found) != 1:
        raise ConfigError(
            f"{src} holds {len(found)} .safetensors files and no model.safetensors.index.json; give one file"
        )
    return found


def read_safetensors(src: Path, *, progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """The tensors of a safetensors file, or of every file of a sharded safetensors directory.

    Raises:
        ConfigError: a missing file, a key in two files, or a file that is not safetensors.
        MissingDependencyError: the ``safetensors`` package is not installed.
    """
    require("safetensors", feature="import --format safetensors")
    from safetensors import safe_open

    files = _safetensors_files(src)
    total = sum(f.stat().st_size for f in files if f.is_file())
    out: dict[str, torch.Tensor] = {}
    done = 0
    for f in files:
        if not f.is_file():
            raise ConfigError(f"{f} is missing (named by the index of {src})")
        try:
            with safe_open(str(f), framework="pt") as fh:
                for k in fh.keys():
                    if k in out:
                        raise ConfigError(f"tensor {k!r} is in two files of {src}")
                    out[k] = fh.get_tensor(k)
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - SafetensorError and friends
            raise ConfigError(f"{f} is not a readable safetensors file ({type(e).__name__}: {e})") from None
        done += f.stat().st_size
        if progress is not None:
            progress(done, total)
    return out
