"""The inspection commands on object-store run roots (``trainguard ls|info|verify s3://bucket/run1``) and the
``tiers`` column of a hot root's listing. Credentials and endpoint come from the standard environment
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import click

from ..errors import ConfigError, TrainguardError
from .text import echo


def open_remote(url: str) -> Any:
    from ..storage.objects import open_objects
    from ..tiers.remote import RemoteRoot

    try:
        store = open_objects(url, stall_timeout_s=30.0)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    if getattr(store, "unreachable", None):
        raise click.UsageError(f"{url} cannot be reached: {store.unreachable}")
    return RemoteRoot(store)


def remote_run_roots(store: Any, limit: int = 20) -> list[str]:
    """The run roots below ``store``'s URL (not itself): the prefixes holding committed ``step-N/manifest.json``
    objects, at most ``limit``, sorted (one recursive listing)."""
    import re

    from ..format import MANIFEST_NAME

    pattern = re.compile(rf"^(.+)/step-\d+/{re.escape(MANIFEST_NAME)}$")
    roots = sorted({m.group(1) for name in store.list("") if (m := pattern.match(name))})
    return [f"{store.url}/{r}" for r in roots[:limit]]


def ls_url(url: str, as_json: bool) -> None:
    """``trainguard ls URL``: the table (or ``--json`` rows) of the run root at ``url``. A URL that holds no
    checkpoint exits 1 naming the run roots below it (as a local folder does)."""
    remote = open_remote(url)
    rows = [r.to_json() for r in remote.scan()]
    if not rows and not remote.store.list(""):
        message = f"no checkpoints in {url} (nothing is stored under it)"
    elif not rows:
        runs = remote_run_roots(remote.store)
        message = f"no checkpoints in {url}" + (
            f"; it is not a run root but holds {len(runs)} run root(s): {', '.join(runs)}. Give one of them, "
            f"e.g. `trainguard ls {runs[0]}`"
            if runs
            else " (not a run root: it holds no step-N/manifest.json objects)"
        )
    else:
        message = ""
    if message:
        if as_json:
            echo(json.dumps({"error": message}))
        echo(f"ls: {message}", err=True)
        sys.exit(1)
    if as_json:
        echo(json.dumps(rows, indent=1))
        return
    from .inspect import print_listing

    print_listing(url, rows)


def verify_url(
    url: str,
    step: int | None,
    all_steps: bool,
    as_json: bool,
    *,
    on_read: Any = None,
) -> None:
    """``trainguard verify URL``; ``on_read(nbytes)`` is called after each object read (the
    ``--max-bandwidth`` cap sleeps there)."""
    remote = open_remote(url)
    committed = remote.committed_steps()
    if step is not None:
        steps = [step]
    elif all_steps:
        steps = committed
    else:
        steps = committed[-1:]
    report: dict[str, Any] = {"ok": bool(steps), "checked": [], "corrupt": [], "bytes_read": 0}
    if not steps:
        report["error"] = f"no committed checkpoint in {url}; nothing was verified"
    for s in steps:
        problem, chunk, read = remote.verify(s, on_read=on_read)
        report["checked"].append(s)
        report["bytes_read"] += read
        if problem is not None:
            report["ok"] = False
            report["corrupt"].append({"step": s, "chunk": chunk, "tensors": [], "problem": problem})
    if as_json:
        echo(json.dumps(report, indent=1))
    else:
        from .inspect import corrupt_line, verify_summary

        for s in report["checked"]:
            bad = [c for c in report["corrupt"] if c["step"] == s]
            echo(f"step {s}: ok" if not bad else corrupt_line(s, bad[0]["problem"]))
        if "error" in report:
            echo(f"FAILED: {report['error']}", err=True)
        else:
            n_bad = len({c["step"] for c in report["corrupt"]})
            echo(verify_summary(report["ok"], len(report["checked"]), n_bad, report["bytes_read"]))
    sys.exit(0 if report["ok"] else 1)


def url_cache(url: str, step: int | None) -> Path:
    """Copy the checkpoint of ``step`` (default: the newest restorable) of ``url`` into its local cache (the
    hot root a manager on that URL uses) and return the cache, for ``info``."""
    from ..tiers.attach import TierSet, cache_root, open_links
    from ..tiers.config import Tier

    cache = cache_root(url.rstrip("/"))
    cache.mkdir(parents=True, exist_ok=True)
    try:
        links = open_links(cache, [Tier(url)], lambda *a, **k: None)
        done = TierSet(cache, links, lambda *a, **k: None).materialize(step)
    except (OSError, TrainguardError) as e:
        raise click.UsageError(f"{url}: {e}") from None
    if done is None:
        echo(f"no restorable checkpoint{'' if step is None else f' of step {step}'} in {url}", err=True)
        sys.exit(1)
    return cache


def tier_listing(hot: Path, infos: list[Any]) -> list[Any] | None:
    """The hot root's checkpoints ``infos`` with each step's ``tiers`` mapping, plus the steps held only by a
    tier (as ``CheckpointManager.checkpoints()`` lists them), for the tiers recorded in ``hot``; None when it
    records none (or none of them can be opened)."""
    from ..tiers.attach import TierSet, listing, read_record
    from ..tiers.config import Tier
    from ..tiers.upload import TierLink

    recorded = read_record(hot)
    if not recorded:
        return None
    links = []
    for t in recorded:
        opts = t.get("storage_options") if isinstance(t.get("storage_options"), dict) else None
        try:
            from ..storage.objects import open_objects

            links.append(TierLink(Tier(t["url"]), open_objects(t["url"], opts, stall_timeout_s=30.0)))
        except (OSError, TrainguardError) as e:
            echo(f"tier {t['url']}: {e}", err=True)
    if not links:
        return None
    return listing(TierSet(hot, links, lambda *a, **k: None), lambda: infos)


def prefetch_cmd_impl(root: str, tier_urls: tuple[str, ...], as_json: bool) -> None:
    from ..tiers.attach import TierSet, open_links, read_record
    from ..tiers.config import Tier

    hot = Path(root)
    urls = list(tier_urls) or [t["url"] for t in read_record(hot)]
    if not urls:
        raise click.UsageError(f"{root} records no tiers: name them with --tier URL")
    hot.mkdir(parents=True, exist_ok=True)
    try:
        links = open_links(hot, [Tier(u) for u in urls], lambda *a, **k: None)
        step = TierSet(hot, links, lambda *a, **k: None).materialize()
    except (OSError, TrainguardError) as e:
        raise click.UsageError(str(e)) from None
    if as_json:
        echo(json.dumps({"ok": step is not None, "step": step, "root": str(hot)}))
    elif step is None:
        echo(f"no restorable checkpoint on {', '.join(urls)}", err=True)
    else:
        echo(f"step {step} is intact in {hot}")
    sys.exit(0 if step is not None else 1)
