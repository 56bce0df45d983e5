"""``export``: a trainguard checkpoint as a safetensors file (or sharded safetensors with Hugging Face's index
JSON), a directory plain ``torch.distributed.checkpoint.load`` reads, or a ``torch.save`` file.

Sharded tensors are consolidated into full tensors. The output appears only when complete: it is written
under a temporary name beside ``out`` and renamed into place last, so an export that fails or is killed
leaves no file that looks finished.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._optional import require
from ..errors import ConfigError
from ..state.flatten import unflatten
from .select import Selection, groups, open_checkpoint, read_selection, select, tensor_bytes, tensor_parts

FORMATS = ("safetensors", "dcp", "torch")
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # "5GB", Hugging Face's default max_shard_size
SAFETENSORS_INDEX = "model.safetensors.index.json"


@dataclass
class ExportResult:
    """What ``export`` wrote.

    Attributes:
        step: the exported checkpoint's step.
        format: ``"safetensors"``, ``"dcp"`` or ``"torch"``.
        out: the file or directory written.
        entry: what was exported (``"model"``, ``"app.model"``, ``"the whole state"``).
        tensors: number of tensors written.
        values: number of non-tensor values written (only with the whole state).
        bytes: bytes of tensor data written (before any format overhead).
        files: the files written, relative to ``out`` when it is a directory (``[]`` for a single file).
    """

    step: int
    format: str
    out: str
    entry: str
    tensors: int
    values: int
    bytes: int
    files: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def export(
    root: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    format: str,  # noqa: A002 - the CLI's option name
    step: int | None = None,
    entry: str | None = None,
    all_state: bool = False,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    progress: Callable[[int, int], None] | None = None,
) -> ExportResult:
    """Export the checkpoint of ``step`` under ``root`` to ``out`` in ``format``.

    By default the weights of the state entry ``model`` (or the model inside a ``ModelOptimizerState``
    entry, or ``lightning.state_dict`` in a checkpoint of ``tg.lightning.TrainguardCheckpointIO``), keyed by the model's own ``state_dict`` keys, so ``model.load_state_dict(...)`` accepts them.

    - ``safetensors``: ``out`` is one file ``safetensors.torch.load_file`` reads when the tensors total at
      most ``max_shard_bytes``; else a directory of ``model-0000K-of-0000N.safetensors`` files with
      ``model.safetensors.index.json`` (``{"metadata": {"total_size"}, "weight_map": {key: file}}``), the
      layout Hugging Face uses. Holds tensors only: ``all_state`` is refused when the state has values.
    - ``dcp``: ``out`` is a directory ``torch.distributed.checkpoint.load`` reads (DCP's own format, with its
      pickled ``.metadata``), loadable at any world size.
    - ``torch``: ``out`` is a ``torch.save`` file that ``torch.load(out, weights_only=True)`` reads; with
      ``all_state`` the nested state as saved.

    Args:
        root: the run root.
        out: the output path; it must not exist yet.
        format: ``"safetensors"``, ``"dcp"`` or ``"torch"``.
        step: the checkpoint's step (default: the newest valid one).
        entry: the state entry to export, or a dotted path to a part of one (``lightning.state_dict``);
            default as above.
        all_state: export the whole state (model, optimizer, scheduler, RNG, data position) keyed by FQN.
        max_shard_bytes: largest safetensors file, in bytes (default 5 GB = 5e9 bytes); a single larger
            tensor gets a file of its own.
        progress: called as ``progress(bytes_done, bytes_total)`` as tensors are read.

    Returns:
        An :class:`ExportResult`.

    Raises:
        ConfigError: an unknown format, ``out`` exists, no entry to export, or values with safetensors.
        CheckpointNotFoundError: no committed checkpoint of ``step``.
        NoValidCheckpointError: ``step`` not given and no checkpoint is valid.
        CorruptCheckpointError: the checkpoint is not valid or a chunk fails its CRC32C (nothing is written).
        MissingDependencyError: ``safetensors`` output without the ``safetensors`` package.
    """
    if format not in FORMATS:
        raise ConfigError(f"unknown export format {format!r}; use one of {', '.join(FORMATS)}")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ConfigError(f"max_shard_bytes must be an int > 0, got {max_shard_bytes!r}")
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise ConfigError(f"{out} already exists; remove it or choose another output path")
    if not out.parent.is_dir():
        raise ConfigError(f"the folder of {out} does not exist; create it first")
    if format == "safetensors":
        require("safetensors.torch", feature="export --format safetensors")
    store, m = open_checkpoint(root, step)
    sel = select(m, entry, all_state=all_state)
    values = [k for k, fqn in sel.keys.items() if m.entries[fqn].kind == "value"]
    if format == "safetensors" and values:
        shown = ", ".join(values[:5]) + (f" and {len(values) - 5} more" if len(values) > 5 else "")
        raise ConfigError(
            f"safetensors holds tensors only, but {sel.name} of step {m.step} also holds values ({shown}); "
            "export it with --format dcp or --format torch, or "
            + (
                "export the model weights alone (no --all)"
                if all_state
                else _tensor_hint(tensor_parts(m, sel))
            )
        )
    tensor_keys = [k for k in sel.keys if k not in set(values)]
    total = sum(tensor_bytes(m, sel.keys[k]) for k in tensor_keys)
    result = ExportResult(m.step, format, str(out), sel.name, len(tensor_keys), len(values), total)
    done = [0]
    if format == "safetensors" and total > max_shard_bytes:
        result.files = _safetensors_sharded(
            store, m, sel, tensor_keys, out, max_shard_bytes, progress, done, total
        )
        return result
    data = read_selection(store, m, sel, progress=progress, done=done, total=total)
    if format == "safetensors":
        with _atomic_file(out) as tmp:
            _save_safetensors(data, tmp, m.step)
    elif format == "torch":
        obj = unflatten(data, sel.paths) if all_state else data
        with _atomic_file(out) as tmp:
            torch.save(obj, tmp)
    else:
        obj = unflatten(data, sel.paths) if all_state else data
        with _atomic_dir(out) as tmp:
            _save_dcp(obj, tmp)
        result.files = sorted(p.name for p in out.iterdir())
    return result


def _tensor_hint(parts: list[str]) -> str:
    if not parts:
        return "choose an entry that holds tensors only with --entry (entry=...)"
    shown = ", ".join(repr(p) for p in parts[:5]) + (f" and {len(parts) - 5} more" if len(parts) > 5 else "")
    return f"choose a part that holds tensors only with --entry (entry=...): {shown}"


def _save_safetensors(tensors: dict[str, Any], path: Path, step: int) -> None:
    st = require("safetensors.torch", feature="export --format safetensors")
    # "format": "pt" is what Hugging Face's from_pretrained expects in a safetensors header.
    st.save_file(
        {k: t.contiguous() for k, t in tensors.items()},
        str(path),
        metadata={"format": "pt", "trainguard_step": str(step)},
    )
    # safetensors creates 0600 files; an export is for sharing: the usual mode, as torch.save's files get
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def _safetensors_sharded(
    store: Any,
    m: Any,
    sel: Selection,
    keys: list[str],
    out: Path,
    max_shard_bytes: int,
    progress: Callable[[int, int], None] | None,
    done: list[int],
    total: int,
) -> list[str]:
    """Write ``model-0000K-of-0000N.safetensors`` files of at most ``max_shard_bytes`` each, and the index.
    Only one file's tensors are in memory at a time."""
    shards = groups(m, keys, sel, limit=max_shard_bytes)
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map: dict[str, str] = {}
    with _atomic_dir(out) as tmp:
        for name, shard in zip(names, shards, strict=True):
            data = read_selection(store, m, sel, shard, progress=progress, done=done, total=total)
            _save_safetensors(data, tmp / name, m.step)
            del data
            weight_map.update({k: name for k in shard})
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return [*names, SAFETENSORS_INDEX]


def _save_dcp(state: dict[str, Any], path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from .._persist import quiet_dcp, unwrap

    try:
        with quiet_dcp():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        inner = unwrap(e)
        text = str(inner)
        if isinstance(inner, ValueError) and "duplicated flatten key" in text:
            key = text.rsplit("duplicated flatten key", 1)[1].strip()
            raise ConfigError(
                f"DCP joins nested keys with '.', and two keys of this state become {key!r} (e.g. an int key "
                "5 beside a str key '5'); export it with --format torch, which keeps the nested keys as they are"
            ) from None
        raise


def _tmp_name(out: Path) -> Path:
    return out.with_name(f".{out.name}.partial-{uuid.uuid4().hex[:8]}")


@contextmanager
def _atomic_file(out: Path) -> Iterator[Path]:
    """A temporary path beside ``out``; on success fsynced and renamed to ``out``, on failure removed."""
    tmp = _tmp_name(out)
    try:
        yield tmp
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if out.exists():
            raise ConfigError(f"{out} appeared while exporting; the export is left at {tmp}")
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextmanager
def _atomic_dir(out: Path) -> Iterator[Path]:
    """A temporary directory beside ``out``; on success renamed to ``out``, on failure removed."""
    tmp = _tmp_name(out)
    tmp.mkdir()
    try:
        yield tmp
        for p in tmp.iterdir():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        os.rename(tmp, out)  # fails if out appeared meanwhile (a non-empty directory or a file)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
