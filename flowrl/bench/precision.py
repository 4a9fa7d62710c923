"""``flowrl bench precision``: exploration backends side by side (Sol-RL, arXiv 2604.06916).

For each backend, in one run on one machine state:

* **speed**: images/s of deterministic ODE sampling at a fixed batch and step count (median
  of ``repeats`` timed runs after a warm-up; the backends' runs are interleaved round by
  round so a change of machine load hits them alike), and the speed-up vs full precision;
* **memory**: bytes of the model copy, and the memory growth while sampling (CPU: resident
  memory sampled every 5 ms after returning freed heap to the OS; CUDA: peak allocation);
* **fidelity**: reward-ranking agreement with full precision at ``ref_steps`` on the same
  seeds, within each prompt's pool: Kendall tau, Spearman, top-k hit rate, at every step
  count of ``fidelity_steps`` (full precision at few steps is the "fewer steps" baseline);
* **batch sensitivity**: the same pool run again with every sample among other batch-mates
  (same chunk size): the largest reward change and the Kendall tau between the two runs
  (a batch-wide activation scale shows up here);
* **sync**: the seconds to build the copy (merge, quantize, calibrate): Sol-RL's per-update cost.

Pipelines: ``digits`` (the pretrained offline base; rewards meaningful), ``sd3-mid`` (a
random-init ``SD3Transformer2DModel`` of 36.0M parameters at 1024 tokens: the size where int8
pays off on a CPU; its rewards are meaningless, so fidelity is off by default, its speed is
real), ``sd3`` / ``flux`` (``model_path`` to a diffusers directory; on CUDA compare
``full`` (bf16), ``fp8``, ``nvfp4``).
"""
from __future__ import annotations

import hashlib
import math
import os
import platform
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from ..quant import get_quantizer, parse_backend_spec
from ..quant.common import module_bytes
from ..quant.fidelity import kendall_tau, ranking_fidelity
from ..quant.sync import swapped_transformer
from ..rollout.base import score_images
from ..rollout.ode import ode_sample
from ..schedules import flow_sigmas
from ..seeding import derive_seeds, seeded_randn
from ..trainers.reporting import save_figure, write_json

PIPELINES = ("digits", "sd3-mid", "sd3", "flux")
BENCH_SEED = 20260408
CALIBRATION_SEED = 20260409
GENERIC_PROMPTS = ["a photo of a cat on a sofa", "a red bicycle leaning on a brick wall",
                   "a bowl of fruit on a wooden table", "a lighthouse at sunset"]
DEFAULTS = {  # per pipeline: timing batch and steps, fidelity pool and step counts, reference steps
    "digits": dict(batch=96, steps=6, seeds_per_prompt=96, fidelity_steps=(6, 20), ref_steps=20, reward="digits"),
    "sd3-mid": dict(batch=2, steps=4, seeds_per_prompt=0, fidelity_steps=(4,), ref_steps=8,
                    reward="jpeg_compressibility"),
    "sd3": dict(batch=2, steps=6, seeds_per_prompt=16, fidelity_steps=(6,), ref_steps=20,
                reward="jpeg_compressibility"),
    "flux": dict(batch=2, steps=6, seeds_per_prompt=16, fidelity_steps=(6,), ref_steps=20,
                 reward="jpeg_compressibility"),
}


# ------------------------------------------------------------------ the sd3-mid policy
def sd3_mid_config() -> dict:
    """SD3Transformer2DModel, 4 layers x 512 wide (8 heads of 64), 16 x 64 x 64 latents, patch 2:
    1024 image tokens, 36.04M parameters."""
    return dict(sample_size=64, patch_size=2, in_channels=16, out_channels=16, num_layers=4, attention_head_dim=64,
                num_attention_heads=8, joint_attention_dim=512, caption_projection_dim=512,
                pooled_projection_dim=256, pos_embed_max_size=64)


class SD3MidPolicy:
    """A ``FlowPolicy`` over a random-init SD3 transformer, for timing only (rewards meaningless).

    Prompts map to fixed pseudo-random embeddings (16 tokens, seeded by the prompt's hash);
    ``decode`` is a sigmoid of the first three latent channels, ``[B, 3, 64, 64]``.
    """

    def __init__(self, seed: int = 0, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 shift: float = 3.0):
        from diffusers import SD3Transformer2DModel

        torch.manual_seed(seed)
        self.device = torch.device(device)
        self.transformer = SD3Transformer2DModel(**sd3_mid_config()).to(self.device).eval()
        if dtype != torch.float32:
            self.transformer.to(dtype=dtype)
        self.transformer.requires_grad_(False)
        self.latent_shape = (16, 64, 64)
        self.shift = shift

    def encode_prompts(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        cfg = self.transformer.config
        ids = [int(hashlib.sha256(p.encode()).hexdigest()[:8], 16) for p in prompts]
        ehs = seeded_randn(ids, (16, cfg.joint_attention_dim), stream=0, device=self.device)  # [B, 16, 512]
        pooled = seeded_randn(ids, (cfg.pooled_projection_dim,), stream=1, device=self.device)  # [B, 256]
        return {"encoder_hidden_states": ehs, "pooled_projections": pooled}

    def velocity(self, latents: torch.Tensor, sigma: torch.Tensor, cond) -> torch.Tensor:
        dtype = self.transformer.dtype
        b = latents.shape[0]
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=self.device).reshape(-1).expand(b)  # [B]
        return self.transformer(hidden_states=latents.to(self.device, dtype), timestep=sigma * 1000.0,
                                encoder_hidden_states=cond["encoder_hidden_states"].to(dtype),
                                pooled_projections=cond["pooled_projections"].to(dtype), return_dict=False)[0].float()

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(latents[:, :3].float())  # [B, 3, 64, 64]

    def initial_noise(self, seeds: list[int]) -> torch.Tensor:
        return seeded_randn(list(seeds), self.latent_shape, stream=0, device=self.device)  # [B, 16, 64, 64]

    def sigmas(self, num_steps: int) -> torch.Tensor:
        return flow_sigmas(num_steps, self.shift)


def build_bench_policy(pipeline: str, model_path: Optional[str], device: str, dtype: torch.dtype):
    """The policy a precision benchmark runs."""
    if pipeline == "digits":
        from ..pipelines.digits import load_digits_policy

        return load_digits_policy(model_path, guidance_scale=1.0, device=device)
    if pipeline == "sd3-mid":
        return SD3MidPolicy(device=device, dtype=dtype)
    if pipeline in ("sd3", "flux"):
        if not model_path:
            raise ValueError(f"--pipeline {pipeline} needs --model-path (a diffusers directory or hub id; "
                             f"`flowrl make-tiny {pipeline} DIR` writes a tiny offline one)")
        from ..pipelines import build_policy

        return build_policy(pipeline, model_path, device=device, dtype=dtype)
    raise ValueError(f"unknown pipeline {pipeline!r}; valid: {', '.join(PIPELINES)}")


def _build_reward(pipeline: str, name: str, device: str):
    from ..rewards import build

    return build(name, device=device) if name == "digits" else build(name)


# ------------------------------------------------------------------ measurement helpers
def _rss_bytes() -> Optional[int]:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        try:
            import psutil

            return int(psutil.Process().memory_info().rss)
        except Exception:  # noqa: BLE001 - memory is reported as unknown then
            return None


def _malloc_trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the peak then includes cached heap
        pass


class PeakMemory:
    """Peak memory inside the block: CUDA peak allocation, else resident memory sampled every 5 ms
    (``base``: at entry, after returning freed heap to the OS; ``peak``: the maximum seen)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.base = self.peak = None
        self._stop = threading.Event()

    def __enter__(self) -> "PeakMemory":
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            _malloc_trim()  # hand freed heap back to the OS, so the peak shows this block's own growth
            self.base = self.peak = _rss_bytes()
            if self.base is not None:
                self._thread = threading.Thread(target=self._poll, daemon=True)
                self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(0.005):
            r = _rss_bytes()
            if r is not None and r > self.peak:
                self.peak = r

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        elif self.base is not None:
            self._stop.set()
            self._thread.join()
            r = _rss_bytes()
            self.peak = max(self.peak, r or 0)


def _sample(policy, module, prompts: list[str], seeds: list[int], steps: int, max_batch: Optional[int]):
    with torch.no_grad(), swapped_transformer(policy, module):
        return ode_sample(policy, prompts, seeds, steps, max_batch)


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _pool_rewards(policy, module, reward, prompts, seeds, steps, chunk, order: Optional[torch.Tensor] = None):
    """Rewards [N] of the pool (prompts[i], seeds[i]) at ``steps``; ``order`` permutes which
    samples share a chunk (results are returned in pool order)."""
    idx = torch.arange(len(seeds)) if order is None else order
    p = [prompts[i] for i in idx.tolist()]
    s = [seeds[i] for i in idx.tolist()]
    _, images = _sample(policy, module, p, s, steps, chunk)
    r, _ = score_images(reward, images, p)
    out = torch.empty_like(r)
    out[idx] = r
    return out


# ------------------------------------------------------------------ the benchmark
def bench_precision(pipeline: str = "digits", backends: Optional[Sequence[str]] = None,
                    json_path: Optional[str | os.PathLike] = None, *, png_path: Optional[str | os.PathLike] = None,
                    model_path: Optional[str] = None, batch: Optional[int] = None, steps: Optional[int] = None,
                    repeats: int = 3, seeds_per_prompt: Optional[int] = None, prompts: Optional[list[str]] = None,
                    fidelity_steps: Optional[Sequence[int]] = None, ref_steps: Optional[int] = None, topk: int = 12,
                    reward: Optional[str] = None, device: Optional[str] = None, dtype: Optional[str] = None,
                    threads: Optional[int] = None, batch_check: bool = True, calibration_seeds: int = 2,
                    policy=None, verbose: bool = True) -> dict:
    """Run the precision benchmark (module doc) and return the result dict (also written to
    ``json_path``, with a PNG chart at ``png_path``, default beside the JSON).

    ``backends``: specs ``name`` or ``name:key=value`` from ``flowrl.quant`` plus ``"full"``
    (the unquantized policy, always measured as the reference); default ``full,
    int8-dynamic, nvfp4-emulated`` on a CPU and ``full, fp8, nvfp4`` on CUDA. A backend that
    cannot run here fails before any model loads, naming those that can. ``policy``: an
    already built ``FlowPolicy`` to measure instead of loading ``pipeline`` / ``model_path``.
    """
    if pipeline not in PIPELINES:
        raise ValueError(f"unknown pipeline {pipeline!r}; valid: {', '.join(PIPELINES)}")
    dflt = DEFAULTS[pipeline]
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dtype is None:
        dtype = "bfloat16" if dev.type == "cuda" else "float32"
    torch_dtype = getattr(torch, dtype)
    specs = list(backends) if backends else (["full", "fp8", "nvfp4"] if dev.type == "cuda"
                                             else ["full", "int8-dynamic", "nvfp4-emulated"])
    if "full" not in specs:
        specs.insert(0, "full")
    quantizers: dict[str, Any] = {}
    for spec in specs:
        if spec != "full":
            name, opts = parse_backend_spec(spec)
            quantizers[spec] = get_quantizer(name, **opts)  # unavailable: a clear error before any model loads
    batch = int(batch or dflt["batch"])
    steps = int(steps or dflt["steps"])
    spp = int(dflt["seeds_per_prompt"] if seeds_per_prompt is None else seeds_per_prompt)
    fsteps = [int(s) for s in (fidelity_steps or dflt["fidelity_steps"])]
    ref_steps = int(ref_steps or dflt["ref_steps"])
    if repeats < 1 or batch < 1 or steps < 1:
        raise ValueError(f"repeats, batch and steps must be >= 1, got {repeats}, {batch}, {steps}")
    if threads:
        torch.set_num_threads(int(threads))
    log = print if verbose else (lambda *a, **k: None)

    if policy is None:
        policy = build_bench_policy(pipeline, model_path, str(dev), torch_dtype)
    reward_name = reward or dflt["reward"]
    reward_fn = _build_reward(pipeline, reward_name, str(dev))
    if prompts is None:
        if pipeline == "digits":
            from ..pipelines.digits import digit_prompt

            prompts = [digit_prompt(d) for d in range(10)]
        else:
            prompts = list(GENERIC_PROMPTS)
    pool_prompts = [p for p in prompts for _ in range(spp)]
    pool_seeds = derive_seeds(BENCH_SEED, len(pool_prompts))
    groups = torch.arange(len(prompts)).repeat_interleave(spp)
    time_prompts = [prompts[i % len(prompts)] for i in range(batch)]
    time_seeds = derive_seeds(BENCH_SEED + 1, batch)
    cal_prompts = [p for p in prompts for _ in range(calibration_seeds)]
    cal_seeds = derive_seeds(CALIBRATION_SEED, len(cal_prompts))
    cal_steps = min(fsteps + [steps])

    def calibrate(module: torch.nn.Module) -> None:
        _sample(policy, module, cal_prompts, cal_seeds, cal_steps, batch)

    # 1. the copies (Sol-RL's sync cost)
    modules: dict[str, torch.nn.Module] = {"full": policy.transformer}
    results: dict[str, dict] = {"full": {"backend": "full", "sync_seconds": 0.0}}
    for spec, q in quantizers.items():
        log(f"[bench precision] building {spec} copy ...", flush=True)
        t0 = time.perf_counter()
        modules[spec] = q.quantize(policy.transformer, calibrate if q.needs_calibration else None)
        results[spec] = {"backend": spec, "sync_seconds": time.perf_counter() - t0}
    for spec, m in modules.items():
        results[spec]["model_mb"] = module_bytes(m) / 2**20

    # 2. speed, interleaved rounds (first round is the warm-up)
    times: dict[str, list[float]] = {s: [] for s in specs}
    peaks: dict[str, list[Optional[int]]] = {s: [] for s in specs}
    for rnd in range(repeats + 1):
        for spec in specs:
            with PeakMemory(dev) as mem:
                _sync_device(dev)
                t0 = time.perf_counter()
                _sample(policy, modules[spec], time_prompts, time_seeds, steps, batch)
                _sync_device(dev)
                dt = time.perf_counter() - t0
            if rnd > 0:
                times[spec].append(dt)
                peaks[spec].append(None if mem.peak is None else mem.peak - (mem.base or 0))
                if rnd == 1:
                    results[spec]["peak_mb"] = None if mem.peak is None else mem.peak / 2**20
        log(f"[bench precision] timing round {rnd}/{repeats}" + (" (warm-up)" if rnd == 0 else "") + ": " +
            ", ".join(f"{s} {times[s][-1]:.2f}s" for s in specs if times[s]), flush=True)
    full_med, full_best = statistics.median(times["full"]), min(times["full"])
    for spec in specs:
        med, best = statistics.median(times[spec]), min(times[spec])
        r = results[spec]
        r.update({"seconds_per_batch": med, "seconds_all": times[spec], "images_per_second": batch / med,
                  "speedup_vs_full": full_med / med,  # ratio of medians
                  "speedup_vs_full_best": full_best / best})  # ratio of best runs (least disturbed by load)
        extra = [p for p in peaks[spec] if p is not None]
        r["peak_extra_mb"] = max(extra) / 2**20 if extra else None

    # 3. fidelity against full precision at ref_steps, 4. batch sensitivity
    fidelity_note = None
    if spp >= 2:
        log(f"[bench precision] reference: full precision, {ref_steps} steps, {len(pool_seeds)} samples", flush=True)
        ref = _pool_rewards(policy, modules["full"], reward_fn, pool_prompts, pool_seeds, ref_steps, batch)
        for spec in specs:
            res = results[spec]
            res["fidelity"] = {}
            for fs in fsteps:
                r = ref if (spec == "full" and fs == ref_steps) else \
                    _pool_rewards(policy, modules[spec], reward_fn, pool_prompts, pool_seeds, fs, batch)
                fid = ranking_fidelity(ref, r, groups, k=topk)
                fid["reward_mean"] = float(r[torch.isfinite(r)].mean())
                res["fidelity"][str(fs)] = fid
                if batch_check and fs == fsteps[0]:
                    res["batch_check"] = _batch_check(policy, modules[spec], reward_fn, pool_prompts, pool_seeds, fs,
                                                      batch, r, groups)
                log(f"[bench precision] {spec} @ {fs} steps: tau {fid['kendall_tau']:.3f} "
                    f"spearman {fid['spearman']:.3f} top-{topk} {fid['topk_hit_rate']:.3f}", flush=True)
        results["full"]["reference_reward_mean"] = float(ref[torch.isfinite(ref)].mean())
    else:
        fidelity_note = ("fidelity not measured (seeds_per_prompt < 2)" if pipeline != "sd3-mid" else
                         "fidelity off: sd3-mid is random-init, its rewards are meaningless (speed only)")

    out = {
        "pipeline": pipeline, "model_path": model_path, "device": str(dev), "dtype": dtype,
        "settings": {"batch": batch, "steps": steps, "repeats": repeats, "prompts": len(prompts),
                     "seeds_per_prompt": spp, "fidelity_steps": fsteps, "ref_steps": ref_steps, "topk": topk,
                     "reward": reward_name, "calibration_prompts": len(prompts),
                     "calibration_seeds_per_prompt": calibration_seeds, "guidance_scale": 1.0 if pipeline == "digits"
                     else getattr(policy, "guidance_scale", None)},
        "machine": _machine(),
        "backends": results,
        "fidelity_note": fidelity_note,
    }
    if pipeline == "sd3-mid":
        out["model_parameters"] = sum(p.numel() for p in policy.transformer.parameters())
    if json_path:
        jp = Path(json_path)
        write_json(out, jp)
        png_path = png_path or jp.with_suffix(".png")
    if png_path:
        plot_precision(out, Path(png_path))
        out["png"] = str(png_path)
    log(format_table(out))
    return out


def _batch_check(policy, module, reward_fn, prompts, seeds, steps, chunk, rewards, groups) -> dict:
    """Run the pool again with every sample among other batch-mates; compare rewards."""
    n = len(seeds)
    if n > chunk:
        order = torch.roll(torch.arange(n), max(1, chunk // 2))  # chunk boundaries move: new mates
        size = chunk
    else:
        order = torch.arange(n).flip(0)
        size = max(1, chunk // 2)
    r2 = _pool_rewards(policy, module, reward_fn, prompts, seeds, steps, size, order)
    finite = torch.isfinite(rewards) & torch.isfinite(r2)
    return {"max_abs_reward_change": float((rewards - r2)[finite].abs().max()) if finite.any() else float("nan"),
            "kendall_tau_grouped": ranking_fidelity(rewards, r2, groups)["kendall_tau"],
            "kendall_tau_pool": kendall_tau(rewards[finite], r2[finite]), "chunk": size}


def _machine() -> dict:
    info = {"torch": torch.__version__, "threads": torch.get_num_threads(), "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine()}
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        info["load_average"] = list(os.getloadavg())
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        from importlib.metadata import version

        info["nvidia_modelopt"] = version("nvidia-modelopt")
    except Exception:  # noqa: BLE001 - not installed
        info["nvidia_modelopt"] = None
    return info


# ------------------------------------------------------------------ reporting
def _f(x, fmt=".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def format_table(res: dict) -> str:
    st = res["settings"]
    lines = [f"precision benchmark: {res['pipeline']} on {res['device']} ({res['dtype']}), batch {st['batch']}, "
             f"{st['steps']} ODE steps, {st['repeats']} interleaved runs (speed-up: ratio of medians; best-of: "
             f"of fastest runs), {res['machine']['threads']} threads; +peak MB: memory growth while sampling",
             f"{'backend':<34} {'img/s':>8} {'speed-up':>8} {'best-of':>8} {'sync s':>7} {'model MB':>9} "
             f"{'+peak MB':>8}"]
    for spec, r in res["backends"].items():
        lines.append(f"{spec:<34} {_f(r['images_per_second'], '.2f'):>8} {_f(r['speedup_vs_full'], '.3f'):>8} "
                     f"{_f(r.get('speedup_vs_full_best'), '.3f'):>8} {_f(r['sync_seconds'], '.2f'):>7} "
                     f"{_f(r['model_mb'], '.1f'):>9} {_f(r.get('peak_extra_mb'), '.0f'):>8}")
    if any("fidelity" in r for r in res["backends"].values()):
        lines.append(f"reward-ranking fidelity vs full precision at {st['ref_steps']} steps, {st['prompts']} prompts x "
                     f"{st['seeds_per_prompt']} seeds (per prompt, averaged), top-{st['topk']}; batch check: same "
                     f"pool among other batch-mates")
        lines.append(f"{'backend':<34} {'steps':>5} {'tau':>6} {'rho':>6} {'top-k':>6} {'reward':>7} "
                     f"{'batch dmax':>10} {'batch tau':>9}")
        for spec, r in res["backends"].items():
            bc = r.get("batch_check", {})
            for i, (fs, fid) in enumerate(r.get("fidelity", {}).items()):
                tail = f" {_f(bc.get('max_abs_reward_change'), '.2e'):>10} {_f(bc.get('kendall_tau_grouped')):>9}" \
                    if i == 0 and bc else ""
                lines.append(f"{spec:<34} {fs:>5} {_f(fid['kendall_tau']):>6} {_f(fid['spearman']):>6} "
                             f"{_f(fid['topk_hit_rate']):>6} {_f(fid['reward_mean']):>7}{tail}")
    if res.get("fidelity_note"):
        lines.append(res["fidelity_note"])
    return "\n".join(lines)


def plot_precision(res: dict, path: Path) -> None:
    """Bar charts: speed-up vs full precision, and Kendall tau / top-k hit rate per step count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    specs = list(res["backends"])
    label = lambda s: s.replace(":", "\n")  # noqa: E731 - options on their own line
    has_fid = any("fidelity" in r for r in res["backends"].values())
    n_bars = sum(len(r.get("fidelity", {})) for r in res["backends"].values())
    width = 5 + 0.9 * len(specs) + (2 + 1.0 * n_bars if has_fid else 0)
    fig, axes = plt.subplots(1, 2 if has_fid else 1, figsize=(width, 4.2), squeeze=False,
                             gridspec_kw={"width_ratios": [len(specs) + 1, n_bars + 1] if has_fid else [1]})
    ax = axes[0][0]
    sp = [res["backends"][s]["speedup_vs_full"] for s in specs]
    ax.bar(range(len(specs)), sp, color=["0.5"] + ["C0"] * (len(specs) - 1))
    ax.axhline(1.0, color="k", lw=0.8)
    for i, v in enumerate(sp):
        ax.text(i, v, f"{v:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(specs)), [label(s) for s in specs], fontsize=7)
    st = res["settings"]
    ax.set_title(f"{res['pipeline']}: speed-up vs full (batch {st['batch']}, {st['steps']} steps)", fontsize=9)
    if has_fid:
        ax = axes[0][1]
        bars = [(s, fs, f) for s in specs for fs, f in res["backends"][s].get("fidelity", {}).items()]
        xs = range(len(bars))
        ax.bar([x - 0.2 for x in xs], [b[2]["kendall_tau"] for b in bars], width=0.4, label="Kendall tau")
        ax.bar([x + 0.2 for x in xs], [b[2]["topk_hit_rate"] for b in bars], width=0.4,
               label=f"top-{st['topk']} hit rate")
        ax.set_xticks(list(xs), [f"{label(s)}\n{fs} steps" for s, fs, _ in bars], fontsize=7)
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8, loc="lower right")
        ax.set_title(f"ranking fidelity vs full precision at {st['ref_steps']} steps", fontsize=9)
    save_figure(fig, path)


# ------------------------------------------------------------------ command line
def _ints(text: Optional[str]) -> Optional[list[int]]:
    return None if text is None else [int(t) for t in text.split(",") if t.strip()]


def _run(a) -> int:
    backends = [b.strip() for b in a.backends.split(",") if b.strip()] if a.backends else None
    bench_precision(a.pipeline, backends, a.json, png_path=a.png, model_path=a.model_path, batch=a.batch,
                    steps=a.steps, repeats=a.repeats, seeds_per_prompt=a.seeds_per_prompt,
                    fidelity_steps=_ints(a.fidelity_steps), ref_steps=a.ref_steps, topk=a.topk, reward=a.reward,
                    device=a.device, dtype=a.dtype, threads=a.threads, batch_check=not a.no_batch_check)
    return 0


def add_precision_parser(subparsers) -> None:
    """Add ``precision`` to ``flowrl bench``'s subparsers."""
    p = subparsers.add_parser("precision", help="exploration backends side by side: images/s, speed-up, memory, "
                                                "reward-ranking fidelity (Sol-RL)")
    p.add_argument("--pipeline", choices=PIPELINES, default="digits")
    p.add_argument("--backends", default=None,
                   help="comma-separated: full and flowrl.quant backends, options as name:key=value "
                        "(default: full,int8-dynamic,nvfp4-emulated on CPU; full,fp8,nvfp4 on CUDA)")
    p.add_argument("--json", default=None, help="write the result here (a PNG chart goes beside it)")
    p.add_argument("--png", default=None, help="chart path (default: the JSON path with .png)")
    p.add_argument("--model-path", default=None, help="digits base / diffusers directory (default: the digits cache)")
    p.add_argument("--batch", type=int, default=None, help="timing batch (default: 96 digits, 2 sd3-mid/sd3/flux)")
    p.add_argument("--steps", type=int, default=None, help="timing ODE steps (default: 6 digits, 4 sd3-mid)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per backend after one warm-up")
    p.add_argument("--seeds-per-prompt", type=int, default=None, help="fidelity pool per prompt (0 = no fidelity)")
    p.add_argument("--fidelity-steps", default=None, help="comma-separated step counts (default 6,20 on digits)")
    p.add_argument("--ref-steps", type=int, default=None, help="full-precision reference steps (default 20)")
    p.add_argument("--topk", type=int, default=12)
    p.add_argument("--reward", default=None, help="reward name (default: digits, else jpeg_compressibility)")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--no-batch-check", action="store_true", help="skip the batch-mates sensitivity pass")
    p.set_defaults(fn=_run)
