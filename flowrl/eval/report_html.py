"""``report.html``: the evaluation as one self-contained page that opens offline in any browser.

Everything is inline: the styles, a small script (click a per-prompt column header to sort), and the
images as ``data:`` PNGs; a Content-Security-Policy forbids the page any other source, so it cannot
reach the network. Sections: the hacking verdicts, the means with 95% intervals, the paired deltas and
win rates against the baseline, the gains of each trained run against the held-out rewards and the
diversity, per tag, the same-seed image grid per tag (a row per model), the worst and best prompts,
and every prompt. When the script has run without an error it sets ``data-report-ok="1"`` on the
``<html>`` element (the headless-browser test reads it).
"""
from __future__ import annotations

import base64
import html
from pathlib import Path
from typing import Callable, Optional

from .hacking import gains_table
from .report_text import fmt_interval, headline
from .results import unscored_tags

GRID_PROMPTS = 10  # prompts per tag in the image grid
EXTREMES = 5  # worst and best prompts shown

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:24px auto;max-width:1200px;color:#222;padding:0 16px}
h1{font-size:22px}h2{font-size:18px;margin-top:32px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:8px 0}td,th{border:1px solid #ddd;padding:4px 8px;text-align:right}
td:first-child,th:first-child{text-align:left}th{background:#f4f4f4;cursor:default}
table.sortable th{cursor:pointer}.meta{color:#555}.warning{background:#fff1e6;border-left:4px solid #e8590c;
padding:8px 12px}.ok{background:#ebfbee;border-left:4px solid #2f9e44;padding:8px 12px}.info{background:#f1f3f5;
border-left:4px solid #868e96;padding:8px 12px}figure{display:inline-block;margin:4px;text-align:center;width:132px;
vertical-align:top}figure img{width:128px;height:128px;object-fit:contain;image-rendering:pixelated;background:#eee}
figcaption{font-size:11px;color:#444;overflow-wrap:anywhere}td.img{text-align:center}.up{color:#2b8a3e}
.down{color:#c92a2a}.grid .row{display:flex;align-items:flex-start;border-top:1px solid #eee;padding:4px 0}
.grid .label{width:120px;flex:none;font-weight:600;padding-top:8px;overflow-wrap:anywhere}.grid .cells{display:flex;
flex-wrap:wrap}
"""
SCRIPT = """
(function () {
  document.querySelectorAll("table.sortable").forEach(function (t) {
    t.querySelectorAll("th").forEach(function (th, col) {
      th.addEventListener("click", function () {
        var rows = Array.prototype.slice.call(t.tBodies[0].rows);
        var asc = th.dataset.asc !== "1";
        th.dataset.asc = asc ? "1" : "0";
        rows.sort(function (a, b) {
          var x = a.cells[col].dataset.v || a.cells[col].textContent;
          var y = b.cells[col].dataset.v || b.cells[col].textContent;
          var nx = parseFloat(x), ny = parseFloat(y);
          var c = (isNaN(nx) || isNaN(ny)) ? x.localeCompare(y) : nx - ny;
          return asc ? c : -c;
        });
        rows.forEach(function (r) { t.tBodies[0].appendChild(r); });
      });
    });
  });
  document.documentElement.dataset.reportOk = "1";
})();
"""
CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'"

e = html.escape


def _table(header: list[str], rows: list[list[str]], cls: str = "") -> str:
    """A table of already-escaped cells (a cell may be ``(html, sort value)``)."""
    def cell(c, tag="td"):
        if isinstance(c, tuple):
            return f'<{tag} data-v="{e(str(c[1]))}">{c[0]}</{tag}>'
        return f"<{tag}>{c}</{tag}>"
    head = "".join(f"<th>{h}</th>" for h in header)
    body = "".join("<tr>" + "".join(cell(c) for c in r) + "</tr>" for r in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _signed(d: dict) -> str:
    text = e(fmt_interval(d, signed=True))
    if d and d.get("lo") is not None and (d["lo"] > 0 or d["hi"] < 0):
        return f'<span class="{"up" if d["lo"] > 0 else "down"}">{text}</span>'
    return text


def _img(path: Optional[Path], caption: str) -> str:
    if path is None or not Path(path).is_file():
        return f"<figure><figcaption>{e(caption)} (no image)</figcaption></figure>"
    data = base64.b64encode(Path(path).read_bytes()).decode()
    return f'<figure><img alt="{e(caption)}" src="data:image/png;base64,{data}"><figcaption>{e(caption)}</figcaption></figure>'


def _summary(r: dict) -> str:
    rewards, tagged = list(r["rewards"]), len(r["suite"]["tags"]) > 1
    rows = []
    for m in r["models"]:
        s = r["summary"][m["label"]]
        cells = [e(headline(s["rewards"][k])) for k in rewards]
        rows.append([e(m["label"]), *cells, e(fmt_interval(s["watch"]["diversity"])),
                     e(fmt_interval(s["watch"]["hf_energy"]))])
    note = " GenEval's overall score is this mean over tags." if tagged else ""
    unscored = "".join(f"<p class=warning>{e(line)}</p>" for line in unscored_tags(r))
    return (f"<h2>Means</h2><p class=meta>Mean over prompts (of each prompt's mean over its seeds) with its 95% "
            f"bootstrap interval over prompts{'; tagged suites: the mean over tags' if tagged else ''}.{note}</p>"
            + _table(["model", *map(e, rewards), "diversity", "hf energy"], rows) + unscored)


def _paired(r: dict) -> str:
    if not r["paired"]:
        return ""
    rewards = list(r["rewards"])
    rows = [[e(label), *(f"{_signed(p['rewards'][k]['delta'])}<br>win {e(fmt_interval(p['rewards'][k]['win_rate'], pct=True))}"
                         for k in rewards), _signed(p["watch"]["diversity"]["delta"])]
            for label, p in r["paired"].items()]
    return (f"<h2>Against {e(r['baseline'])}</h2><p class=meta>Paired on the same prompts and seeds: the mean "
            f"difference and the share of samples that score higher (ties count half), 95% intervals over "
            f"prompts; green or red when the interval excludes zero.</p>"
            + _table(["model", *map(e, rewards), "diversity"], rows))


def _hacking(r: dict) -> str:
    parts = [f'<p class="{v["level"]}">{e(v["message"])}</p>' for v in r["hacking"]]
    for m in r["models"][1:]:
        if not m.get("trained") or not any(t in r["rewards"] for t in m["trained"]):
            continue
        rows = [[e(g["name"]), e(g["role"]), e("-" if g["baseline"] is None else f"{g['baseline']:.4g}"),
                 e("-" if g["model"] is None else f"{g['model']:.4g}"), _signed(g["delta"])]
                for g in gains_table(r, m["label"])]
        parts.append(f"<h3>{e(m['label'])}: its gain against what it did not train on</h3>"
                     + _table(["measure", "role", e(r["baseline"]), e(m["label"]), "delta [95%]"], rows))
    return "<h2>Reward hacking</h2>" + "".join(parts) if parts else ""


def _tags(r: dict) -> str:
    if len(r["suite"]["tags"]) < 2:
        return ""
    labels = [m["label"] for m in r["models"]]
    out = ["<h2>Per tag</h2>"]
    for k in r["rewards"]:
        rows = [[e(t), *(e(fmt_interval(r["summary"][m]["rewards"][k]["tags"].get(t, {}))) for m in labels)]
                for t in r["suite"]["tags"]]
        out.append(f"<h3>{e(k)}</h3>" + _table(["tag", *map(e, labels)], rows))
    return "".join(out)


def _caption(p: dict, label: str, key: str, prefix: str) -> str:
    v = p["models"][label][key]
    return f"{prefix}{key} {'-' if v is None else format(v, '.3f')}"


def _grid(r: dict, thumb: Callable) -> str:
    out = ["<h2>Images: the same seed for every model</h2><p class=meta>The first seed of each prompt (at most "
           f"{GRID_PROMPTS} per tag); a row per model, the prompts in the same order.</p>"]
    key = next(iter(r["rewards"]))
    for t in r["suite"]["tags"]:
        prompts = [p for p in r["per_prompt"] if p["tag"] == t][:GRID_PROMPTS]
        rows = "".join(f'<div class="row"><div class="label">{e(m["label"])}</div><div class="cells">'
                       + "".join(_img(thumb(m["label"], p["index"]), _caption(p, m["label"], key, p["prompt"] + ": "))
                                 for p in prompts) + "</div></div>" for m in r["models"])
        out.append(f'<h3>{e(t)}</h3><div class="grid">{rows}</div>')
    return "".join(out)


def _extremes(r: dict, thumb: Callable) -> str:
    key, last = next(iter(r["rewards"])), r["models"][-1]["label"]
    scored = [p for p in r["per_prompt"] if p["models"][last][key] is not None]
    scored.sort(key=lambda p: p["models"][last][key])
    out = [f"<h2>Worst and best prompts</h2><p class=meta>By {e(last)}'s {e(key)} (mean over seeds); the first seed "
           f"of every model.</p>"]
    for title, chosen in (("worst", scored[:EXTREMES]), ("best", scored[::-1][:EXTREMES])):
        rows = [[e(p["prompt"]), e(p["tag"]), *(_img(thumb(m["label"], p["index"]), _caption(p, m["label"], key, ""))
                                                for m in r["models"])] for p in chosen]
        out.append(f"<h3>{title}</h3>" + _table(["prompt", "tag", *(e(m["label"]) for m in r["models"])], rows))
    return "".join(out)


def _prompts(r: dict) -> str:
    labels, rewards = [m["label"] for m in r["models"]], list(r["rewards"])
    rows = []
    for p in r["per_prompt"]:
        vals = [p["models"][m][k] for k in rewards for m in labels]
        rows.append([(e(p["prompt"]), p["prompt"]), e(p["tag"]),
                     *(("-", "") if v is None else (f"{v:.3f}", v) for v in vals)])
    head = ["prompt", "tag", *(f"{e(m)}<br>{e(k)}" for k in rewards for m in labels)]
    return (f"<h2>Every prompt</h2><details><summary>{len(rows)} prompts (click a header to sort)</summary>"
            + _table(head, rows, "sortable") + "</details>")


def render(r: dict, thumb: Callable[[str, int], Optional[Path]]) -> str:
    """The page of the result dict ``r`` (``eval.json``); ``thumb(label, prompt index)`` is the path of
    that model's first-seed image of the prompt (or None)."""
    s = r["suite"]
    models = ", ".join(f"{m['label']} ({m['kind']}: {m['path']}{', ' + m['weights'] if m.get('weights') else ''})"
                       for m in r["models"])
    head = (f"<h1>flowrl eval: {e(s['name'])}</h1><p class=meta>{s['prompts']} prompts ({e(s['source'])}) x "
            f"{r['per_prompt_seeds']} seeds, the same for every model; rewards {e(', '.join(r['rewards']))}; "
            f"models {e(models)}; baseline {e(r['baseline'])}; {r['bootstrap']['resamples']} bootstrap "
            f"resamples over prompts.</p>")
    body = "".join([head, _hacking(r), _summary(r), _paired(r), _tags(r), _grid(r, thumb), _extremes(r, thumb),
                    _prompts(r)])
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8"><meta http-equiv="Content-Security-Policy" '
            f'content="{CSP}"><title>flowrl eval: {e(s["name"])}</title><style>{STYLE}</style></head>'
            f"<body>{body}<script>{SCRIPT}</script></body></html>")
