"""Tables and charts of ``flowrl bench precision`` results (the JSON's dict).

A backend whose copy does not run real low-precision kernels (``"real_kernels": false``) is shown
as ``name (simulated)`` and its speed-up carries a ``*``: a simulation is never a speed-up.
"""
from __future__ import annotations

import math
from pathlib import Path

from ..quant.kernels import display_label

SIM_NOTE = ("* simulated: quantize-dequantize around full-precision matmuls (or a CPU reference of a GPU kernel); "
            "fidelity only, its speed-up is not what the hardware format would give")


def fmt(x, spec: str = ".3f") -> str:
    """``x`` formatted, ``-`` for None / NaN."""
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def label_of(spec: str, r: dict) -> str:
    return r.get("label") or display_label(spec, r)


def speedup_cell(r: dict, key: str = "speedup_vs_full") -> str:
    """The speed-up, with ``*`` when the backend is simulated."""
    v = fmt(r.get(key), ".3f")
    return v if r.get("real_kernels", True) or v == "-" else v + "*"


def format_table(res: dict) -> str:
    st = res["settings"]
    w = max([len(label_of(s, r)) for s, r in res["backends"].items()] + [7]) + 1
    lines = [f"precision benchmark: {res['pipeline']} on {res['device']} ({res['dtype']}), batch {st['batch']}, "
             f"{st['steps']} ODE steps, {st['repeats']} interleaved runs (speed-up: ratio of medians; best-of: "
             f"of fastest runs), {res['machine']['threads']} threads; +peak MB: memory growth while sampling",
             f"{'backend':<{w}} {'img/s':>8} {'speed-up':>9} {'best-of':>9} {'sync s':>7} {'model MB':>9} "
             f"{'+peak MB':>8}"]
    for spec, r in res["backends"].items():
        lines.append(f"{label_of(spec, r):<{w}} {fmt(r['images_per_second'], '.2f'):>8} {speedup_cell(r):>9} "
                     f"{speedup_cell(r, 'speedup_vs_full_best'):>9} {fmt(r['sync_seconds'], '.2f'):>7} "
                     f"{fmt(r['model_mb'], '.1f'):>9} {fmt(r.get('peak_extra_mb'), '.0f'):>8}")
    lines += compiled_table(res, w)
    if any(not r.get("real_kernels", True) for r in res["backends"].values()):
        lines.append(SIM_NOTE)
    if any("fidelity" in r for r in res["backends"].values()):
        lines.append(f"reward-ranking fidelity vs full precision at {st['ref_steps']} steps, {st['prompts']} prompts x "
                     f"{st['seeds_per_prompt']} seeds (per prompt, averaged), top-{st['topk']}; batch check: same "
                     f"pool among other batch-mates")
        lines.append(f"{'backend':<{w}} {'steps':>5} {'tau':>6} {'rho':>6} {'top-k':>6} {'reward':>7} "
                     f"{'batch dmax':>10} {'batch tau':>9}")
        for spec, r in res["backends"].items():
            bc = r.get("batch_check", {})
            for i, (fs, fid) in enumerate(r.get("fidelity", {}).items()):
                tail = f" {fmt(bc.get('max_abs_reward_change'), '.2e'):>10} {fmt(bc.get('kendall_tau_grouped')):>9}" \
                    if i == 0 and bc else ""
                lines.append(f"{label_of(spec, r):<{w}} {fs:>5} {fmt(fid['kendall_tau']):>6} {fmt(fid['spearman']):>6} "
                             f"{fmt(fid['topk_hit_rate']):>6} {fmt(fid['reward_mean']):>7}{tail}")
    if res.get("fidelity_note"):
        lines.append(res["fidelity_note"])
    return "\n".join(lines)


def compiled_table(res: dict, w: int) -> list[str]:
    """Eager and compiled side by side (``backends.<spec>.compiled``), or nothing without ``--compile``."""
    specs = [s for s, r in res["backends"].items() if r.get("compiled")]
    if not specs:
        return []
    c = res["backends"][specs[0]]["compiled"]
    lines = [f"eager vs compiled ({c['mode']}, {c['backend']}): images/s, speed-up of the compiled run over the same "
             f"backend eager and over full eager, bare forward ms, velocity error vs full eager, recompiles in the "
             f"timed runs",
             f"{'backend':<{w}} {'img/s':>8} {'c img/s':>8} {'c x eager':>9} {'c x full':>8} {'fwd ms':>7} "
             f"{'c fwd ms':>8} {'rel err':>8} {'c rel err':>9} {'recomp':>6} {'compile s':>9}"]
    for spec in specs:
        r, cr = res["backends"][spec], res["backends"][spec]["compiled"]
        lines.append(f"{label_of(spec, r):<{w}} {fmt(r['images_per_second'], '.2f'):>8} "
                     f"{fmt(cr['images_per_second'], '.2f'):>8} {speedup_cell(cr, 'speedup_vs_eager'):>9} "
                     f"{speedup_cell(cr, 'speedup_vs_full'):>8} {fmt(r.get('forward_ms'), '.1f'):>7} "
                     f"{fmt(cr.get('forward_ms'), '.1f'):>8} {fmt(r.get('velocity_rel_error'), '.1e'):>8} "
                     f"{fmt(cr.get('velocity_rel_error'), '.1e'):>9} {cr.get('recompiles_timed', '-'):>6} "
                     f"{fmt(cr.get('compile_seconds'), '.1f'):>9}")
    return lines


def _bar_label(spec: str, r: dict) -> str:
    return label_of(spec, r).replace(":", "\n").replace(" (", "\n(")  # options / marker on their own lines


def plot_precision(res: dict, path: Path) -> None:
    """Bar charts: speed-up vs full precision (simulated backends hatched), and Kendall tau / top-k
    hit rate per step count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..utils.io import save_figure

    specs = list(res["backends"])
    rs = [res["backends"][s] for s in specs]
    has_fid = any("fidelity" in r for r in rs)
    n_bars = sum(len(r.get("fidelity", {})) for r in rs)
    width = 5 + 0.9 * len(specs) + (2 + 1.0 * n_bars if has_fid else 0)
    fig, axes = plt.subplots(1, 2 if has_fid else 1, figsize=(width, 4.2), squeeze=False,
                             gridspec_kw={"width_ratios": [len(specs) + 1, n_bars + 1] if has_fid else [1]})
    ax = axes[0][0]
    sp = [r["speedup_vs_full"] for r in rs]
    bars = ax.bar(range(len(specs)), sp, color=["0.5"] + ["C0"] * (len(specs) - 1))
    for bar, r in zip(bars, rs):
        if not r.get("real_kernels", True):
            bar.set_hatch("//")
            bar.set_color("0.8")
            bar.set_edgecolor("0.3")
    ax.axhline(1.0, color="k", lw=0.8)
    for i, (v, r) in enumerate(zip(sp, rs)):
        ax.text(i, v, f"{v:.2f}x" + ("*" if not r.get("real_kernels", True) else ""), ha="center", va="bottom",
                fontsize=8)
    ax.set_xticks(range(len(specs)), [_bar_label(s, r) for s, r in zip(specs, rs)], fontsize=7)
    st = res["settings"]
    ax.set_title(f"{res['pipeline']}: speed-up vs full (batch {st['batch']}, {st['steps']} steps; * simulated)",
                 fontsize=9)
    if has_fid:
        ax = axes[0][1]
        fb = [(s, fs, f) for s in specs for fs, f in res["backends"][s].get("fidelity", {}).items()]
        xs = range(len(fb))
        ax.bar([x - 0.2 for x in xs], [b[2]["kendall_tau"] for b in fb], width=0.4, label="Kendall tau")
        ax.bar([x + 0.2 for x in xs], [b[2]["topk_hit_rate"] for b in fb], width=0.4,
               label=f"top-{st['topk']} hit rate")
        ax.set_xticks(list(xs), [f"{_bar_label(s, res['backends'][s])}\n{fs} steps" for s, fs, _ in fb], fontsize=7)
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8, loc="lower right")
        ax.set_title(f"ranking fidelity vs full precision at {st['ref_steps']} steps", fontsize=9)
    save_figure(fig, path)
