"""Per-GPU memory of a recipe, item by item (bytes), from the meta models and the measured activations.

``peak = resident + max(rollout phase, training phase)``:

* resident: transformer weights, LoRA, gradients, AdamW states, EMA, reference / old-policy copies,
  the exploration copy, text encoders, VAE, reward models (FSDP divides the sharded ones by the
  process count and adds two unsharded blocks; CPU offload moves the shards to host memory);
* rollout phase: what a rollout keeps on the GPU (conditioning, latents, stored transitions) plus the
  largest transient of the denoiser forward, the VAE decode, or a Sol re-sync; offline (``train.mode:
  offline``) the dataset generation's instead (``flowrl generate-offline``, ``offline.generation_batch``
  images per forward), a separate run planned with this one's resident set;
* training phase: the stored transitions (kept through the update) plus one training pass's
  activations (with or without gradient checkpointing, as the recipe sets it), with the reference
  forward held beside the graph when the update declares so (a KL term, GDRO / DPO implicit rewards).

Sizes follow what the code holds: trained tensors in their own dtype (LoRA: float32; a full
fine-tune trains the transformer in its loaded dtype), AdamW's two states per trained element in
that dtype, the EMA and each copy an update keeps (DiffusionNFT's old policy) one copy of the trained
tensors each. What the update needs comes from its declaration (``cfg.train.update_needs``,
:class:`flowrl.updates.base.Needs`), never from its name.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..quant import DEFAULT_SKIP, parse_backend_spec
from ..registry import resolve_target
from ..quant.common import is_skipped
from .activations import Activations, max_rows
from .models import MetaComponents, block_bytes, module_bytes, num_params

# bytes per weight element of the exploration copy's quantized Linear layers (the rest stays in the model dtype):
# nvfp4 packs two E2M1 values per byte plus one FP8 scale per 16 values; fp8 / int8 one byte (per-tensor / per-row
# scales are negligible); none and the fake-quantizing emulation keep the full-precision weights
QUANT_BYTES = {"nvfp4": 0.5 + 1 / 16, "fp8": 1.0, "int8-dynamic": 1.0}


@dataclass
class Item:
    """One row of the plan: ``bytes`` per GPU (or per process in host memory when ``where == 'host'``)."""

    name: str
    bytes: int
    group: str  # resident | gathered (FSDP, during transformer passes) | kept | transient | train | step | alternative
    where: str = "gpu"
    note: str = ""
    runs_transformer: bool = False  # a transient of the trained (sharded) transformer: FSDP gathers during it
    known: bool = True  # False: the size is unknown (counted as 0, shown as "?")


def shard_count(cfg, gpus: int) -> int:
    """Processes the trained state is split over: ``gpus`` under ``train.sharding=fsdp``, else 1 (replicas)."""
    return gpus if cfg.train.sharding == "fsdp" else 1


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


def exploration_copy_bytes(transformer, backend: str, options: dict) -> int:
    """Bytes of Sol's exploration copy: the merged transformer with quantized Linear weights (``QUANT_BYTES``)."""
    name, spec_opts = parse_backend_spec(backend)
    kernel = {**options, **spec_opts}.get("kernel", "auto")
    per = QUANT_BYTES.get(name) if not (name in ("nvfp4", "fp8") and kernel == "modelopt") else None
    total = sum(p.numel() * p.element_size() for n, p in transformer.named_parameters() if "lora_" not in n)
    total += sum(b.numel() * b.element_size() for b in transformer.buffers())
    if per is None:
        return total
    for mname, m in transformer.named_modules():
        clean = mname.replace(".base_layer", "")
        if isinstance(m, torch.nn.Linear) and "lora_" not in mname and not is_skipped(clean, DEFAULT_SKIP):
            w = m.weight  # [O, I]
            total -= w.numel() * w.element_size() - int(w.numel() * per)
    return total


def reward_items(cfg) -> list[Item]:
    """Trained-on and held-out reward models: what each declares it keeps (``flowrl.rewards.resident``)."""
    from ..rewards import resident

    out = []
    names = list(cfg.reward.weights) + [n for n in cfg.reward.heldout if n not in cfg.reward.weights]
    names += [n for n in cfg.train.update_needs.rewards if n not in names]  # models the update keeps itself
    for n in names:
        size, on_gpu, source = resident(n, {**cfg.reward.options.get(n, {}), **cfg.reward.heldout.get(n, {})})
        tag = "reward" if n in cfg.reward.weights else "held-out" if n in cfg.reward.heldout else "update's reward"
        out.append(Item(f"{tag} model: {n}", size or 0, "resident", "gpu" if on_gpu else "host", source,
                        known=size is not None))
    for target in cfg.train.update_needs.models:  # e.g. GARDO's image-feature model (fp32 on the training GPU)
        cls = resolve_target(target)
        params = getattr(cls, "resident_params", None)
        out.append(Item(f"update's model: {getattr(cls, 'name', target)}", (params or 0) * 4, "resident", "gpu",
                        f"{getattr(cls, 'resident_note', 'resident size unknown: not counted')}, counted in fp32",
                        known=params is not None))
    return out


def model_items(cfg, comp: MetaComponents, gpus: int) -> list[Item]:
    """Transformer weights, trained-state copies and the frozen components (module doc)."""
    t, needs = cfg.train, cfg.train.update_needs
    tr = comp.transformer
    lora = t.lora_rank > 0
    fsdp = t.sharding == "fsdp"
    n = shard_count(cfg, gpus)
    shard_where = "host" if (fsdp and t.cpu_offload) else "gpu"
    trained, trained_n = module_bytes(tr, trainable=True), num_params(tr, trainable=True)
    tdt = _dtype_name(next((p.dtype for p in tr.parameters() if p.requires_grad), torch.float32))
    shard_note = f" / {n} (FSDP)" if n > 1 else ""
    note = f"; {tr.plan_note}" if hasattr(tr, "plan_note") else ""  # e.g. Wan2.2's two experts
    rows = [(f"transformer weights ({_dtype_name(comp.dtypes['transformer'])})",
             module_bytes(tr, trainable=False) if lora else module_bytes(tr), f"{num_params(tr) - (trained_n if lora else 0):,} params{note}")]
    if lora:
        rows.append((f"LoRA adapter (rank {t.lora_rank}, {tdt})", trained, f"{trained_n:,} params"))
    rows += [(f"gradients ({tdt})", trained, "one per trained element"),
             (f"AdamW states (2 x {tdt})", 2 * trained, "exp_avg + exp_avg_sq")]
    if t.ema:
        rows.append((f"EMA ({tdt})", trained, "train.ema: one copy of the trained tensors"))
    if needs.reference and not lora:
        rows.append(("reference copy", module_bytes(tr), "full fine-tune: a frozen copy of the transformer"))
    for copy in needs.copies:
        rows.append((f"{copy.replace('_', ' ')} of train.loss={t.loss} ({tdt})", trained,
                     "a copy of the trained tensors the update keeps"))
    items = [Item(name, -(-b // n), "resident", shard_where, note + shard_note) for name, b, note in rows]
    if needs.reference and lora:
        items.append(Item("reference", 0, "resident", "gpu", "LoRA: the adapter-disabled model, no copy"))
    if fsdp and (n > 1 or t.cpu_offload):
        items.append(Item("FSDP unsharded blocks (2 x largest)", 2 * block_bytes(tr), "gathered", "gpu",
                          "one block gathered for compute, the next prefetched: during transformer passes only"))
    explore = cfg.sampler.build().exploration(t.batch_size)  # the sampler's declaration (Sol-RL's quantized copy)
    if explore is not None:
        items.append(Item(f"exploration copy ({explore.backend})",
                          exploration_copy_bytes(tr, explore.backend, explore.options), "resident", "gpu",
                          "LoRA merged; embedders / output layers full precision"))
    dropped = cfg.model.drop_text_encoders and cfg.model.text_embedding_cache
    te = sum(module_bytes(m) for m in comp.text_encoders.values())
    items.append(Item("text encoders", 0 if dropped else te, "resident", "gpu",
                      "dropped: embeddings cached" if dropped else ", ".join(comp.text_encoders)))
    if comp.vae is None:
        items.append(Item("VAE", 0, "resident", "gpu", "none: decoded without one"))
    else:
        items.append(Item(f"VAE ({_dtype_name(comp.dtypes['vae'])})", module_bytes(comp.vae), "resident"))
    return items + reward_items(cfg)


def cfg_rows(cfg, comp: MetaComponents) -> int:
    """Rows per sample in a sampling forward: 2 with real classifier-free guidance (the adapter's ``cfg_rows``)."""
    return comp.adapter.cfg_rows(cfg.model.guidance_scale, cfg.model.options)


def _cond_row_bytes(comp: MetaComponents, acts: Activations) -> int:
    """Bytes of one sample's conditioning (the adapter's ``example_conditioning``, text-encoder dtype)."""
    cond = comp.adapter.example_conditioning(comp.configs, acts.shapes, 1, "meta", comp.dtypes["text_encoder"])
    return sum(t.numel() * t.element_size() for t in cond.values())


def decode_rows(cfg, samples: int) -> int:
    """Images per VAE call: ``model.options.decode_batch`` (the adapters' default when unset; null = all)."""
    from ..pipelines.common import DECODE_BATCH

    b = (cfg.model.options or {}).get("decode_batch", DECODE_BATCH)
    return min(samples, b) if b else samples


def chunk_decode_rows(cfg, samples: int, chunk_rows: int) -> int:
    """Images per VAE call when sampling runs ``chunk_rows`` rows at a time: each finished chunk is
    decoded (and handed to the reward) on its own, ``model.options.decode_batch`` images per call."""
    return min(decode_rows(cfg, samples), chunk_rows)


def _working_set(cfg, comp, acts: Activations, samples: int, fwd_rows: int, k: int) -> tuple[int, int, int]:
    """(kept bytes: conditioning + latents, denoiser forward peak, VAE decode peak) of sampling ``samples``
    in chunks of ``fwd_rows`` rows (the samplers decode each chunk as it finishes)."""
    kept = samples * (_cond_row_bytes(comp, acts) * k + 2 * acts.shapes.latent_bytes)
    return kept, acts.bytes("infer", fwd_rows * k), acts.bytes("decode", chunk_decode_rows(cfg, samples, fwd_rows))


def rollout_items(cfg, comp: MetaComponents, acts: Activations) -> list[Item]:
    """What a rollout keeps (group ``kept``) and its transients (group ``transient``: the largest counts);
    offline, :func:`generation_items`."""
    if cfg.train.mode == "offline":  # a generated dataset's working set; an image dataset is read, not sampled
        return generation_items(cfg, comp, acts) if cfg.train.update_needs.data == "groups" else []
    sampler = cfg.sampler.build()
    n = cfg.train.batch_size
    k = cfg_rows(cfg, comp)
    latent = acts.shapes.latent_bytes
    items = []
    gen = sampler.trained_sampler  # the sampler whose rollout trains (Sol-RL: its regeneration)
    explore = sampler.exploration(n)
    if explore is not None:
        pool, rows = explore.seeds, explore.rows
        kept, fwd, dec = _working_set(cfg, comp, acts, pool, rows, k)
        items.append(Item(f"exploration ({pool} seeds): latents + conditioning + max(forward, VAE decode)",
                          kept + max(fwd, dec), "transient", "gpu",
                          f"forward {rows * k} rows: {fwd / 2**30:.1f} GiB, decode "
                          f"{chunk_decode_rows(cfg, pool, rows)} images per VAE call: {dec / 2**30:.1f} GiB"))
        items.append(Item("exploration re-sync: merged full-precision copy before quantizing",
                          exploration_copy_bytes(comp.transformer, "none", {}), "transient"))
    rows = max_rows(n, getattr(gen, "max_batch", None))
    kept, fwd, dec = _working_set(cfg, comp, acts, n, rows, k)
    steps = len(gen.trained_steps()) if hasattr(gen, "trained_steps") else 0
    items += [Item(f"rollout: conditioning + latents ({n} samples)", kept, "kept"),
              Item(f"rollout: stored transitions ({n} x {steps} steps, float32)", n * steps * (2 * latent + 32), "kept",
                   note="latents + next latents per trained step; kept through the update"),
              Item(f"rollout: denoiser forward ({rows * k} rows, no grad)", fwd, "transient",
                   note="sampler.max_batch rows" + (" x 2 (CFG)" if k == 2 else ""), runs_transformer=True),
              Item(f"rollout: VAE decode ({chunk_decode_rows(cfg, n, rows)} images per call)", dec, "transient", "gpu",
                   "each finished chunk of sampler.max_batch rows, model.options.decode_batch images per VAE call"),
              Item(f"rollout: decoded images ({n}, float32)", n * acts.shapes.image_bytes, "kept", "host")]
    return items


def generation_items(cfg, comp: MetaComponents, acts: Activations) -> list[Item]:
    """Offline (``train.mode: offline``): ``flowrl generate-offline``'s working set, in place of a rollout:
    ``offline.generation_batch`` samples per sampler forward, decoded ``model.options.decode_batch`` at a time."""
    n = cfg.offline.generation_batch
    k = cfg_rows(cfg, comp)
    kept, fwd, dec = _working_set(cfg, comp, acts, n, n, k)
    note = "flowrl generate-offline: a separate run, planned with this one's resident set"
    return [Item(f"generate-offline: conditioning + latents ({n} samples)", kept, "kept", note=note),
            Item(f"generate-offline: denoiser forward ({n * k} rows, no grad)", fwd, "transient",
                 note="offline.generation_batch rows" + (" x 2 (CFG)" if k == 2 else ""), runs_transformer=True),
            Item(f"generate-offline: VAE decode ({decode_rows(cfg, n)} images per call)", dec, "transient", "gpu",
                 "model.options.decode_batch images per VAE call")]


def pass_rows(cfg) -> int:
    """Samples in one differentiable training pass: ``offline.batch_groups`` units of an update on a dataset (GDRO's
    groups of ``offline.k``, DPO's pairs, SFT's images: ``Needs.unit``); for an online one whose minibatch counts
    groups or pairs, the whole groups (pairs) that fit in ``train.minibatch_size``; else ``train.minibatch_size``
    transitions or samples."""
    needs = cfg.train.update_needs
    if needs.consumes == "dataset":
        return cfg.offline.batch_groups * {"group": cfg.offline.k, "pair": 2}.get(needs.unit, 1)
    k = {"group": cfg.sampler.samples_per_prompt, "pair": 2}.get(needs.unit, 1)
    return max(1, cfg.train.minibatch_size // k) * k


def reference_in_graph(cfg) -> bool:
    """Whether a ``no_grad`` reference forward runs while the training pass's graph is held (GRPO's KL, the
    implicit rewards of GDRO / DPO; DiffusionNFT evaluates its references before the graph): the update's
    declaration."""
    return cfg.train.update_needs.reference_in_graph


def train_rows(cfg, comp: MetaComponents) -> int:
    """Rows of one differentiable training forward: :func:`pass_rows`, doubled when real CFG runs as one
    batch with the gradient through both halves (``train.loss_options.cfg_uncond_grad``)."""
    k = cfg_rows(cfg, comp)
    return pass_rows(cfg) * (2 if k == 2 and cfg.train.update_options.cfg_uncond_grad else 1)


def train_items(cfg, comp: MetaComponents, acts: Activations, gpus: int = 1) -> list[Item]:
    """The two activation rows (with / without gradient checkpointing; the recipe's is group ``train``)."""
    rows = train_rows(cfg, comp)
    ref_rows = pass_rows(cfg) * cfg_rows(cfg, comp)  # no_grad: a guided reference is one doubled batch
    ckpt = bool(cfg.model.options.get("gradient_checkpointing", False))
    items = []
    for on in (False, True):
        peak = acts.bytes("train", rows, on)
        if reference_in_graph(cfg):  # the reference forward runs while the graph is held
            peak = max(peak, acts.saved(rows, on) + acts.bytes("infer", ref_rows))
        label = "with" if on else "without"
        items.append(Item(f"activations, {label} gradient checkpointing ({rows} rows)", peak,
                          "train" if on == ckpt else "alternative", "gpu",
                          f"saved for backward {acts.saved(rows, on) / 2**30:.2f} GiB"))
    tr = comp.transformer
    fsdp = cfg.train.sharding == "fsdp"
    n = shard_count(cfg, gpus)
    items.append(Item("AdamW step: foreach temporaries (~1 x trained tensors)", -(-module_bytes(tr, trainable=True) // n),
                      "step", "host" if fsdp and cfg.train.cpu_offload else "gpu",
                      "after backward, activations freed" + (f"; / {n} (FSDP)" if n > 1 else "")))
    if cfg.train.mode == "offline":
        items.append(Item(f"{cfg.train.loss} pass: dataset latents + noise ({pass_rows(cfg)} images, float32)",
                          2 * pass_rows(cfg) * acts.shapes.latent_bytes, "train"))
    elif cfg.train.update_needs.clean_samples:
        items.append(Item("update: x0 + noise of the batch (float32)",
                          2 * cfg.train.batch_size * acts.shapes.latent_bytes, "train",
                          note="finished samples and each one's training noise, kept through the update"))
    return items
