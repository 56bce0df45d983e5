"""Matching the entries of a checkpoint to the state given to restore, and reporting what differs.

Names are matched exactly first. What is left on both sides is matched by its *canonical* name, with the
prefixes that wrappers add to parameter names removed (``_orig_mod.`` of ``torch.compile``,
``_checkpoint_wrapped_module.`` of activation checkpointing, ``_fsdp_wrapped_module.`` of FSDP1 and DDP's
``module.``), as DCP's ``get_state_dict`` does for :class:`~trainguard.ModelOptimizerState`; a canonical name
matches only when it is unique on both sides, so a module really named ``module`` is never confused.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

WRAPPER_SEGMENTS = frozenset({"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module", "module"})
MAX_LISTED = 20


def canonical_name(name: str) -> str:
    """``name`` without wrapper segments: ``"_orig_mod.module.layer.weight"`` -> ``"layer.weight"``."""
    return ".".join(s for s in name.split(".") if s not in WRAPPER_SEGMENTS)


def match_names(saved: Mapping[str, str], live: Mapping[str, str]) -> dict[str, str]:
    """Pair saved entries with live ones.

    Args:
        saved: saved FQN -> its name relative to the state entry (without the top-level key).
        live: live FQN -> its relative name.

    Returns:
        saved FQN -> live FQN, for every pair matched exactly or by a unique canonical name.
    """
    out = {f: f for f in saved if f in live}
    rest_saved = {f: canonical_name(rel) for f, rel in saved.items() if f not in out}
    taken = set(out.values())
    rest_live = {f: canonical_name(rel) for f, rel in live.items() if f not in taken}
    n_saved = Counter(rest_saved.values())
    n_live = Counter(rest_live.values())
    by_canon = {c: f for f, c in rest_live.items() if n_live[c] == 1}
    for f, c in rest_saved.items():
        if n_saved[c] == 1 and c in by_canon:
            out[f] = by_canon[c]
    return out


def listing(names: Iterable[str]) -> str:
    """Up to ``MAX_LISTED`` names, comma-separated, then how many more."""
    names = sorted(names)
    head = ", ".join(names[:MAX_LISTED])
    more = len(names) - MAX_LISTED
    return head + (f" ... and {more} more" if more > 0 else "")


def mismatch_message(
    step: int,
    entry: str,
    *,
    only_saved: Iterable[str] = (),
    only_live: Iterable[str] = (),
    dtypes: Iterable[tuple[str, str, str]] = (),
    shapes: Iterable[tuple[str, tuple[int, ...], tuple[int, ...]]] = (),
    missing_optim: Iterable[str] = (),
    fix: str | None = None,
) -> str:
    """The StateMismatchError text for one state entry: every difference, checkpoint side and target side
    (each kind: the first ``MAX_LISTED`` names, sorted, then how many more).

    Args:
        step: the checkpoint's step.
        entry: the top-level state entry.
        only_saved, only_live: keys only in the checkpoint, only in the target.
        dtypes: ``(key, checkpoint dtype, target dtype)`` of each dtype difference.
        shapes: ``(key, checkpoint shape, target shape)`` of each shape difference.
        missing_optim: optimizer state recorded at save time but not restored.
        fix: the advice ending the message (default: fix the target, restore into ``{}``, or strict=False).

    Returns:
        The message, one line per kind of difference.
    """
    lines = []
    shapes = list(shapes)
    if shapes:
        shown = [f"{f} (checkpoint {a}, target {b})" for f, a, b in sorted(shapes)]
        lines.append(f"shape differs ({len(shapes)}): {listing(shown)}")
    only_saved, only_live, dtypes = list(only_saved), list(only_live), list(dtypes)
    missing_optim = list(missing_optim)
    if only_saved:
        lines.append(f"only in the checkpoint ({len(only_saved)}): {listing(only_saved)}")
    if only_live:
        lines.append(f"only in the target ({len(only_live)}): {listing(only_live)}")
    if dtypes:
        shown = [f"{f} (checkpoint {a}, target {b})" for f, a, b in sorted(dtypes)]
        lines.append(f"dtype differs ({len(dtypes)}): {listing(shown)}")
    if missing_optim:
        lines.append(
            f"optimizer state recorded at save time but not restored ({len(missing_optim)}): "
            f"{listing(missing_optim)}"
        )
    if fix is None and shapes:
        fix = (
            "Build the model with the configuration the checkpoint was saved with (shapes must match even "
            "with strict=False), or restore into an empty dict "
            f"({{{entry!r}: {{}}}}) to get everything as saved."
        )
    elif fix is None:
        fix = (
            "Fix the target (same keys and dtypes as saved), restore into an empty dict "
            f"({{{entry!r}: {{}}}}) to get everything as saved, or pass strict=False to load what matches "
            "(converting dtypes to the target's)."
        )
    return (
        f"state entry {entry!r} does not match the checkpoint of step {step}:\n  "
        + "\n  ".join(lines)
        + "\n"
        + fix
    )
