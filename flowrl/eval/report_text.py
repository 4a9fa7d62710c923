"""The evaluation as text tables (what ``flowrl eval`` prints on stdout): means with their 95%
intervals, paired deltas and win rates against the baseline, per tag, the watch, the hacking verdicts,
and per prompt when the suite is small (:data:`PER_PROMPT_ROWS`; always in eval.json and the HTML)."""
from __future__ import annotations

from .results import unscored_tags

PER_PROMPT_ROWS = 50


def fmt_interval(d: dict, signed: bool = False, pct: bool = False) -> str:
    """``mean [lo, hi]`` (``-`` when not applicable)."""
    if not d or d.get("mean") is None:
        return "-"
    f = (lambda v: f"{100 * v:.0f}%") if pct else (lambda v: f"{v:+.3f}" if signed else f"{v:.3f}")
    return f"{f(d['mean'])} [{f(d['lo'])}, {f(d['hi'])}]"


def table(header: list[str], rows: list[list[str]]) -> str:
    """Left-aligned first column, the others padded to their widest cell."""
    cols = [header, *rows]
    widths = [max(len(str(r[i])) for r in cols) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w)  # noqa: E731
                              for i, (c, w) in enumerate(zip(r, widths)))
    return "\n".join([fmt(header), "  ".join("-" * w for w in widths), *(fmt(r) for r in rows)])


def headline(entry: dict) -> str:
    """A reward's summary cell: the mean over tags in a tagged suite (``n/a (k of n tags)`` when some tag has
    no score: flowrl.eval.results), else the mean over prompts."""
    missing = entry.get("tag_mean_unavailable")
    if missing:
        return f"n/a ({len(missing['tags_scored'])} of {len(missing['tags_scored']) + len(missing['tags_unscored'])} tags)"
    return fmt_interval(entry["tag_mean"] if "tag_mean" in entry else entry)


def summary_table(result: dict) -> str:
    rewards = list(result["rewards"])
    tagged = len(result["suite"]["tags"]) > 1
    rows = [[m["label"], *(headline(result["summary"][m["label"]]["rewards"][r]) for r in rewards),
             fmt_interval(result["summary"][m["label"]]["watch"]["diversity"])] for m in result["models"]]
    note = " (mean over tags, as GenEval's overall score)" if tagged else ""
    notes = "".join(f"\n{line}" for line in unscored_tags(result))
    return f"mean [95% interval] over prompts{note}\n" + table(["model", *rewards, "diversity"], rows) + notes


def paired_table(result: dict) -> str:
    rewards = list(result["rewards"])
    rows = []
    for label, p in result["paired"].items():
        rows.append([label, *(f"{fmt_interval(p['rewards'][r]['delta'], signed=True)} win "
                              f"{fmt_interval(p['rewards'][r]['win_rate'], pct=True)}" for r in rewards),
                     fmt_interval(p["watch"]["diversity"]["delta"], signed=True)])
    return (f"against {result['baseline']} (same prompts and seeds): delta [95%] and win rate [95%]\n"
            + table(["model", *rewards, "diversity"], rows))


def tag_tables(result: dict) -> list[str]:
    out = []
    labels = [m["label"] for m in result["models"]]
    for r in result["rewards"]:
        rows = [[t, *(fmt_interval(result["summary"][m]["rewards"][r]["tags"].get(t, {})) for m in labels)]
                for t in result["suite"]["tags"]]
        out.append(f"{r} per tag\n" + table(["tag", *labels], rows))
    return out


def prompt_table(result: dict) -> str:
    labels, rewards = [m["label"] for m in result["models"]], list(result["rewards"])
    head = ["prompt", *(f"{m}:{r}" for r in rewards for m in labels)]
    rows = []
    for row in result["per_prompt"]:
        text = row["prompt"] if len(row["prompt"]) <= 48 else row["prompt"][:45] + "..."
        rows.append([text, *("-" if row["models"][m][r] is None else f"{row['models'][m][r]:.3f}"
                             for r in rewards for m in labels)])
    return "per prompt (mean over seeds)\n" + table(head, rows)


def render(result: dict) -> str:
    s = result["suite"]
    parts = [f"flowrl eval: suite {s['name']} ({s['prompts']} prompts x {result['per_prompt_seeds']} seeds), "
             f"{len(result['models'])} model(s), baseline {result['baseline']}", summary_table(result)]
    if result["paired"]:
        parts.append(paired_table(result))
    if len(s["tags"]) > 1:
        parts += tag_tables(result)
    if s["prompts"] <= PER_PROMPT_ROWS:
        parts.append(prompt_table(result))
    else:
        parts.append(f"(per prompt: {s['prompts']} rows, in eval.json and report.html)")
    for v in result["hacking"]:
        parts.append(("WARNING: " if v["level"] == "warning" else "") + v["message"])
    if result.get("out"):
        parts.append(f"written: {result['out']}/eval.json, {result['out']}/report.html")
    return "\n\n".join(parts)
