"""One model is one adapter file: an adapter class declared here (an AuraFlow-style transformer with a BERT text
encoder, neither shipped) and one registry line make `flowrl plan` and `flowrl bench precision --pipeline
toy-arch` work, with no other change; the shipped adapters declare what the planner and the benchmark read."""
from __future__ import annotations

import pytest
import torch

from flowrl.pipelines import policy_class
from flowrl.pipelines.base import DiffusersPolicy
from flowrl.pipelines.facts import Component, Geometry, ModelConfigs, build_component

TOY = dict(sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=2, num_single_dit_layers=3,
           attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16,
           out_channels=4, pos_embed_max_size=64)
BERT = dict(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37)
VAE = dict(block_out_channels=[8, 8], latent_channels=4, norm_num_groups=4,
           down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2)


class ToyPolicy(DiffusersPolicy):
    """What a new model's adapter file declares (pipelines/facts.py): here the facts only."""

    kind = "toy"
    pipeline_class = "AuraFlowPipeline"
    transformer_class = "AuraFlowTransformer2DModel"
    lora_target_modules = ("to_q", "to_k", "to_v", "to_out.0")
    cond_keys = ("prompt_embeds",)
    published = {"someone/toy-model": ModelConfigs(
        TOY, {"text_encoder": Component("transformers:BertModel", BERT)}, Component("diffusers:AutoencoderKL", VAE),
        "someone/toy-model", "Toy PixArt", "toy-arch")}

    @classmethod
    def text_tokens(cls, options: dict) -> int:
        return int(options.get("max_sequence_length", 12))

    @classmethod
    def example_conditioning(cls, configs, geometry, rows, device, dtype) -> dict:
        return {"prompt_embeds": torch.empty(rows, geometry.text_tokens, configs.transformer["joint_attention_dim"],
                                             device=device, dtype=dtype)}

    @classmethod
    def transformer_inputs(cls, config, dtype, x, sigma, cond, **settings) -> dict:
        return dict(hidden_states=x.to(dtype), encoder_hidden_states=cond["prompt_embeds"].to(x.device, dtype),
                    timestep=sigma, return_dict=False)

    @classmethod
    def block_counts(cls, transformer: dict) -> dict:
        return {"joint": transformer["num_mmdit_layers"], "single": transformer["num_single_dit_layers"]}

    @classmethod
    def with_block_counts(cls, transformer: dict, counts: dict) -> dict:
        return {**transformer, "num_mmdit_layers": counts["joint"], "num_single_dit_layers": counts["single"]}

    @classmethod
    def shrink_config(cls, transformer: dict) -> dict:
        return {**transformer, "num_mmdit_layers": 1, "num_single_dit_layers": 1}


@pytest.fixture
def toy_registered(monkeypatch):
    """The one registry line a new model adds."""
    from flowrl import pipelines

    monkeypatch.setitem(pipelines.REGISTRY, "toy", ToyPolicy.from_pretrained)
    return ToyPolicy


def test_a_new_adapter_alone_is_planned(toy_registered, tmp_path, one_thread):
    from flowrl.plan.core import GiB, plan_memory
    from flowrl.plan.report import format_plan
    from flowrl.trainers.config import load_config

    recipe = tmp_path / "toy.yaml"
    recipe.write_text("""
model: {pipeline: toy, path: someone/toy-model, guidance_scale: 4.5, options: {resolution: 64}}
sampler: {name: group, group_size: 4, num_steps: 4}
reward: {weights: {jpeg_compressibility: 1.0}}
train: {batch_size: 8, minibatch_size: 4, lora_rank: 4, lora_alpha: 4, loss_options: {beta_kl: 0.01}}
""")
    assert policy_class("toy") is ToyPolicy
    plan = plan_memory(load_config(str(recipe)), 1, 80 * GiB, str(recipe))
    real = build_component(Component("diffusers:AuraFlowTransformer2DModel", TOY), "meta", torch.float32)
    assert plan.transformer_params == sum(p.numel() for p in real.parameters())
    items = {i.name: i for i in plan.items}
    bert = build_component(Component("transformers:BertModel", BERT), "meta", torch.float32)
    assert items["text encoders"].bytes == 4 * sum(p.numel() for p in bert.parameters()) + sum(
        b.numel() * b.element_size() for b in bert.buffers())
    assert plan.settings["resolution"] == [64, 64] and plan.settings["text_tokens"] == 12
    assert items["rollout: denoiser forward (16 rows, no grad)"].bytes > 0  # CFG doubles the 8 rows
    assert items["activations, without gradient checkpointing (4 rows)"].bytes > 0
    assert items["rollout: VAE decode (8 images per call)"].bytes > 0
    assert plan.peak_bytes == plan.resident_bytes + max(plan.rollout_bytes, plan.train_bytes, plan.step_bytes)
    assert "model someone/toy-model" in format_plan(plan)


def test_a_new_adapter_alone_is_arch_benchmarked(toy_registered, tmp_path, one_thread):
    from flowrl.bench.precision_arch import bench_arch

    out = bench_arch("toy-arch", ["full"], tmp_path / "t.json", resolutions=(32,), batch=1, steps=1, repeats=1,
                     device="cpu", tiny=True, verbose=False)
    assert out["arch"]["title"] == "Toy PixArt" and out["arch"]["family"] == "toy"
    assert out["arch"]["config"]["num_single_dit_layers"] == 1 and out["arch"]["parameters"] > 0
    assert out["backends"]["full"]["resolutions"]["32"]["images_per_second"] > 0


@pytest.mark.parametrize("name", ["sd3", "flux", "sana", "digits", "qwen-image", "flux-kontext", "wan",
                                  "qwen-image-edit", "flux2", "flux2-klein", "z-image", "wan2.2"])
def test_shipped_adapters_declare_their_facts(name):
    """Each shipped adapter answers every fact the planner and the benchmark read, consistently with the
    conditioning and geometry it declares (the published models at their default sizes, on the meta device)."""
    cls = policy_class(name)
    path = next(iter(cls.published), None) if cls.published else None
    configs = cls.model_configs(path)
    g = cls.geometry(configs, {})
    assert isinstance(g, Geometry) and g.latent_bytes > 0 and g.text_tokens > 0
    cond = cls.example_conditioning(configs, g, 2, "meta", torch.bfloat16)
    # an editing batch's source latents (Qwen-Image-Edit: their tokens and each source's grid)
    extra = {"flux-kontext": ("image_latents",), "qwen-image-edit": ("source_latents", "source_shapes")}.get(name, ())
    assert tuple(cond) == cls.cond_keys + extra and all(t.shape[0] == 2 for t in cond.values())
    if name == "qwen-image-edit":  # the 2511 transformer (zero_cond_t) runs the same conditioning
        configs = cls.model_configs("Qwen/Qwen-Image-Edit-2511")
        assert configs.transformer["zero_cond_t"] and configs.arch == "qwen-image-edit-2511-arch"
    counts = cls.block_counts(configs.transformer)
    assert cls.block_counts(cls.with_block_counts(configs.transformer, counts)) == counts
    tr = build_component(cls.transformer_component(configs.transformer, {}), "meta", torch.bfloat16)
    x = torch.empty(2, *g.latent_shape, device="meta", dtype=torch.bfloat16)
    kw = cls.transformer_inputs(configs.transformer, torch.bfloat16, x, torch.empty(2, device="meta"), cond)
    with torch.no_grad():
        out = tr(**kw)
    assert cls.transformer_output(out[0], x).shape == x.shape  # a velocity shaped like the latents
    # context parallelism splits the inputs the model's _cp_plan names only in the form it expects (a tensor
    # of another rank passes whole: FLUX.2's RoPE ids [L, 4] would then not follow their [B, L, 4] tokens);
    # a per-sample timestep [B] under a plan for per-token [B, S] ones (Wan2.2 TI2V) passes whole on purpose
    planned = (getattr(type(tr), "_cp_plan", None) or {}).get("", {})
    for arg, spec in planned.items():
        if arg != "timestep" and isinstance(kw.get(arg), torch.Tensor) and spec.expected_dims is not None:
            assert kw[arg].dim() == spec.expected_dims, (name, arg, tuple(kw[arg].shape))


@pytest.mark.parametrize("name,published", [("sd3", 2), ("flux", 1), ("sana", 1), ("qwen-image", 1),
                                            ("flux-kontext", 1), ("wan", 2), ("qwen-image-edit", 2), ("flux2", 1),
                                            ("flux2-klein", 4), ("z-image", 2), ("wan2.2", 2)])
def test_published_models_name_their_sources(name, published):
    cls = policy_class(name)
    assert len(cls.published) == published
    for hub_id, m in cls.published.items():
        assert m.source == hub_id and m.title and m.arch.endswith("-arch") and m.vae is not None
        assert all(c.cls.startswith("transformers:") for c in m.text_encoders.values())


def test_an_unknown_hub_id_names_the_published_ones():
    from flowrl.pipelines.sd3 import SD3Policy

    with pytest.raises(ValueError, match="stable-diffusion-3.5-medium"):
        SD3Policy.model_configs("someone/some-model")


def test_a_subclass_inheriting_published_models_adds_no_architecture_names(monkeypatch):
    """An adapter over a published model's subclass (e.g. an editing variant of FLUX) does not take over
    the parent's NAME-arch entry; it declares its own published models for that."""
    from flowrl import pipelines
    from flowrl.bench.precision_arch_models import arch_models
    from flowrl.pipelines.flux import FluxPolicy

    class ZzVariant(FluxPolicy):
        kind = "zz-variant"

    monkeypatch.setitem(pipelines.REGISTRY, "zz-variant", ZzVariant.from_pretrained)  # sorts after "flux"
    assert arch_models()["flux-arch"][0] is FluxPolicy


def test_video_and_editing_geometry():
    """Wan's geometry counts video frames ((F - 1) / 4 + 1 latent frames); Kontext's transformer call
    appends the source's tokens (twice the image sequence) and keeps the generated ones in its output;
    Qwen-Image's VAE decodes a one-frame video."""
    wan = policy_class("wan")
    configs = wan.model_configs("Wan-AI/Wan2.1-T2V-14B-Diffusers")
    g = wan.geometry(configs, {"resolution": [240, 416], "num_frames": 33})
    assert g.latent_shape == (16, 9, 30, 52) and g.frames == 33 and g.image_bytes == 3 * 33 * 240 * 416 * 4
    assert wan.geometry(configs, {}).latent_shape == (16, 21, 60, 104)  # the pipeline's 81 frames of 480 x 832
    with pytest.raises(ValueError, match="4 k \\+ 1"):
        wan.geometry(configs, {"num_frames": 32})
    kontext = policy_class("flux-kontext")
    configs = kontext.model_configs("black-forest-labs/FLUX.1-Kontext-dev")
    g = kontext.geometry(configs, {"resolution": 512})
    cond = kontext.example_conditioning(configs, g, 2, "meta", torch.bfloat16)
    x = torch.empty(2, *g.latent_shape, device="meta", dtype=torch.bfloat16)  # [2, 16, 64, 64]
    kw = kontext.transformer_inputs(configs.transformer, torch.bfloat16, x, torch.empty(2, device="meta"), cond)
    assert kw["hidden_states"].shape == (2, 2 * 32 * 32, 64) and kw["img_ids"].shape == (2 * 32 * 32, 3)
    out = torch.empty(2, 2 * 32 * 32, 64, device="meta")
    assert kontext.transformer_output(out, x).shape == x.shape
    qwen = policy_class("qwen-image")
    assert qwen.vae_latents(torch.empty(2, 16, 8, 8)).shape == (2, 16, 1, 8, 8)
    edit = policy_class("qwen-image-edit")  # one source at the result's size appended, then dropped from the output
    configs = edit.model_configs("Qwen/Qwen-Image-Edit-2509")
    g = edit.geometry(configs, {"resolution": 512})
    cond = edit.example_conditioning(configs, g, 2, "meta", torch.bfloat16)
    kw = edit.transformer_inputs(configs.transformer, torch.bfloat16, x, torch.empty(2, device="meta"), cond)
    assert kw["hidden_states"].shape == (2, 2 * 32 * 32, 64) and kw["img_shapes"] == [[(1, 32, 32), (1, 32, 32)]] * 2
    assert edit.transformer_output(out, x).shape == x.shape
    assert policy_class("sd3").vae_latents(x) is x


def test_build_component_in_bf16_keeps_no_float32_storage():
    """SD3's position table is made in float32 as a view (`table.float().unsqueeze(0)`); cast to bf16 it must
    not keep its float32 base alive (864 MiB at SD3.5-Medium size, seen on a GPU as a -13% plan error)."""
    cfg = dict(sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=1, attention_head_dim=8,
               num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=32,
               pos_embed_max_size=96, qk_norm="rms_norm")
    tr = build_component(Component("diffusers:SD3Transformer2DModel", cfg), "cpu", torch.bfloat16)
    tensors = list(tr.parameters()) + list(tr.buffers())
    assert {t.dtype for t in tensors} == {torch.bfloat16}
    assert all(t._base is None or t._base.dtype == torch.bfloat16 for t in tensors)
    table = tr.pos_embed.pos_embed  # [1, 96 * 96, 16]
    assert table.untyped_storage().nbytes() == table.numel() * 2
    assert all(not p.requires_grad for p in tr.parameters())
