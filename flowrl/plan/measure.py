"""The real peak memory of a recipe's training pass and sampling forward, to check the plan.

Measured on the recipe's own transformer, set up as the trainer sets it up (LoRA or all weights,
gradient checkpointing as configured), with AdamW:

* ``train``: two optimizer steps of one forward + backward of ``train_rows`` rows each; the peak
  holds the weights, LoRA, gradients, AdamW states and one pass's activations;
* ``infer``: one ``no_grad`` forward of the sampler's rows; the peak holds the weights and the
  forward's transient.

The inputs (latents, conditioning) are made before the measurement starts: the plan counts them in
their own rows (the rollout's conditioning and latents), not in these two.

Peak bytes: on CUDA ``torch.cuda.max_memory_allocated`` (the weights loaded with
``from_pretrained`` onto the GPU where they are on the machine, else random weights of the same
config built on the GPU); on CPU the torch profiler's allocator record (``profile_memory``:
the maximum ``Total Allocated`` of its ``[memory]`` events, counted from the start of the
profile), with the transformer built inside the profile from the model directory's config (its
weight values do not change memory). Both count the built model as held and take the peak from
the start of the pass: building's own transient (SD3's float32 position table, 864 MiB at
SD3.5-Medium size, cast to bf16) is a load-time peak, not the pass's. The planned figure is the
sum of the same plan rows.
"""
from __future__ import annotations

import gc
import json
import os
import tempfile
from pathlib import Path
from typing import Callable

import torch

from ..errors import ConfigError
from ..utils.cuda_quirks import apply_cuda_workarounds
from .activations import max_rows, velocity_of
from .budget import cfg_rows, train_rows
from .core import measured_setup
from .models import module_bytes, set_up_trained

CPU_LIMIT_BYTES = 2 * 2 ** 30  # the largest transformer --measure builds on a CPU


PASS_MARK = "flowrl.measure.pass"


def cpu_peak(fn: Callable[[Callable], None]) -> int:
    """Peak bytes the CPU allocator held above its level at the start of ``fn(mark)``, from the moment ``fn``
    enters ``with mark():`` (what ``fn`` built before, the model, is counted as held then; a transient of
    building it is not: a float32 position table cast to bf16 is a load-time peak, not the pass's). Torch
    profiler; its own log lines, e.g. ``gpuGetDeviceCount failed`` on a machine without a GPU, are silenced
    unless ``KINETO_LOG_LEVEL`` is set."""
    from torch.profiler import ProfilerActivity, profile, record_function

    os.environ.setdefault("KINETO_LOG_LEVEL", "6")  # read by the profiler library when it starts: above USDT
    gc.collect()  # the previous pass's model and optimizer (reference cycles) freed now, not at a gc inside fn
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn(lambda: record_function(PASS_MARK))
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        events = json.loads(open(path).read())["traceEvents"]
    finally:
        os.unlink(path)
    mem = sorted((e for e in events if e.get("name") == "[memory]"), key=lambda e: (e["ts"], e["args"]["Bytes"] > 0))
    if not mem:
        return 0
    # "Total Allocated" is the allocator's whole level, also what was held before fn (earlier objects of
    # this process): the level at the start is the first event's total before its own allocation
    start = mem[0]["args"]["Total Allocated"] - mem[0]["args"]["Bytes"]
    t0 = min((e["ts"] for e in events if e.get("name") == PASS_MARK), default=mem[0]["ts"])
    held, peak = start, 0  # the level as the pass starts; the highest level within it
    for e, level in zip(mem, recorded_levels(mem)):
        if e["ts"] < t0:
            held = level
        else:
            peak = max(peak, level)
    return max(0, held - start, peak - start)


def recorded_levels(mem: list[dict]) -> list[int]:
    """The allocator's level after each ``[memory]`` event (in time order), corrected for frees the profiler
    did not record: it records the threads it profiles, and gloo's worker threads free the buffers of
    collectives they finished (a context-parallel pass's all-to-alls: 39 MiB of a 237 MiB peak on the
    Wan check model with checkpointing). An address allocated again without a recorded free was freed
    before: from then on it no longer counts (until then it does: the level stays an upper bound)."""
    live: dict[int, int] = {}
    lost, out = 0, []
    for e in mem:
        addr, size = e["args"]["Addr"], e["args"]["Bytes"]
        if size > 0:
            lost += live.pop(addr, 0)  # still live by the record: its free happened on another thread
            live[addr] = size
        else:
            live.pop(addr, None)
        out.append(e["args"]["Total Allocated"] - lost)
    return out


def cuda_peak(fn: Callable[[Callable], None]) -> int:
    """Peak bytes of ``torch.cuda.max_memory_allocated`` above the level at the start of ``fn(mark)``, from the
    moment ``fn`` enters ``with mark():`` (as :func:`cpu_peak`; from an emptied cache)."""
    import contextlib

    @contextlib.contextmanager
    def mark():
        gc.collect()
        torch.cuda.reset_peak_memory_stats()  # the peak restarts at the level held now (the model)
        yield

    gc.collect()  # as cpu_peak
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn(mark)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def weights_source(cfg, device: torch.device) -> str:
    """Where :func:`_real_transformer` takes the transformer from: ``"from_pretrained"`` (CUDA, the recipe's
    weights on this machine) or ``"random"`` (the config alone: on a CPU, and on a GPU without the
    download; a weight's value does not change memory)."""
    from ..utils.hub import require_hub_model

    if device.type != "cuda" or not cfg.model.path:
        return "random"
    try:
        require_hub_model(cfg.model.path, f"the {cfg.model.pipeline} base model", "model.path")
    except FileNotFoundError:
        return "random"
    return "from_pretrained"


def _real_transformer(cfg, comp, device: torch.device, weights: str):
    """The recipe's transformer on ``device``: from_pretrained where ``weights`` (:func:`weights_source`) says
    so, else built from the config (module doc)."""
    from ..pipelines.facts import build_component, component_class

    spec = comp.adapter.transformer_component(comp.config, cfg.model.options)
    if spec.cls.startswith("diffusers:") and weights == "from_pretrained":
        return component_class(spec.cls).from_pretrained(cfg.model.path, subfolder="transformer",
                                                         torch_dtype=comp.dtypes["transformer"]).to(device)
    return build_component(spec, device, comp.dtypes["transformer"])


def _inputs(comp, shapes, rows: int, device: torch.device) -> tuple:
    """``(x, kwargs)``: ``rows`` rows of random latents and the transformer's forward kwargs for them
    (random conditioning; masks and ids: ones)."""
    def real(t: torch.Tensor) -> torch.Tensor:
        return torch.rand(t.shape, dtype=t.dtype, device=device) if t.is_floating_point() else \
            torch.ones(t.shape, dtype=t.dtype, device=device)

    dt = comp.dtypes["transformer"]
    x = torch.randn(rows, *shapes.latent_shape, device=device, dtype=dt)  # [B, C, (F,) h, w]
    sigma = torch.rand(rows, device=device)  # [B]
    cond = {k: real(v) for k, v in comp.adapter.example_conditioning(comp.configs, shapes, rows, "meta", dt).items()}
    return x, comp.adapter.transformer_inputs(comp.config, dt, x, sigma, cond)


def _set_up(cfg, comp, device: torch.device, weights: str):
    """The transformer with the trainer's LoRA (or all weights trainable), its forwards split over the
    process group under ``train.context_parallel`` (one group: the measuring processes)."""
    tr = set_up_trained(_real_transformer(cfg, comp, device, weights), cfg)
    if cfg.train.context_parallel > 1:
        import dataclasses

        import torch.distributed as dist

        from ..distributed.context import attention_heads
        from ..distributed.mesh import ParallelLayout
        from ..distributed.parallelize import parallelize

        # the trainer's layout and its one parallelize, unsharded: the passes' peaks are one replica's (the plan
        # counts the shards)
        layout = ParallelLayout.of(cfg.train, dist.get_world_size(), dist.get_rank(), attention_heads(tr))
        parallelize([tr], dataclasses.replace(layout, sharded=False), device)
    return tr


def measure_split_recipe(cfg) -> dict:
    """:func:`measure_recipe` in ``train.context_parallel`` CPU processes (``torch.distributed.run``, one
    context-parallel group), each measuring its own peaks. The ranks of one group do the same work on equal
    shards, and each rank's reading is an upper bound of that same peak (:func:`recorded_levels`: a free on
    gloo's threads counts only once its address is reused, which varies with the threads' timing): per pass
    the smallest reading is the tightest bound. Every rank's reading is kept under ``per_rank``."""
    import socket
    import subprocess
    import sys

    from ..trainers.config import dump_config

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "recipe.yaml").write_text(dump_config(cfg))
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node",
                            str(cfg.train.context_parallel), "--master_addr", "127.0.0.1", "--master_port", str(port),
                            "-m", "flowrl.plan.measure", "--passes", str(Path(tmp) / "recipe.yaml"), tmp],
                           capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        if r.returncode != 0:
            raise RuntimeError(f"--measure in {cfg.train.context_parallel} processes failed:\n{r.stderr[-2000:]}")
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("passes_rank*.json"))]
    out = dict(ranks[0])
    for k in ("train", "infer"):
        out[k] = min((m[k] for m in ranks), key=lambda r: r["measured_bytes"])
    out["per_rank"] = {k: [m[k]["measured_bytes"] for m in ranks] for k in ("train", "infer")}
    out["ranks"] = len(ranks)
    return out


def _train(cfg, comp, inputs: tuple, device: torch.device, weights: str, mark: Callable) -> None:
    tr = _set_up(cfg, comp, device, weights)
    if cfg.model.options.get("gradient_checkpointing"):
        tr.enable_gradient_checkpointing()
    tr.train()
    opt = torch.optim.AdamW([p for p in tr.parameters() if p.requires_grad], lr=1e-6)
    x, kw = inputs
    with mark():
        for _ in range(2):
            out = velocity_of(comp, tr, x, kw)
            out.float().square().mean().backward()
            del out
            opt.step()
            opt.zero_grad(set_to_none=False)


def _infer(cfg, comp, inputs: tuple, device: torch.device, weights: str, mark: Callable) -> None:
    tr = _set_up(cfg, comp, device, weights).eval()
    with mark(), torch.no_grad():
        velocity_of(comp, tr, *inputs)


def measure_recipe(cfg, device=None) -> dict:
    """Measured vs planned peak bytes of the training pass and the sampling forward (module doc). With
    ``train.context_parallel: C`` and no process group yet, the passes run in ``C`` processes
    (:func:`measure_split_recipe`)."""
    import torch.distributed as dist

    if cfg.train.context_parallel > 1 and not dist.is_initialized():
        return measure_split_recipe(cfg)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    comp, acts = measured_setup(cfg)
    acts = acts.degree(cfg.train.context_parallel)
    if device.type == "cpu" and module_bytes(comp.transformer) > CPU_LIMIT_BYTES:
        raise ConfigError(f"--measure on the CPU builds the transformer for real: "
                          f"{module_bytes(comp.transformer) / 2**30:.1f} GiB of weights is too large for a CPU check "
                          f"(limit {CPU_LIMIT_BYTES / 2**30:.0f} GiB); run it on a GPU, or on a smaller model directory "
                          f"(flowrl.plan.measure.write_check_model)")
    shapes = acts.shapes
    apply_cuda_workarounds(device)  # as the trainer (flowrl.utils.cuda_quirks)
    peak = cuda_peak if device.type == "cuda" else cpu_peak
    tr = comp.transformer
    trained = module_bytes(tr, trainable=True)
    ckpt = bool(cfg.model.options.get("gradient_checkpointing", False))
    rows_t = train_rows(cfg, comp)
    rows_i = max_rows(cfg.train.batch_size, getattr(cfg.sampler.build().trained_sampler, "max_batch", None)) * \
        cfg_rows(cfg, comp)
    planned = {"train": module_bytes(tr) + 3 * trained + acts.bytes("train", rows_t, ckpt),
               "infer": module_bytes(tr) + acts.bytes("infer", rows_i)}
    inputs = {"train": _inputs(comp, shapes, rows_t, device), "infer": _inputs(comp, shapes, rows_i, device)}
    weights = weights_source(cfg, device)  # once: it may ask the hub whether it answers
    measured = {"train": peak(lambda mark: _train(cfg, comp, inputs["train"], device, weights, mark)),
                "infer": peak(lambda mark: _infer(cfg, comp, inputs["infer"], device, weights, mark))}
    out = {"device": str(device), "rows": {"train": rows_t, "infer": rows_i}, "weights": weights}
    for k in ("train", "infer"):
        out[k] = {"measured_bytes": int(measured[k]), "planned_bytes": int(planned[k]),
                  "relative_error": (planned[k] - measured[k]) / max(measured[k], 1)}
    return out


def measure_trainer(cfg, run_dir) -> dict:
    """This process's measured memory in the real online trainer (``flowrl.trainers.online``), in bytes:
    ``rollout`` and ``train`` (one rollout, then one update on it: each the allocator's peak above the
    level at its start) and ``resident`` (every parameter and buffer of the transformer, VAE and text
    encoders, the AdamW states and the EMA, counted on the real modules; FSDP shards: this process's
    part). Works under ``torchrun`` (each process measures itself; ``train.sharding`` as configured).
    The plan to compare: ``resident_bytes + max(rollout_bytes, train_bytes)``."""
    from torch.distributed.tensor import DTensor

    from ..trainers.online import OnlineTrainer

    peak = cuda_peak if torch.cuda.is_available() and cfg.model.device != "cpu" else cpu_peak
    tr = OnlineTrainer(cfg, run_dir)
    tr.setup()
    out: dict = {}

    def rollout() -> None:
        tr.model.eval()
        out["r"] = tr.sampler(tr.policy, tr._iteration_prompts(0), tr.reward, seed=1, iteration=0)

    measured = {"rollout": peak(lambda mark: rollout()), "train": peak(lambda mark: tr.train_on(out["r"], 0))}
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    holder = getattr(tr.policy, "pipe", tr.policy)
    mods = [tr.policy.transformer, getattr(tr.policy, "vae", None)] + [
        getattr(holder, n, None) for n in getattr(tr.policy, "text_encoder_names", ("text_encoder",))]
    tensors = {id(t): local(t) for m in mods if m is not None for t in [*m.parameters(), *m.buffers()]}
    tensors.update({id(t): local(t) for s in tr.opt.state.values() for t in s.values() if t.dim() > 0})
    tensors.update({id(t): local(t) for t in (tr.ema.shadow.values() if tr.ema else ())})
    measured["resident"] = sum(t.numel() * t.element_size() for t in tensors.values())
    measured["process_index"] = tr.acc.process_index
    tr._shutdown()
    return measured


def _main(argv: list[str]) -> None:
    """``python -m flowrl.plan.measure RECIPE OUT_DIR [overrides]`` (under torchrun for several processes):
    writes ``OUT_DIR/measured_rank{R}.json`` (:func:`measure_trainer`); with ``--passes`` first,
    ``OUT_DIR/passes_rank{R}.json`` (:func:`measure_recipe` on this process group, CPU)."""
    from ..trainers.config import load_config

    if argv[0] == "--passes":
        import torch.distributed as dist

        recipe, out, *overrides = argv[1:]
        dist.init_process_group("gloo")
        m = measure_recipe(load_config(recipe, overrides), "cpu")
        Path(out, f"passes_rank{dist.get_rank()}.json").write_text(json.dumps(m))
        dist.destroy_process_group()
        return
    recipe, out, *overrides = argv
    m = measure_trainer(load_config(recipe, overrides), Path(out) / "run")
    Path(out, f"measured_rank{m['process_index']}.json").write_text(json.dumps(m))


def write_check_model(out_dir, num_layers: int = 12, heads: int = 4, resolution: int = 256, seed: int = 0):
    """A mid-size SD3 (``num_layers`` MMDiT blocks, the first three with dual attention, ``heads`` x 64
    wide; tiny text encoders and VAE) saved as a diffusers directory: large enough that weights and
    activations are tens to hundreds of MB, small enough to train a step on a CPU in seconds."""
    from diffusers import SD3Transformer2DModel, StableDiffusion3Pipeline

    from ..pipelines.sd3 import SD3Policy

    comps = SD3Policy.tiny_components("sd3", 64, seed)
    torch.manual_seed(seed)
    comps["transformer"] = SD3Transformer2DModel(
        sample_size=resolution // 8, patch_size=2, in_channels=16, out_channels=16, num_layers=num_layers,
        attention_head_dim=64, num_attention_heads=heads, joint_attention_dim=64, caption_projection_dim=64 * heads,
        pooled_projection_dim=64, pos_embed_max_size=resolution // 8, dual_attention_layers=tuple(range(min(3, num_layers))),
        qk_norm="rms_norm")
    StableDiffusion3Pipeline(**comps).save_pretrained(str(out_dir))
    (Path(out_dir) / "flowrl.json").write_text(json.dumps({"kind": "sd3", "resolution": resolution}))
    return Path(out_dir)


def write_wan_check_model(out_dir, num_layers: int = 6, heads: int = 4, resolution: int = 128, frames: int = 9,
                          seed: int = 0):
    """A mid-size Wan2.1 (``num_layers`` blocks, ``heads`` x 64 wide, FFN 4x; the tiny UMT5 encoder and video
    VAE) saved as a diffusers directory, at ``resolution`` px and ``frames`` frames by default: the
    context-parallel check (its tokens split over processes), large enough that activations are tens of MB."""
    from diffusers import WanPipeline, WanTransformer3DModel

    from ..pipelines.wan import WanPolicy

    comps = WanPolicy.tiny_components("wan", resolution, seed)
    torch.manual_seed(seed)
    comps["transformer"] = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=heads, attention_head_dim=64, in_channels=16, out_channels=16,
        text_dim=32, freq_dim=256, ffn_dim=4 * 64 * heads, num_layers=num_layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=64)
    WanPipeline(**comps).save_pretrained(str(out_dir))
    (Path(out_dir) / "flowrl.json").write_text(json.dumps({"kind": "wan", "resolution": resolution,
                                                           "num_frames": frames}))
    return Path(out_dir)


if __name__ == "__main__":
    import sys

    from ..utils.launch import finish

    _main(sys.argv[1:])
    finish(0)
