"""Optimizer state on restore: saved dtypes kept, and every parameter that had state at save time gets it back.

An optimizer-state dict is any ``{"state": {param key: {name: value}}, "param_groups": [{"params": [...]}]}``
inside a state entry (``torch.optim.Optimizer.state_dict()``, keyed by parameter index, or the ``"optim"`` part
of :class:`~trainguard.ModelOptimizerState`, keyed by parameter FQN). Two torch behaviours make a plain
``load_state_dict`` return a state different from the one saved, and both are undone here:

- ``Optimizer.load_state_dict`` casts floating-point state to its parameter's dtype (bf16 ``exp_avg`` of an
  fp32 parameter comes back fp32, and the resumed run diverges at once). :func:`restore_saved_dtypes` puts the
  loaded tensors back with the dtype they were saved with.
- A parameter whose state is missing from what is loaded silently restarts with empty state. At save time
  :func:`coverage` records which parameters had which state keys (manifest ``top_level.<key>.optimizer_state``);
  on restore :func:`missing_in_manifest` (before anything is loaded) and :func:`missing_after_load` check it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping
from itertools import chain
from typing import Any

import torch

from .flatten import key_text

SectionPath = tuple[Any, ...]


def _is_optimizer_sd(d: Mapping[Any, Any]) -> bool:
    groups = d.get("param_groups")
    return (
        isinstance(d.get("state"), Mapping)
        and isinstance(groups, list)
        and all(isinstance(g, Mapping) and isinstance(g.get("params"), list) for g in groups)
    )


def optimizer_sections(sd: Any, path: SectionPath = (), depth: int = 0) -> list[SectionPath]:
    """Key paths of the optimizer-state dicts inside ``sd`` (``()`` when ``sd`` is one), at most 3 levels deep."""
    if not isinstance(sd, Mapping):
        return []
    if _is_optimizer_sd(sd):
        return [path]
    if depth >= 3:
        return []
    out: list[SectionPath] = []
    for k, v in sd.items():
        if isinstance(v, Mapping):
            out += optimizer_sections(v, (*path, k), depth + 1)
    return out


def section_name(path: SectionPath) -> str:
    """The dotted name of a section path as recorded in the manifest (``""`` for the entry itself); keys as
    entry names show them (:func:`trainguard.state.flatten.key_text`: an Enum key by its value)."""
    return ".".join(key_text(k) for k in path)


def state_prefixes(entry_key: str, section: str) -> tuple[str, ...]:
    """The name prefixes of the per-parameter state entries of ``section`` in top-level entry ``entry_key``
    (``"opt.state."``). ``""`` names the entry itself and also a child under the key ``""``, whose entries
    are ``"opt..state.…"``: both prefixes then."""
    own = ".".join(x for x in (entry_key, section, "state") if x) + "."
    return (own, f"{entry_key}..state.") if entry_key and not section else (own,)


def renamed_sections(record: Any, live: Any) -> Any:
    """``record`` (a :func:`coverage` record) with the names of ``live``'s sections as a save before
    2026-12-04 wrote them (``str(key)``: ``"Role.GEN"`` for an Enum key) renamed to today's (``"gen"``)."""
    if not isinstance(record, Mapping):
        return record
    out = dict(record)
    for path in optimizer_sections(live):
        old, new = ".".join(str(k) for k in path), section_name(path)
        if old != new and old in out and new not in out:
            out[new] = out.pop(old)
    return out


def get_path(sd: Any, path: SectionPath) -> Any:
    for k in path:
        sd = sd[k]
    return sd


def coverage(sd: Any) -> dict[str, list[dict[str, Any]]]:
    """What a state entry's optimizer sections hold at save time: ``{section name: [{"keys": [state key names],
    "params": [param keys]}, ...]}``, parameters grouped by their set of state keys (JSON-able, compact)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for path in optimizer_sections(sd):
        groups: dict[tuple[str, ...], list[Any]] = {}
        for pid, st in get_path(sd, path)["state"].items():
            if isinstance(pid, bool) or not isinstance(pid, (int, str)):
                continue
            keys = tuple(sorted(key_text(k) for k in st)) if isinstance(st, Mapping) else ()
            groups.setdefault(keys, []).append(pid)
        out[section_name(path)] = [{"keys": list(k), "params": v} for k, v in groups.items()]
    return out


def _expected(record: Any) -> Iterable[tuple[str, Any, str]]:
    """``(section, param key, state key)`` triples of a :func:`coverage` record (malformed parts ignored)."""
    if not isinstance(record, Mapping):
        return
    for section, groups in record.items():
        if not isinstance(groups, list):
            continue
        for g in groups:
            if not isinstance(g, Mapping):
                continue
            for pid in g.get("params") or []:
                for key in g.get("keys") or []:
                    yield str(section), pid, str(key)


def missing_in_manifest(
    entry_key: str, record: Any, saved_fqns: Iterable[str], live_sections: Iterable[str] | None = None
) -> list[str]:
    """Optimizer state recorded at save time that no saved entry holds (FQNs, sorted).

    ``live_sections`` (for a record written before sections were named as entries are, 2026-12-04; None
    otherwise): the section names of the object restored into. A recorded section that is not one of them and
    has no saved entry beneath it is left out: such a save named a section under an Enum key ``"Role.GEN"``
    while its entries are ``gen.…``, and restored into an empty dict no live optimizer can lose its state.
    A record of a later save is checked whole."""
    fqns = set(saved_fqns)
    ancestors = {f.rsplit(".", n)[0] for f in fqns for n in range(1, f.count(".") + 1)}
    unknown: set[str] = set()
    if live_sections is not None and isinstance(record, Mapping):
        live = set(live_sections)
        for section in record:
            prefix = ".".join(p for p in (entry_key, str(section)) if p)
            if section not in live and prefix not in fqns and prefix not in ancestors:
                unknown.add(str(section))
    missing = []
    for section, pid, key in _expected(record):
        if section in unknown:
            continue
        wants = [f"{prefix}{pid}.{key}" for prefix in state_prefixes(entry_key, section)]
        if any(_held(w, fqns, ancestors) for w in wants):
            continue
        missing.append(wants[0])
    return sorted(missing)


def _held(want: str, fqns: set[str], ancestors: set[str]) -> bool:
    """Whether the saved entries hold ``want``: as an entry, beneath one, or inside a value leaf above it."""
    if want in fqns or want in ancestors:
        return True
    parts = want.split(".")
    return any(".".join(parts[:i]) in fqns for i in range(1, len(parts)))


def param_map_by_order(saved_groups: list[Any], optimizer: torch.optim.Optimizer) -> dict[Any, torch.Tensor]:
    """Saved parameter key -> live parameter, paired by position as ``Optimizer.load_state_dict`` pairs them."""
    saved = chain.from_iterable(g.get("params", []) for g in saved_groups if isinstance(g, Mapping))
    live = chain.from_iterable(g["params"] for g in optimizer.param_groups)
    return dict(zip(saved, live, strict=False))


def _put_back(saved: Any, live: Any, key: Any) -> None:
    cur = live[key]
    if isinstance(saved, torch.Tensor) and isinstance(cur, torch.Tensor):
        if cur.dtype == saved.dtype:
            return
        same_layout = (
            type(saved) is type(cur)
            and saved.shape == cur.shape
            and getattr(saved, "placements", None) == getattr(cur, "placements", None)
        )
        if same_layout:  # the loaded tensor itself: exact whatever the parameter dtype
            live[key] = saved if saved.device == cur.device else saved.to(device=cur.device)
        else:  # resharded on the way in (e.g. a full state dict): cast back, exact from a wider dtype
            live[key] = cur.to(dtype=saved.dtype)
    elif isinstance(saved, Mapping) and isinstance(cur, MutableMapping):
        for k, v in saved.items():
            if k in cur:
                _put_back(v, cur, k)
    elif isinstance(saved, (list, tuple)) and isinstance(cur, list) and len(cur) == len(saved):
        for i, v in enumerate(saved):
            _put_back(v, cur, i)


def restore_saved_dtypes(
    optimizer: torch.optim.Optimizer, section: Mapping[str, Any], params: Mapping[Any, torch.Tensor]
) -> None:
    """Undo ``load_state_dict``'s cast of floating-point state to the parameter dtype: every state tensor whose
    live dtype differs from the loaded one is replaced by the loaded tensor (moved to the live device only).

    Args:
        optimizer: the optimizer after ``load_state_dict``.
        section: the optimizer-state dict that was loaded (saved dtypes).
        params: saved parameter key -> live parameter.
    """
    for pid, st in section.get("state", {}).items():
        p = params.get(pid)
        live = optimizer.state.get(p) if p is not None else None
        if isinstance(live, MutableMapping) and isinstance(st, Mapping):
            for k, v in st.items():
                if k in live:
                    _put_back(v, live, k)


def missing_after_load(
    optimizer: torch.optim.Optimizer, record: Any, section: str, params: Mapping[Any, torch.Tensor]
) -> list[str]:
    """``"param key.state key"`` names recorded at save time that the live optimizer does not hold."""
    missing = []
    for sec, pid, key in _expected(record):
        if sec != section:
            continue
        p = params.get(pid)
        st = optimizer.state.get(p) if p is not None else None
        if not isinstance(st, Mapping) or key not in {str(k) for k in st}:
            missing.append(f"{pid}.{key}")
    return missing
