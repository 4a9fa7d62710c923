"""The frozen models an update declares (``Needs.frozen_models``: on-policy distillation's teachers) in the plan.

Each is a whole second pipeline (flowrl/trainers/frozen.py builds it with ``flowrl.pipelines``): its transformer
(resident on the GPU, or in host memory with the teacher's ``offload``, then moved in for its forward: a transient
of its size), its text encoders and VAE (resident unless ``train.offload`` keeps them on the host), all built on
the meta device from the source's configs like the trained model's. While the update trains, it keeps each
teacher's step means at every stored transition (one latent per transition and teacher, float32), and the
teachers' no-grad forward over ``train.minibatch_size`` transitions runs before the training passes (a transient).
"""
from __future__ import annotations

from types import SimpleNamespace

from ..pipelines.facts import build_component
from .budget import Item, _dtype_name
from .models import component_dtype, model_configs, module_bytes


def frozen_items(cfg, acts) -> list[Item]:
    """Plan rows of every frozen model the update declares (module doc); none when it declares none."""
    from ..trainers.frozen import frozen_model_config

    out: list[Item] = []
    needs = cfg.train.update_needs
    if not needs.frozen_models:  # (no sampler built for a plan that has none)
        return out
    sampler = cfg.sampler.build().trained_sampler
    steps = len(sampler.trained_steps()) if hasattr(sampler, "trained_steps") else 0
    for k, (source, guidance, offload) in enumerate(needs.frozen_models):
        model = frozen_model_config(cfg, source, guidance).model
        adapter, configs = model_configs(SimpleNamespace(model=model))
        opt = model.options.get("dtype")
        dt = component_dtype(opt, "transformer")
        tr = build_component(adapter.transformer_component(configs.transformer, model.options), "meta", dt)
        label = f"frozen model {k} ({source or 'the base model'}, guidance {model.guidance_scale:g})"
        size = module_bytes(tr)
        out.append(Item(f"{label}: transformer ({_dtype_name(dt)})", size, "resident", "host" if offload else "gpu",
                        f"train.loss={cfg.train.loss}'s teacher" + ("; offload: moved in for each forward"
                                                                    if offload else "")))
        if offload:
            out.append(Item(f"{label}: transformer on the GPU for its forward", size, "transient"))
        te = sum(module_bytes(build_component(c, "meta", component_dtype(opt, n)))
                 for n, c in configs.text_encoders.items())
        out.append(Item(f"{label}: text encoders", te, "resident", "host" if cfg.train.offload.get("text_encoders")
                        else "gpu", ", ".join(configs.text_encoders) or "none"))
        if configs.vae is not None:
            out.append(Item(f"{label}: VAE", module_bytes(build_component(configs.vae, "meta",
                                                                             component_dtype(opt, "vae"))),
                            "resident", "host" if cfg.train.offload.get("vae") else "gpu"))
        out.append(Item(f"{label}: step means at the stored transitions ({cfg.train.batch_size} x {steps} steps, "
                        f"float32)", cfg.train.batch_size * steps * acts.shapes.latent_bytes, "train",
                        note="computed before the update's first step, kept through it"))
        k_rows = adapter.cfg_rows(model.guidance_scale, model.options)
        out.append(Item(f"{label}: forward ({cfg.train.minibatch_size * k_rows} rows, no grad)",
                        acts.bytes("infer", cfg.train.minibatch_size * k_rows), "transient",
                        note="before the training passes" + (" x 2 (CFG)" if k_rows == 2 else "")))
    return out
