"""Helpers of the adapter-versus-diffusers-pipeline tests (tests/test_qwen_image.py, test_flux_kontext.py,
test_wan.py, test_flux2.py, test_z_image.py): a LoRA written by ``flowrl export``'s writer and loaded back by
the pipeline, and a trained run's export checked against the trained policy."""
from pathlib import Path

import torch

from flowrl.export import write_lora
from flowrl.pipelines.base import diffusers_attr
from flowrl.trainable import add_lora, trainable_state

RANK, ALPHA = 2, 8  # scaling 4: lost if the export dropped alpha (diffusers' default alpha = r)


def exported_lora(policy, name: str, base: str, out: Path, scale: float = 0.3):
    """Give ``policy.transformer`` a LoRA (the policy's default targets, B random so it moves the
    model), write it with ``flowrl.export.write_lora`` to ``out`` and load it into a fresh copy of
    the declared diffusers pipeline with ``load_lora_weights`` (each file the export wrote into its
    component); returns that pipeline."""
    add_lora(policy.transformer, RANK, ALPHA, policy.lora_target_modules)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in policy.transformer.named_parameters():
            if ".lora_B." in n:
                p.copy_(scale * torch.randn(p.shape, generator=g))
    policy.transformer.eval()
    info = write_lora(name, trainable_state(policy.transformer), out, base, RANK, ALPHA)
    pipe = diffusers_attr(type(policy).pipeline_class).from_pretrained(base)
    pipe.set_progress_bar_config(disable=True)
    for component, weight in info["files"].items():  # one file per trained transformer (Wan2.2: two experts)
        type(policy).load_exported_lora(pipe, out, weight, component)
    return pipe


def assert_export_is_the_trained_policy(run, out: Path, base: str, policy, cfg, trained_state: dict) -> None:
    """``flowrl export`` of a training ``run`` loads into the declared diffusers pipeline with
    ``load_lora_weights`` and is the trained policy: ``policy`` (a fresh load of ``base``) given the run's
    LoRA state ``trained_state`` has the velocity of the loaded pipeline's transformer (``rtol 1e-5, atol 1e-6``)."""
    from flowrl.export import export_run
    from flowrl.trainable import load_trainable_state

    export_run(run, out)
    add_lora(policy.transformer, cfg.train.lora_rank, cfg.train.lora_alpha, policy.lora_target_modules)
    load_trainable_state(policy.transformer, trained_state)
    pipe = diffusers_attr(type(policy).pipeline_class).from_pretrained(base)
    type(policy).load_exported_lora(pipe, out)
    x, cond = policy.initial_noise([5, 6]), policy.encode_prompts(["a photo of a cat", "a red apple on a table"])
    with torch.no_grad():
        v_trained = policy.velocity(x, 0.7, cond)
        policy.transformer = pipe.transformer
        v_loaded = policy.velocity(x, 0.7, cond)
    torch.testing.assert_close(v_loaded, v_trained, rtol=1e-5, atol=1e-6)
