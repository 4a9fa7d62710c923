"""Helpers of the adapter-versus-diffusers-pipeline tests (tests/test_qwen_image.py, test_flux_kontext.py,
test_wan.py): a LoRA written by ``flowrl export``'s writer and loaded back by the pipeline."""
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
        pipe.load_lora_weights(out, weight_name=weight,
                               **({} if component == "transformer" else {f"load_into_{component}": True}))
    return pipe
