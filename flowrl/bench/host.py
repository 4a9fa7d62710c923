"""``flowrl bench host``: the host-side overhead of one training iteration (rollout + GRPO update).

Runs the real ``GroupSampler`` and the trainer's GRPO update once and counts, per rollout step and
per training minibatch: host reads of tensor values (``.item()``, ``.tolist()``, ``bool/float/int``)
by flowrl code (``reads_flowrl``; ``reads_other``: torch, accelerate, ...), on CUDA every synchronising
call (``cuda_syncs``, via ``torch.cuda.set_sync_debug_mode``), ``.cpu()`` calls (``device_to_host``:
of device tensors), ``encode_prompts`` calls and walks of the transformer's module tree (what
diffusers' ``.dtype`` did per ``velocity`` call). It times the rollout (VAE decode excluded) against
the bare transformer forwards it needs, replayed on random inputs of the same shapes:
``wall_over_bare`` is the sampler's overhead factor (goal on GPU at SD3.5-Medium size: <= 1.05).

Pipelines: ``digits`` (random init), ``sd3`` / ``flux`` (tiny, ``make_tiny``), ``sd35m`` (an
SD3.5-Medium-shaped random-init transformer in the SD3 adapter, random text embeddings of the real
shapes, the tiny VAE: a GPU workload). The GPU check::

    flowrl bench host --pipeline sd35m --device cuda --dtype bfloat16 --resolution 512 --prompts 6 \\
        --group-size 24 --num-steps 10 --max-batch 9 --guidance 4.5 --minibatch 9 --grad-accum 72 \\
        --profile runs/host_profile --json bench_host_sd35m.json
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import hashlib
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator, Optional

import torch

from ..command_line import positive_int
from ..rollout.group import GroupSampler
from ..utils.io import write_json
from ..utils.paths import resolve_device

PIPELINES = ("digits", "sd3", "flux", "sd35m")
RECIPES = {"digits": "digits", "sd3": "sd3_group_pickscore", "sd35m": "sd3_group_pickscore",
           "flux": "flux_group_pickscore"}
# stabilityai/stable-diffusion-3.5-medium transformer/config.json
SD35M_CONFIG = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                    attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                    caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
                    dual_attention_layers=tuple(range(13)), qk_norm="rms_norm")
_READS = ("item", "tolist", "__bool__", "__float__", "__int__")
_FLOWRL_DIRS = (str(Path(__file__).resolve().parents[1]),)
_SKIP_DIRS = (str(Path(torch.__file__).resolve().parent), str(Path(__file__).resolve()))


@dataclass
class HostOptions:
    """One measured iteration: ``prompts x group_size`` samples, ``num_steps`` SDE steps."""

    pipeline: str = "digits"
    device: str = "auto"
    dtype: str = "float32"
    resolution: Optional[int] = None  # pixels; None: the pipeline's tiny default (sd35m: 512)
    prompts: int = 2
    group_size: int = 4
    num_steps: int = 4
    max_batch: Optional[int] = None
    guidance: Optional[float] = None  # None: 1.0 for digits, the recipe's otherwise
    minibatch: int = 4
    grad_accum: int = 2
    update: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.pipeline not in PIPELINES:
            raise ValueError(f"pipeline must be one of {PIPELINES}, got {self.pipeline!r}")
        self.device = str(resolve_device("auto")) if self.device == "auto" else self.device


# ---------------------------------------------------------------- counters
def _origin() -> str:
    """``"flowrl"`` when the nearest caller outside torch (and this file) is flowrl code."""
    f = sys._getframe(2)
    while f is not None and f.f_code.co_filename.startswith(_SKIP_DIRS):
        f = f.f_back
    name = f.f_code.co_filename if f is not None else ""
    return "flowrl" if name.startswith(_FLOWRL_DIRS) else "other"


@contextlib.contextmanager
def host_counters(transformer: Optional[torch.nn.Module] = None) -> Iterator[collections.Counter]:
    """Counts (see module doc) while inside: ``reads_flowrl``, ``reads_other``, ``cpu_calls``,
    ``device_to_host``, ``transformer_walks`` and, on CUDA, ``cuda_syncs``."""
    c: collections.Counter = collections.Counter()
    saved = {n: getattr(torch.Tensor, n) for n in (*_READS, "cpu")}
    saved_nm = torch.nn.Module.named_modules
    root = getattr(transformer, "module", transformer)

    def reader(orig):
        return lambda self, *a, **k: c.update([f"reads_{_origin()}"]) or orig(self, *a, **k)

    def cpu(self, *a, **k):
        c["cpu_calls"] += 1
        c["device_to_host"] += self.device.type != "cpu"
        return saved["cpu"](self, *a, **k)

    def named_modules(self, *a, **k):
        c["transformer_walks"] += self is root and not a and not k.get("prefix")
        return saved_nm(self, *a, **k)

    for n in _READS:
        setattr(torch.Tensor, n, reader(saved[n]))
    torch.Tensor.cpu, torch.nn.Module.named_modules = cpu, named_modules
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    mode = torch.cuda.get_sync_debug_mode() if cuda else 0
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            yield c
        c["cuda_syncs"] += sum("synchroniz" in str(w.message) for w in caught)
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode(mode)
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)
        torch.nn.Module.named_modules = saved_nm


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # the clock reads finished GPU work
        torch.cuda.synchronize(device)


@contextlib.contextmanager
def recorded_forwards(module: torch.nn.Module) -> Iterator[list[dict]]:
    """Inside, each forward call of ``module`` appends its keyword arguments' shapes and dtypes (or
    non-tensor values) to the yielded list, for :func:`replay_bare`."""
    calls: list[dict] = []

    def pre(mod, args, kwargs) -> None:
        calls.append({k: (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else ("value", v)
                      for k, v in kwargs.items()})

    hook = module.register_forward_pre_hook(pre, with_kwargs=True)
    try:
        yield calls
    finally:
        hook.remove()


def _random_input(name: str, spec: tuple, device: torch.device):
    """A stand-in for one recorded keyword argument: the value itself, or a tensor of its shape and dtype."""
    shape, dtype = spec
    if shape == "value":
        return dtype
    if not dtype.is_floating_point:
        return torch.zeros(shape, dtype=dtype, device=device)
    x = torch.rand(shape, device=device) * 1000 if name == "timestep" else torch.randn(shape, device=device)
    return x.to(dtype)  # timestep: [B] in the model's time range


@torch.no_grad()
def replay_bare(module: torch.nn.Module, calls: list[dict], device: torch.device) -> float:
    """Seconds for the recorded forwards alone (random inputs of the recorded shapes, made before
    the clock starts; one warm-up call per distinct shape)."""
    inputs, keys = {}, []
    for spec in calls:
        key = repr(sorted(spec.items(), key=lambda kv: kv[0]))
        if key not in inputs:
            inputs[key] = {k: _random_input(k, v, device) for k, v in spec.items()}
            module(**inputs[key])  # warm-up
        keys.append(key)
    _sync(device)
    t0 = time.perf_counter()
    for key in keys:
        module(**inputs[key])
    _sync(device)
    return time.perf_counter() - t0


# ---------------------------------------------------------------- policies
def _random_text_encoder(policy, tokens: int):
    """``encode_prompts`` of random embeddings of SD3's shapes, fixed per prompt (no text encoders)."""
    from ..seeding import seeded_randn

    cfg = policy.transformer.config

    def encode_prompts(prompts: list[str]) -> dict[str, torch.Tensor]:
        ids = [int(hashlib.sha256(p.encode()).hexdigest()[:8], 16) for p in prompts]  # a seed per prompt
        pe = seeded_randn(ids, (tokens, cfg.joint_attention_dim), stream=0, device=policy.device)  # [B, L, D]
        pooled = seeded_randn(ids, (cfg.pooled_projection_dim,), stream=1, device=policy.device)  # [B, P]
        cond = {"prompt_embeds": pe, "pooled_prompt_embeds": pooled}
        if policy.guidance_scale > 1.0:
            cond.update(negative_prompt_embeds=torch.zeros_like(pe),
                        negative_pooled_prompt_embeds=torch.zeros_like(pooled))
        return cond

    return encode_prompts


def build_host_policy(o: HostOptions, workdir: Path):
    """The policy of ``o.pipeline`` on ``o.device`` (module doc)."""
    dev = torch.device(o.device)
    if o.pipeline == "digits":
        from diffusers import SD3Transformer2DModel

        from ..pipelines.digits import DigitsPolicy, DigitTextEncoder, tiny_transformer_config

        torch.manual_seed(o.seed)
        return DigitsPolicy(SD3Transformer2DModel(**tiny_transformer_config()).eval(), DigitTextEncoder().eval(),
                            guidance_scale=o.guidance or 1.0, device=dev)
    from ..pipelines.common import resolve_dtype
    from ..pipelines.tiny import make_tiny

    kind = "flux" if o.pipeline == "flux" else "sd3"
    path = make_tiny(kind, workdir / kind, image_size=64 if o.pipeline == "sd35m" else o.resolution or 64)
    if o.pipeline == "flux":
        from ..pipelines.flux import FluxPolicy

        return FluxPolicy.from_pretrained(path, device=dev, dtype=o.dtype, max_sequence_length=16,
                                          guidance_scale=o.guidance if o.guidance is not None else 3.5)
    from ..pipelines.sd3 import SD3Policy

    guidance = o.guidance if o.guidance is not None else 4.5
    if o.pipeline == "sd3":
        return SD3Policy.from_pretrained(path, device=dev, dtype=o.dtype, max_sequence_length=16,
                                         guidance_scale=guidance)
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(str(path))
    with torch.device(dev):
        pipe.transformer = SD3Transformer2DModel(**SD35M_CONFIG).to(resolve_dtype(o.dtype)).eval()
    policy = SD3Policy(pipe, guidance_scale=guidance, max_sequence_length=128, resolution=o.resolution or 512,
                       device=dev)
    policy.encode_prompts = _random_text_encoder(policy, tokens=77 + 128)
    return policy


def _mean_pixel(images: torch.Tensor, prompts: list[str], **meta) -> torch.Tensor:
    """A reward at no cost: the mean pixel of each image (or video), float32 [B]."""
    return images.float().flatten(1).mean(dim=1)


def bench_trainer(policy, o: HostOptions, workdir: Path, overrides: tuple[str, ...] = ()):
    """An ``OnlineTrainer`` set up around ``policy`` with the pipeline's recipe (LoRA, optimizer, KL, CFG
    setting) plus ``overrides``, scoring with the free ``_mean_pixel`` reward (no reward model loads);
    its run directory is ``workdir/run``."""
    from ..trainers.config import load_config
    from ..trainers.online import OnlineTrainer

    bf16 = torch.device(o.device).type == "cuda" and o.dtype != "float32"
    cfg = load_config(RECIPES[o.pipeline], [
        f"model.device={o.device}", f"train.minibatch_size={o.minibatch}", f"train.grad_accum={o.grad_accum}",
        f"train.mixed_precision={'bf16' if bf16 else repr('no')}", "logging.trackers=[]", "logging.progress=false",
        "reward.heldout={}", "model.text_embedding_cache=null", "model.drop_text_encoders=false",
        "data.prompts=[a photo of a cat]", "data.eval_prompts=[a photo of a cat]", *overrides])
    trainer = OnlineTrainer(cfg, workdir / "run", policy=policy, reward=_mean_pixel)
    trainer.setup()
    return trainer


# ---------------------------------------------------------------- the measurement
def _timed_rollout(policy, o: HostOptions, prompts: list[str]) -> tuple[object, dict]:
    dev = torch.device(o.device)
    GroupSampler(group_size=o.group_size, num_steps=1, max_batch=o.max_batch)(policy, prompts, None)  # warm-up
    decode, spent = policy.decode, [0.0]

    def timed_decode(latents):
        _sync(dev)
        t, out = time.perf_counter(), decode(latents)
        _sync(dev)
        spent[0] += time.perf_counter() - t
        return out

    policy.decode = timed_decode
    sampler = GroupSampler(group_size=o.group_size, num_steps=o.num_steps, max_batch=o.max_batch)
    try:
        with host_counters(policy.transformer) as c, recorded_forwards(policy.transformer) as calls:
            _sync(dev)
            t0 = time.perf_counter()
            rollout = sampler(policy, prompts, _mean_pixel, seed=o.seed)
            _sync(dev)
            wall = time.perf_counter() - t0 - spent[0]
    finally:
        del policy.decode
    bare = replay_bare(policy.transformer, calls, dev)
    out = {"wall_seconds": wall, "decode_seconds": spent[0], "bare_forward_seconds": bare,
           "wall_over_bare": wall / bare if bare > 0 else float("nan"), "transformer_forwards": len(calls),
           "samples": rollout.num_samples, "model_evals": rollout.stats["model_evals"]}
    out.update({f"{k}_per_step": v / o.num_steps for k, v in c.items()})
    out["transformer_walks_per_forward"] = c["transformer_walks"] / max(1, len(calls))
    return rollout, out


@contextlib.contextmanager
def counted_calls(obj, name: str, counter: collections.Counter) -> Iterator[None]:
    """Inside, calls of ``obj.<name>`` are counted in ``counter[name]``; the attribute is restored after."""
    had, orig = name in vars(obj), getattr(obj, name)

    def counted(*a, **k):
        counter[name] += 1
        return orig(*a, **k)

    setattr(obj, name, counted)
    try:
        yield
    finally:
        setattr(obj, name, orig) if had else delattr(obj, name)


def _timed_update(trainer, rollout, o: HostOptions) -> dict:
    dev, n = torch.device(o.device), collections.Counter()
    steps0 = trainer.steps.opt_steps + trainer.steps.skipped
    upd = trainer.update_object()
    with counted_calls(trainer.policy, "encode_prompts", n), counted_calls(upd, "minibatch_loss", n), \
            host_counters(trainer.policy.transformer) as c:
        _sync(dev)
        t0 = time.perf_counter()
        stats, _ = trainer.train_on(rollout, 0)
        _sync(dev)
        wall = time.perf_counter() - t0
    m = max(1, n["minibatch_loss"])
    out = {"wall_seconds": wall, "minibatches": n["minibatch_loss"], "encode_prompts_calls": n["encode_prompts"],
           "optimizer_steps": trainer.steps.opt_steps + trainer.steps.skipped - steps0, "loss": stats.get("loss")}
    out.update({f"{k}_per_minibatch": v / m for k, v in c.items()})
    return out


def run_host_bench(o: HostOptions, profile_dir: Optional[str] = None) -> dict:
    """Measure one iteration (module doc); returns the report dict."""
    with tempfile.TemporaryDirectory(prefix="flowrl-host-") as tmp:
        workdir = Path(tmp)
        policy = build_host_policy(o, workdir)
        trainer = bench_trainer(policy, o, workdir) if o.update else None  # LoRA in place, as in training
        prompts = [f"a handwritten digit {i % 10}" for i in range(o.prompts)]
        policy.transformer.eval()
        rollout, roll = _timed_rollout(policy, o, prompts)
        upd = _timed_update(trainer, rollout, o) if trainer is not None else {}
        if profile_dir:
            _profile(policy, o, prompts, Path(profile_dir))
    dev = torch.device(o.device)
    return {"options": asdict(o), "torch": torch.__version__, "cuda": torch.version.cuda,
            "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
            "rollout": roll, "update": upd}


def _profile(policy, o: HostOptions, prompts: list[str], out: Path) -> None:
    """A ``torch.profiler`` trace of one more rollout: ``rollout_trace.json`` (chrome://tracing) and
    ``rollout_ops.txt`` (top operators)."""
    from torch.profiler import ProfilerActivity, profile

    out.mkdir(parents=True, exist_ok=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.device(o.device).type == "cuda" else [])
    with profile(activities=acts) as prof:
        GroupSampler(group_size=o.group_size, num_steps=o.num_steps, max_batch=o.max_batch)(policy, prompts, None)
        _sync(torch.device(o.device))
    prof.export_chrome_trace(str(out / "rollout_trace.json"))
    key = "self_cuda_time_total" if len(acts) > 1 else "self_cpu_time_total"
    (out / "rollout_ops.txt").write_text(prof.key_averages().table(sort_by=key, row_limit=30))


def table(report: dict) -> str:
    """The report as aligned ``section.key value`` lines."""
    lines = [f"flowrl bench host: {report['options']['pipeline']} on {report['device_name']} (torch {report['torch']})"]
    for sec in ("rollout", "update"):
        for k, v in report[sec].items():
            lines.append(f"  {sec}.{k:<34} {v:.4g}" if isinstance(v, float) else f"  {sec}.{k:<34} {v}")
    return "\n".join(lines)


def _run(a) -> str:
    keys = set(HostOptions.__dataclass_fields__) - {"update"}
    o = HostOptions(**{k: v for k, v in vars(a).items() if k in keys}, update=not a.no_update)
    report = run_host_bench(o, a.profile)
    if a.json:
        write_json(report, Path(a.json))
        print(f"[bench host] wrote {a.json}")
    return table(report)


def add_host_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``host`` under the ``flowrl bench`` sub-commands."""
    p = subparsers.add_parser("host", epilog="example:\n  flowrl bench host --json bench/host.json", help="host overhead "
                              "of one iteration: syncs, copies, re-encodes, rollout wall time vs the bare forwards")
    p.add_argument("--pipeline", choices=PIPELINES, default="digits")
    p.add_argument("--device", default="auto", help="cpu, cuda, or auto")
    p.add_argument("--dtype", default="float32", help="sd3 / flux / sd35m weights: float32 or bfloat16")
    p.add_argument("--resolution", type=positive_int, default=None, help="pixels (sd35m default 512)")
    p.add_argument("--guidance", type=float, default=None, help="CFG scale (default: digits 1.0, sd3 4.5, flux 3.5)")
    for name, default in (("prompts", 2), ("group-size", 4), ("num-steps", 4), ("minibatch", 4), ("grad-accum", 2),
                          ("max-batch", None)):
        p.add_argument(f"--{name}", type=positive_int, default=default)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-update", action="store_true", help="time the rollout only")
    p.add_argument("--profile", default=None, help="directory for a torch.profiler trace of one more rollout")
    p.add_argument("--json", default=None, help="write the report here (default: nothing written, the table only)")
    p.set_defaults(fn=_run)
    return p
