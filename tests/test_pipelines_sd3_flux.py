"""SD3 / FLUX adapters on tiny random-weight pipelines written offline by ``make_tiny``.

Everything goes through the real loading path (``save_pretrained`` -> ``from_pretrained``) and
is checked against the diffusers pipelines' own schedules and denoising loops. What every policy
must do (save / load round trip, shapes, decode range, LoRA targets, export) is checked once for
all registered models in tests/test_policy_contract.py.
"""
import numpy as np
import pytest
import torch

from flowrl.pipelines import build_policy
from flowrl.pipelines.flux import FluxPolicy
from flowrl.pipelines.packing import latent_image_ids, pack_latents, unpack_latents
from flowrl.pipelines.sd3 import SD3Policy
from flowrl.pipelines.tiny import build_clip_tokenizer, build_t5_tokenizer, make_tiny
from flowrl.rollout.group import GroupSampler
from flowrl.types import FlowPolicy
from helpers import PROMPTS, ode_loop

SEQ = 16  # T5 tokens: keeps the tiny models fast
POLICIES = {"sd3": SD3Policy, "flux": FluxPolicy, "flux-schnell": FluxPolicy}


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {kind: make_tiny(kind, root / kind) for kind in POLICIES}


def load(tiny_dirs, kind, **kw):
    return POLICIES[kind].from_pretrained(tiny_dirs[kind], max_sequence_length=SEQ, **kw)


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_group_rollout_shapes_and_reproducibility(tiny_dirs, kind):
    policy = load(tiny_dirs, kind)
    assert isinstance(policy, FlowPolicy)
    assert policy.latent_shape == (16, 8, 8) and (policy.height, policy.width) == (64, 64)
    sampler = GroupSampler(group_size=2, num_steps=3)
    r = sampler(policy, PROMPTS, reward=None, seed=0)
    assert r.x0.shape == (4, 16, 8, 8) and r.images.shape == (4, 3, 64, 64)
    assert torch.isfinite(r.x0).all() and torch.isfinite(r.images).all()
    assert r.images.min() >= 0 and r.images.max() <= 1
    t = r.transitions
    assert t.latents.shape == (12, 16, 8, 8) and t.next_latents.shape == (12, 16, 8, 8)
    assert torch.isfinite(t.old_log_prob).all()
    again = sampler(policy, PROMPTS, reward=None, seed=0)
    assert torch.equal(r.x0, again.x0) and torch.equal(r.transitions.old_log_prob, again.transitions.old_log_prob)
    other = sampler(policy, PROMPTS, reward=None, seed=1)
    assert not torch.allclose(r.x0, other.x0)


def test_sd3_cfg(tiny_dirs):
    p1, p45 = load(tiny_dirs, "sd3", guidance_scale=1.0), load(tiny_dirs, "sd3", guidance_scale=4.5)
    c1, c45 = p1.encode_prompts(PROMPTS), p45.encode_prompts(PROMPTS)
    assert set(c1) == {"prompt_embeds", "pooled_prompt_embeds"}
    assert c45["negative_prompt_embeds"].shape == c45["prompt_embeds"].shape == (2, 77 + SEQ, 64)
    assert c45["negative_pooled_prompt_embeds"].shape == c45["pooled_prompt_embeds"].shape == (2, 64)
    x, s = p1.initial_noise([3, 4]), torch.tensor([0.7, 0.7])
    with torch.no_grad():
        v1, v45 = p1.velocity(x, s, c1), p45.velocity(x, s, c45)
    assert v1.dtype == torch.float32 and v1.shape == x.shape
    assert not torch.allclose(v1, v45)
    with pytest.raises(ValueError, match="guidance_scale"):
        load(tiny_dirs, "sd3", guidance_scale=0.5)


def test_flux_guidance(tiny_dirs):
    dev1, dev35 = load(tiny_dirs, "flux", guidance_scale=1.0), load(tiny_dirs, "flux", guidance_scale=3.5)
    true_cfg = load(tiny_dirs, "flux", true_cfg_scale=2.0, negative_prompt="blurry")
    assert dev35.guidance_embeds and not load(tiny_dirs, "flux-schnell").guidance_embeds
    cond = dev1.encode_prompts(PROMPTS)
    assert cond["prompt_embeds"].shape == (2, SEQ, 32) and cond["pooled_prompt_embeds"].shape == (2, 32)
    x, s = dev1.initial_noise([3, 4]), torch.tensor([0.7, 0.7])
    with torch.no_grad():
        v1, v35 = dev1.velocity(x, s, cond), dev35.velocity(x, s, cond)
        vcfg = true_cfg.velocity(x, s, true_cfg.encode_prompts(PROMPTS))
    assert v1.shape == x.shape and not torch.allclose(v1, v35) and not torch.allclose(v35, vcfg)


@pytest.mark.parametrize("kind", ["flux", "flux-schnell"])
def test_flux_sigmas_equal_pipeline_schedule(tiny_dirs, kind):
    from diffusers.pipelines.flux.pipeline_flux import calculate_shift

    for res in (64, 128, (64, 128)):
        policy = load(tiny_dirs, kind, resolution=res)
        sch, c = policy.pipe.scheduler, policy.pipe.scheduler.config
        mu = calculate_shift(policy.image_seq_len, c.base_image_seq_len, c.max_image_seq_len, c.base_shift,
                             c.max_shift)
        for steps in (1, 3, 28):
            sch.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=mu)  # as FluxPipeline.__call__
            assert torch.equal(policy.sigmas(steps), sch.sigmas), (res, steps)
    assert torch.equal(load(tiny_dirs, kind, shift=3.0, schedule="linear").sigmas(4)[[0, -1]], torch.tensor([1.0, 0.0]))


@pytest.mark.parametrize("kind", ["sd3", "flux", "flux-schnell"])
def test_ode_matches_diffusers_pipeline(tiny_dirs, kind):
    policy = load(tiny_dirs, kind)
    seeds, steps = [5, 6], 2
    ours = ode_loop(policy, PROMPTS, seeds, steps)  # [B, C, h, w]
    noise = policy.initial_noise(seeds)
    kw = dict(num_inference_steps=steps, output_type="latent", max_sequence_length=SEQ, height=64, width=64)
    if kind == "sd3":
        ref = policy.pipe(PROMPTS, latents=noise, guidance_scale=policy.guidance_scale, **kw).images
    else:
        from diffusers import FluxPipeline

        ref = policy.pipe(PROMPTS, latents=pack_latents(noise), guidance_scale=policy.guidance_scale, **kw).images
        ref = FluxPipeline._unpack_latents(ref, 64, 64, policy.vae_scale_factor)
    assert ref.shape == ours.shape
    torch.testing.assert_close(ours, ref.float(), atol=2e-5, rtol=1e-5)


def test_flux_packing_equals_pipeline():
    from diffusers import FluxPipeline

    x = torch.randn(2, 16, 8, 12)  # [B, C, h, w]
    packed = pack_latents(x)
    assert torch.equal(packed, FluxPipeline._pack_latents(x, 2, 16, 8, 12))
    assert torch.equal(unpack_latents(packed, 8, 12), x)
    assert torch.equal(latent_image_ids(8, 12), FluxPipeline._prepare_latent_image_ids(2, 4, 6, "cpu", torch.float32))


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_missing_path_says_how_to_fix(kind, tmp_path):
    with pytest.raises(FileNotFoundError, match="flowrl make-tiny"):
        POLICIES[kind].from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="flowrl make-tiny"):
        build_policy(kind, str(tmp_path / "nope"))


def test_tiny_tokenizers_and_make_tiny_guards(tmp_path):
    clip = build_clip_tokenizer()
    ids = clip("a photo of a cat").input_ids
    assert ids[1:-1] == [320, 1125, 539, 320, 2368]  # the real CLIP ids of these words
    assert ids[0] == clip.bos_token_id and ids[-1] == clip.eos_token_id == clip.pad_token_id
    t5 = build_t5_tokenizer()
    assert t5.convert_ids_to_tokens(t5("A photo").input_ids) == ["▁A", "▁photo", "</s>"]
    assert t5.pad_token_id == 0 and t5.eos_token_id == 1
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep")
    with pytest.raises(FileExistsError):
        make_tiny("sd3", tmp_path / "full")
    with pytest.raises(ValueError, match="sd3"):
        make_tiny("sdxl", tmp_path / "other")


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_recipe_dtypes_and_wrapped_transformer(tiny_dirs, kind):
    """YAML gives dtypes as names (per component too); the policy keeps working when the trainer
    puts a distributed wrapper (DDP / FSDP / DeepSpeed: the model in ``.module``, no ``.dtype``)
    in place of the transformer; LoRA weights train in fp32 on a bf16 base."""
    from flowrl.pipelines.common import resolve_dtype
    from flowrl.trainable import add_lora

    assert resolve_dtype("bf16") is torch.bfloat16 and resolve_dtype(torch.float16) is torch.float16
    assert resolve_dtype({"default": "bfloat16", "vae": "float32"}) == {"default": torch.bfloat16, "vae": torch.float32}
    with pytest.raises(ValueError, match="dtype must be"):
        resolve_dtype("float8")
    policy = load(tiny_dirs, kind, dtype={"default": "bfloat16", "vae": "float32"}, gradient_checkpointing=True)
    assert policy.transformer.dtype == torch.bfloat16 and policy.vae.dtype == torch.float32
    assert policy.transformer.is_gradient_checkpointing
    add_lora(policy.transformer, 4, 8, policy.lora_target_modules)
    trained = [p for p in policy.transformer.parameters() if p.requires_grad]
    assert trained and all(p.dtype == torch.float32 for p in trained)

    class Wrapper(torch.nn.Module):  # what DDP looks like to the policy
        def __init__(self, module):
            super().__init__()
            self.module = module

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

    cond = policy.encode_prompts(PROMPTS)
    x, s = policy.initial_noise([1, 2]), torch.tensor([0.8, 0.3])
    with torch.no_grad():
        direct = policy.velocity(x, s, cond)
        policy.transformer = Wrapper(policy.transformer)
        wrapped = policy.velocity(x, s, cond)
    assert direct.dtype == torch.float32 and torch.equal(direct, wrapped)


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_decode_runs_in_chunks_of_decode_batch(tiny_dirs, kind):
    """`model.options.decode_batch` images per VAE call (the rollout's decode no longer grows with the
    batch): the same images as one call, call count as chunked; bad values fail clearly."""
    pol = load(tiny_dirs, kind)
    assert pol.decode_batch == 8
    latents = torch.randn(5, *pol.latent_shape, generator=torch.Generator().manual_seed(0))  # [5, C, h, w]
    calls = []
    orig = pol.vae.decode
    pol.vae.decode = lambda z, **kw: (calls.append(len(z)), orig(z, **kw))[1]
    try:
        pol.decode_batch = None
        whole = pol.decode(latents)  # [5, 3, H, W]
        pol.decode_batch = 2
        calls.clear()
        chunked = pol.decode(latents)
    finally:
        pol.vae.decode = orig
    assert calls == [2, 2, 1] and chunked.shape == whole.shape
    assert torch.allclose(chunked, whole, atol=1e-5)
    with pytest.raises(ValueError, match="decode_batch must be an integer >= 1 or null"):
        POLICIES[kind].from_pretrained(tiny_dirs[kind], decode_batch=0)
