"""The self-contained HTML report of ``trainguard report``: one file, plots embedded as PNG data URIs, no
network access needed to view it.

The page carries a small inline script that, once loaded, checks each plot decoded and drew ink (it reads
the pixels back through a canvas) and records the result on the ``<figure>`` element (``data-rendered``:
``"WxH"``, ``data-ink``: the fraction of non-white pixels) and on ``<body>`` (``data-plots-ok``), so a
headless browser can confirm the rendered page, not only the file. The figures themselves are embedded as
JSON in ``<script type="application/json" id="trainguard-figures">``.
"""

from __future__ import annotations

import base64
import html
import json
import os
import secrets
from pathlib import Path
from typing import Any

from .._time import iso
from ..planning.units import format_duration
from ..recovery.ttr import PHASES
from .plots import PHASE_LABELS, PLOTS

_CSS = """
body { font-family: system-ui, -apple-system, Segoe UI, Helvetica, Arial, sans-serif; margin: 24px auto;
       max-width: 1000px; color: #222; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
.meta { color: #666; font-size: 0.9em; }
table { border-collapse: collapse; font-size: 0.88em; margin: 0.5em 0; }
th, td { border-bottom: 1px solid #ddd; padding: 4px 8px; text-align: right; }
th { background: #f4f4f4; } td.l, th.l { text-align: left; }
figure { margin: 1em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #555; font-size: 0.9em; }
.kpi { display: inline-block; margin-right: 2em; } .kpi b { font-size: 1.3em; display: block; }
"""

_CHECK_JS = """
window.addEventListener('load', function () {
  var figs = document.querySelectorAll('figure.plot'), ok = figs.length > 0;
  figs.forEach(function (f) {
    var img = f.querySelector('img');
    if (!img || !img.complete || !img.naturalWidth) { f.dataset.rendered = '0x0'; ok = false; return; }
    f.dataset.rendered = img.naturalWidth + 'x' + img.naturalHeight;
    try {
      var c = document.createElement('canvas'); c.width = img.naturalWidth; c.height = img.naturalHeight;
      var g = c.getContext('2d'); g.drawImage(img, 0, 0);
      var d = g.getImageData(0, 0, c.width, c.height).data, ink = 0;
      for (var i = 0; i < d.length; i += 4) { if (d[i] < 245 || d[i + 1] < 245 || d[i + 2] < 245) ink++; }
      f.dataset.ink = (ink / (d.length / 4)).toFixed(4);
      if (ink === 0) ok = false;
    } catch (e) { f.dataset.ink = 'error: ' + e; ok = false; }
  });
  document.body.dataset.plotsOk = ok ? 'yes' : 'no';
});
"""


def _e(value: Any) -> str:
    return html.escape(str(value))


def _f(value: Any, fmt: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, fmt)


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    return str(n)


def _steps(steps: list[int], most: int = 12) -> str:
    """A list of steps for the page: all of them, or the count with the first and last few."""
    if not steps:
        return "-"
    if len(steps) <= most:
        return _e(", ".join(map(str, steps)))
    return _e(f"{len(steps)} ({', '.join(map(str, steps[:3]))}, ..., {', '.join(map(str, steps[-3:]))})")


def _stall(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return f"{1000 * seconds:.1f} ms" if seconds < 10 else format_duration(seconds, digits=3)


def _failure_table(figs: dict[str, Any]) -> str:
    head = [
        "#",
        "kind",
        "cause",
        "injected",
        "injected at",
        "after step",
        "resumed from",
        "steps lost",
        "TTR s",
    ]
    head += [PHASE_LABELS[p] for p in PHASES]
    rows = []
    for i, f in enumerate(figs["failures"]):
        cause = f["cause"] or "-"
        if f.get("signal"):
            cause += f" ({f['signal']})"
        elif f.get("exit_code") not in (None, 0):
            cause += f" (exit {f['exit_code']})"
        cells = [
            str(i + 1),
            f'<td class="l kind">{_e(f["kind"])}</td>',
            f'<td class="l">{_e(cause)}</td>',
            f'<td class="injected">{"yes" if f.get("injected") else "no"}</td>',
            _e(f["injected_step"] if f.get("injected_step") is not None else "-"),
            _e(f["step"] if f["step"] is not None else "-"),
            _e(f["restored_step"] if f["restored_step"] is not None else "-"),
            f'<td class="steps-lost">{_e(f["steps_lost"] if f["steps_lost"] is not None else "-")}</td>',
            _f(f["ttr_s"]),
        ]
        cells += [_f(f["phases"].get(p)) for p in PHASES]
        rows.append("<tr>" + "".join(c if c.startswith("<td") else f"<td>{c}</td>" for c in cells) + "</tr>")
    if not rows:
        return "<p>No failure recorded.</p>"
    ths = "".join(f'<th class="{"l" if h in ("kind", "cause") else ""}">{_e(h)}</th>' for h in head)
    table = f'<table id="failures"><thead><tr>{ths}</tr></thead><tbody>{"".join(rows)}</tbody></table>'
    return f'<div style="overflow-x: auto">{table}</div>'


def _interval_table(iv: dict[str, Any]) -> str:
    rows = [
        ("measured interval (compute s between saves)", _f(iv.get("measured_s"), ".3g")),
        ("Daly optimum (s)", _f(iv.get("optimal_s"), ".3g")),
        ("Young optimum (s)", _f(iv.get("young_s"), ".3g")),
        ("C: blocking s per save (median)", _f(iv.get("checkpoint_s"), ".3g")),
        ("L: persist s per save (median)", _f(iv.get("persist_s"), ".3g")),
        ("MTBF s (wall time / failures)", _f(iv.get("mtbf_s"), ".3g")),
        ("expected waste at the measured interval", _f(iv.get("waste_measured"), ".1%")),
        ("expected waste at the optimum", _f(iv.get("waste_optimal"), ".1%")),
    ]
    body = "".join(f'<tr><td class="l">{_e(k)}</td><td>{v}</td></tr>' for k, v in rows)
    return f'<table id="interval">{body}</table><p>{_e(iv.get("reason", ""))}</p>'


def render_html(figs: dict[str, Any]) -> str:
    """The report page for the figures of :func:`.figures.compute_figures`.

    Args:
        figs: the figures (with ``root``).

    Returns:
        The HTML document (UTF-8 text), self-contained.
    """
    run, ck = figs["run"], figs["checkpoints"]
    good = figs["goodput"]
    kpis = [
        ("status", run["status"]),
        ("wall time", format_duration(run["wall_s"], digits=3)),
        ("last step", run["last_step"] if run["last_step"] is not None else "-"),
        ("failures", len(figs["failures"])),
        ("restarts", run["restarts"]),
        ("goodput", f"{100 * good:.1f} %" if good is not None else "-"),
        ("checkpoints", ck["count"]),
        ("mean stall", _stall(ck["mean_block_s"])),
    ]
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>trainguard report: {_e(figs.get('root', ''))}</title>",
        f"<style>{_CSS}</style></head><body>",
        f'<h1>trainguard report</h1><p class="meta">run root {_e(figs.get("root", ""))} &middot; '
        f"generated {_e(iso(figs['generated_at']))} &middot; started {_e(iso(run['t_start']) if run['t_start'] else '-')}"
        f" &middot; runs {_e(', '.join(run['run_ids']) or '-')}</p>",
        '<div id="kpis">'
        + "".join(f'<span class="kpi">{_e(k)}<b>{_e(v)}</b></span>' for k, v in kpis)
        + "</div>",
        "<h2>Failures</h2>",
        _failure_table(figs),
    ]
    for pid, title, fn in PLOTS:
        png, has_data = fn(figs)
        data = base64.b64encode(png).decode("ascii")
        parts.append(
            f'<figure class="plot" id="plot-{pid}" data-has-data="{"yes" if has_data else "no"}"><img alt="{_e(title)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{_e(title)}</figcaption></figure>"
        )
        if pid == "interval":
            parts.append(_interval_table(figs["interval"]))
    saves = (
        f"<p>{ck['count']} checkpoints committed, {_bytes(ck['bytes'])} referenced in total, "
        f"{_bytes(ck['bytes_written'])} new bytes written; retained now: {_steps(ck['retained'])}; deleted by "
        f"retention: {_steps(ck['deleted'])}; corrupt and skipped at resume: {_steps(ck['corrupt_detected'])}; "
        f"suspect (failed validation) and skipped at resume: {_steps(ck.get('suspect_detected', []))}; "
        f"failed saves: {ck['save_failures']}.</p>"
    )
    parts.insert(parts.index("<h2>Failures</h2>"), "<h2>Checkpoints</h2>" + saves)
    blob = json.dumps(figs, default=str).replace("<", "\\u003c")  # no "</script>" or "<!--" in the page
    parts.append(f'<script type="application/json" id="trainguard-figures">{blob}</script>')
    parts.append(f"<script>{_CHECK_JS}</script></body></html>")
    return "\n".join(parts)


def write_report(figs: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    """Write the HTML report atomically (a reader never sees half a file).

    Args:
        figs: the figures.
        path: the output file.

    Returns:
        The absolute path written.

    Raises:
        OSError: the file cannot be written (its directory is missing or not writable).
    """
    out = Path(path).absolute()
    text = render_html(figs)
    tmp = out.parent / f".{out.name}.{secrets.token_hex(4)}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out
