"""Table and chart of the architecture benchmark (``flowrl bench precision --pipeline *-arch``)."""
from __future__ import annotations

from pathlib import Path

from .precision_report import SIM_NOTE, fmt, label_of


def _speed(row: dict, key: str, real: bool) -> str:
    v = fmt(row.get(key), ".3f")
    return v if real or v == "-" else v + "*"


def format_arch_table(res: dict) -> str:
    """One line per backend and resolution, then the iteration timing if present."""
    st, arch, m = res["settings"], res["arch"], res["machine"]
    where = m.get("gpu") or m.get("cpu")
    n = arch["parameters"]
    size = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"
    wl = max([len(label_of(s, r)) + 3 for s, r in res["backends"].items()] + [7]) + 1
    lines = [f"architecture benchmark: {res['pipeline']} ({arch['title']} config{', TINY' if res.get('tiny') else ''},"
             f" {size} parameters, random weights) on {res['device']} ({where}), "
             f"{res['dtype']}, batch {st['batch']}, {st['steps']} ODE steps, median of {st['repeats']}, "
             f"compile {st['compile']}; torch {m['torch']}, CUDA {m.get('cuda')}",
             f"{'backend':<{wl}} {'px':>5} {'img/s':>8} {'speed-up':>9} {'fwd ms':>8} {'fwd x':>8} {'peak GB':>8} "
             f"{'sync s':>7} {'copy GB':>8} {'rel err':>8}"]
    for spec, r in res["backends"].items():
        real = bool(r.get("real_kernels", False))
        for px, row in r["resolutions"].items():
            peak = None if row.get("peak_mb") is None else row["peak_mb"] / 1024
            lines.append(f"{label_of(spec, r):<{wl}} {px:>5} {fmt(row['images_per_second'], '.3f'):>8} "
                         f"{_speed(row, 'speedup_vs_full', real):>9} {fmt(row['forward_ms'], '.1f'):>8} "
                         f"{_speed(row, 'forward_speedup_vs_full', real):>8} {fmt(peak, '.1f'):>8} "
                         f"{fmt(r['sync_seconds'], '.2f'):>7} {fmt(r['model_mb'] / 1024, '.2f'):>8} "
                         f"{fmt(row.get('velocity_rel_error'), '.1e'):>8}")
    lines += compiled_lines(res, wl)
    if any(not r.get("real_kernels", False) for r in res["backends"].values()):
        lines.append(SIM_NOTE)
    lines.append(res.get("fidelity_note") or "")
    it = res.get("iteration_timing")
    if it:
        lines.append(format_iteration_table(it))
    return "\n".join(line for line in lines if line)


def compiled_lines(res: dict, wl: int) -> list[str]:
    """The compiled rows (``backends.<spec>.compiled``) under their eager rows' header, or none."""
    rows = [(spec, r, px, row) for spec, r in res["backends"].items() if r.get("compiled")
            for px, row in r["compiled"]["resolutions"].items()]
    if not rows:
        return []
    c = rows[0][1]["compiled"]
    lines = [f"compiled ({c['mode']}, {c['backend']}): speed-ups over the backend eager / full eager / full compiled; "
             f"recompiles in the timed runs; compile s of the warm-up",
             f"{'backend':<{wl}} {'px':>5} {'img/s':>8} {'x eager':>8} {'x full':>8} {'x full c':>8} {'fwd ms':>8} "
             f"{'peak GB':>8} {'recomp':>6} {'compile s':>9} {'rel err':>8}"]
    for spec, r, px, row in rows:
        real = bool(r.get("real_kernels", False))
        peak = None if row.get("peak_mb") is None else row["peak_mb"] / 1024
        lines.append(f"{label_of(spec, r) + ' +c':<{wl}} {px:>5} {fmt(row['images_per_second'], '.3f'):>8} "
                     f"{_speed(row, 'speedup_vs_eager', real):>8} {_speed(row, 'speedup_vs_full', real):>8} "
                     f"{_speed(row, 'speedup_vs_full_compiled', real):>8} {fmt(row['forward_ms'], '.1f'):>8} "
                     f"{fmt(peak, '.1f'):>8} {row.get('recompiles_timed', '-'):>6} "
                     f"{fmt(row.get('compile_seconds'), '.1f'):>9} "
                     f"{fmt(row.get('velocity_rel_error'), '.1e'):>8}")
    return lines


def format_iteration_table(it: dict) -> str:
    s = it["settings"]
    lines = [f"one training iteration at {s['resolution']}px, {s['prompts']} prompt(s): Sol-RL explores "
             f"{s['pool_size']} seeds x {s['preview_steps']} steps with {it['sol']['label']}, regenerates "
             f"{s['keep']} x {s['train_steps']} SDE steps in {s.get('dtype', 'full precision')}; flat GRPO samples "
             f"{s['group_size']} x {s['train_steps']} steps; both update on {s['train_timesteps']} timestep(s) per "
             f"sample, minibatch {s['minibatch']}, LoRA rank {s['lora_rank']}; rollouts compiled: "
             f"{s.get('compile', 'off')} (recompiles in the timed iteration)",
             f"{'iteration':<20} {'total s':>8} {'sync s':>7} {'explore s':>9} {'sample s':>9} {'update s':>9} "
             f"{'recomp':>6}"]
    for name in ("sol", "grpo"):
        r = it[name]
        lines.append(f"{name:<20} {fmt(r['total_seconds'], '.2f'):>8} {fmt(r.get('sync_seconds'), '.2f'):>7} "
                     f"{fmt(r.get('explore_seconds'), '.2f'):>9} {fmt(r['sample_seconds'], '.2f'):>9} "
                     f"{fmt(r['update_seconds'], '.2f'):>9} {r.get('recompiles', '-'):>6}")
    if "sol_over_grpo" in it:
        lines.append(f"Sol-RL / flat GRPO, one iteration: {it['sol_over_grpo']:.3f}")
    if it.get("note"):
        lines.append(it["note"])
    return "\n".join(lines)


def plot_arch(res: dict, path: Path) -> None:
    """Images/s per backend, one group of bars per resolution; simulated backends hatched."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..utils.io import save_figure

    specs = list(res["backends"])
    if not specs:  # --iteration-only: the two iterations' seconds
        it = res["iteration_timing"]
        fig, ax = plt.subplots(figsize=(4, 3.6))
        ax.bar(["Sol-RL", "flat GRPO"], [it["sol"]["total_seconds"], it["grpo"]["total_seconds"]], color=["C0", "0.5"])
        ax.set_ylabel("seconds per iteration")
        ax.set_title(f"{res['pipeline']}: Sol-RL / flat GRPO {it['sol_over_grpo']:.2f}", fontsize=9)
        save_figure(fig, path)
        return
    pxs = list(res["settings"]["resolutions"])
    fig, ax = plt.subplots(figsize=(3 + 1.6 * len(pxs) * max(1, len(specs)) / 2, 4.2))
    w = 0.8 / max(1, len(specs))
    for j, spec in enumerate(specs):
        r = res["backends"][spec]
        real = bool(r.get("real_kernels", False))
        ys = [r["resolutions"][str(px)]["images_per_second"] for px in pxs]
        bars = ax.bar([i + j * w for i in range(len(pxs))], ys, width=w, label=label_of(spec, r),
                      hatch=None if real else "//", edgecolor="0.3")
        for bar, px in zip(bars, pxs):
            sp = r["resolutions"][str(px)].get("speedup_vs_full")
            ax.text(bar.get_x() + w / 2, bar.get_height(), f"{sp:.2f}x" + ("" if real else "*"), ha="center",
                    va="bottom", fontsize=7)
    ax.set_xticks([i + w * (len(specs) - 1) / 2 for i in range(len(pxs))], [f"{px}px" for px in pxs])
    ax.set_ylabel("images / s")
    ax.legend(fontsize=7)
    ax.set_title(f"{res['pipeline']} ({res['machine'].get('gpu') or res['device']}); * simulated", fontsize=9)
    save_figure(fig, path)
