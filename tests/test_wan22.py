"""Wan2.2 in the Wan adapter (``model.pipeline: wan2.2``) against diffusers' own ``WanPipeline`` on the tiny
offline models (``flowrl make-tiny wan2.2`` / ``wan2.2-ti2v``).

T2V-A14B's two experts: flowrl's deterministic ODE loop equals the pipeline's loop with ``transformer_2``,
``boundary_ratio`` and ``guidance_scale_2`` (latents and decoded videos); a batch that mixes steps of both
experts runs each row on the expert the pipeline would use; an exported LoRA (one file per expert) loads with
``load_lora_weights`` (``load_into_transformer_2=True`` for the second), moves the pipeline's output and
equals flowrl's loop. TI2V-5B: the loop equals the pipeline's with its 48-channel VAE and per-token
timesteps. The recipe trains both experts, resumes exactly and exports; ``train_experts`` picks the trained
ones. Shapes, save / load and LoRA targets are in the contract battery (tests/test_policy_contract.py), every
sampler x update in tests/test_model_matrix.py, plan and the architecture benchmark below."""
import shutil

import pytest
import torch

from flowrl.pipelines.experts import TwoExperts
from flowrl.pipelines.wan import WanPolicy
from flowrl.pipelines.wan22 import Wan22Policy
from flowrl.rollout.ode import ode_sample
from helpers import ROOT, fixed_velocity
from model_parity import exported_lora

PROMPTS = ["a cat walking on grass", "a red car"]
SEEDS, SEQ, SIZE = [5, 6], 8, 32
STEPS = 4  # timesteps 1000, 858, 602 | 9: three steps on transformer, the last on transformer_2 (boundary 500)
G, G2 = 4.0, 3.0

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model("wan2.2")  # conftest: one build per session, 32 px, 5 frames


@pytest.fixture(scope="module")
def tiny_ti2v(tmp_path_factory):
    return Wan22Policy.make_tiny("wan2.2-ti2v", tmp_path_factory.mktemp("ti2v") / "m", image_size=SIZE)


def _policy(path, **kw):
    return Wan22Policy.from_pretrained(path, max_sequence_length=SEQ, guidance_scale=G, **kw)


def _pipeline(pipe, policy, output_type, **kw):
    """The pipeline's own loop from flowrl's initial noise."""
    return pipe(PROMPTS, negative_prompt="", guidance_scale=G, latents=policy.initial_noise(SEEDS),
                num_inference_steps=STEPS, height=SIZE, width=SIZE, num_frames=policy.num_frames,
                max_sequence_length=SEQ, output_type=output_type, **kw).frames


def test_ode_matches_the_two_expert_pipeline(tiny, tmp_path):
    policy = _policy(tiny, guidance_scale_2=G2)
    assert isinstance(policy.transformer, TwoExperts) and policy.latent_shape == (16, 2, 4, 4)
    t = policy.sigmas(STEPS)[:-1] * 1000
    assert policy.boundary_timestep == 500 and (t >= 500).sum() == 3 and (t < 500).sum() == 1  # both experts run
    ours, videos = ode_sample(policy, PROMPTS, SEEDS, STEPS)  # [B, 16, 2, 4, 4], [B, 3, 5, 32, 32]
    pipe = policy.pipe
    ref = _pipeline(pipe, policy, "latent", guidance_scale_2=G2).float()
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-5)
    ref_videos = _pipeline(pipe, policy, "pt", guidance_scale_2=G2).float().permute(0, 2, 1, 3, 4)  # frame-major
    torch.testing.assert_close(videos, ref_videos, atol=2e-5, rtol=1e-5)
    assert (_pipeline(pipe, policy, "latent").float() - ref).abs().max() > 1e-4  # guidance_scale_2 is used (last step)

    # a LoRA on both experts through flowrl export's writer: one file per expert, loaded into both
    lora_pipe = exported_lora(policy, "wan2.2", str(tiny), tmp_path / "lora")
    assert sorted(p.name for p in (tmp_path / "lora").glob("*.safetensors")) == [
        "pytorch_lora_weights.safetensors", "pytorch_lora_weights_transformer_2.safetensors"]
    ours_lora, _ = ode_sample(policy, PROMPTS, SEEDS, STEPS)
    ref_lora = _pipeline(lora_pipe, policy, "latent", guidance_scale_2=G2).float()
    torch.testing.assert_close(ours_lora, ref_lora, atol=2e-5, rtol=1e-5)
    assert (ref_lora - ref).abs().max() > 1e-2
    lora_pipe.transformer_2.disable_adapters()  # the low-noise expert's LoRA matters too
    assert (_pipeline(lora_pipe, policy, "latent", guidance_scale_2=G2).float() - ref_lora).abs().max() > 1e-4


def test_ti2v_matches_the_pipeline(tiny_ti2v):
    """TI2V-5B's single expert: 48 latent channels on the Wan2.2 VAE (16x spatial), per-token timesteps."""
    policy = _policy(tiny_ti2v)
    assert not isinstance(policy.transformer, TwoExperts) and policy.expand_timesteps
    assert policy.latent_shape == (48, 2, 2, 2) and policy.vae_scale_factor == 16
    kw = Wan22Policy.transformer_inputs(policy.transformer.config, torch.float32, policy.initial_noise(SEEDS),
                                        torch.tensor([0.5, 0.25]), policy.encode_prompts(PROMPTS),
                                        **policy.forward_settings())
    assert kw["timestep"].shape == (2, 2 * 1 * 1) and kw["timestep"][1].eq(250).all()  # [B, F' h/2 w/2]
    ours, videos = ode_sample(policy, PROMPTS, SEEDS, STEPS)
    torch.testing.assert_close(ours, _pipeline(policy.pipe, policy, "latent").float(), atol=2e-5, rtol=1e-5)
    ref_videos = _pipeline(policy.pipe, policy, "pt").float().permute(0, 2, 1, 3, 4)
    assert videos.shape == (2, 3, 5, SIZE, SIZE)
    torch.testing.assert_close(videos, ref_videos, atol=2e-5, rtol=1e-5)


def test_each_row_runs_on_the_pipelines_expert(tiny):
    """A batch mixing steps of both experts (as a training minibatch does): every row equals its expert's own
    forward, at guidance_scale on the high-noise rows and guidance_scale_2 on the others; the gradient of a
    row reaches its expert only."""
    policy = _policy(tiny, guidance_scale_2=G2)
    experts = policy.transformer
    sigma = torch.tensor([0.9, 0.45, 0.5, 0.4999])  # 0.5 -> timestep 500 = the tiny's boundary: high noise
    x = policy.initial_noise([1, 2, 3, 4])
    cond = policy.encode_prompts(PROMPTS * 2)
    with torch.no_grad():
        mixed = policy.velocity(x, sigma, cond)
        for i, (expert, scale) in enumerate([(experts.transformer, G), (experts.transformer_2, G2),
                                             (experts.transformer, G), (experts.transformer_2, G2)]):
            policy.transformer, policy.guidance_scale, policy.guidance_scale_2 = expert, scale, scale
            row = policy.velocity(x[i:i + 1], sigma[i:i + 1], {k: v[i:i + 1] for k, v in cond.items()})
            torch.testing.assert_close(mixed[i:i + 1], row, atol=1e-5, rtol=1e-5)
    policy.transformer, policy.guidance_scale, policy.guidance_scale_2 = experts, G, G2
    experts.requires_grad_(True)
    policy.velocity(x[1:2], sigma[1:2], {k: v[1:2] for k, v in cond.items()}).square().mean().backward()
    assert all(p.grad is None for p in experts.transformer.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in experts.transformer_2.parameters())


def test_train_experts_and_errors(tiny, tiny_ti2v, tmp_path):
    from diffusers import WanTransformer3DModel

    from flowrl.export import export_full
    from flowrl.trainable import set_up_trainable, trainable_state
    from flowrl.trainers.config import load_config

    policy = _policy(tiny, train_experts=["high"])
    set_up_trainable(policy.transformer, 2, 4.0, None, policy.lora_target_modules, seed=0)
    trained = {n.split(".")[0] for n, p in policy.transformer.named_parameters() if p.requires_grad}
    assert trained == {"transformer"} and all("lora_" in n for n, p in policy.transformer.named_parameters()
                                              if p.requires_grad)
    full = _policy(tiny, train_experts=["low"])
    set_up_trainable(full.transformer, 0)  # full fine-tune of the low-noise expert only
    assert {n.split(".")[0] for n, p in full.transformer.named_parameters() if p.requires_grad} == {"transformer_2"}
    with torch.no_grad():
        full.transformer.transformer_2.proj_out.bias.add_(1.0)
    cfg = load_config(ROOT / "recipes" / "wan22_group_pickscore.yaml",
                      [f"model.path={tiny}", "train.lora_rank=0", "train.lora_targets=null"])
    info = export_full(cfg, trainable_state(full.transformer), tmp_path / "full", str(tiny))  # OUT/transformer_2
    assert info["dirs"] == ["transformer_2"] and "transformer_2=" in info["load"]
    exported = WanTransformer3DModel.from_pretrained(tmp_path / "full", subfolder="transformer_2")
    assert torch.equal(exported.proj_out.bias, full.transformer.transformer_2.proj_out.bias)
    with pytest.raises(ValueError, match="train_experts must be a list, each item one of 'high', 'low'"):
        _policy(tiny, train_experts=["mid"])
    with pytest.raises(ValueError, match="guidance_scale_2=3.0 needs model.guidance_scale > 1"):
        Wan22Policy.from_pretrained(tiny, max_sequence_length=SEQ, guidance_scale=1.0, guidance_scale_2=3.0)
    with pytest.raises(ValueError, match="need Wan2.2's two experts"):
        _policy(tiny_ti2v, train_experts=["high"])
    with pytest.raises(ValueError, match="Wan2.2 pipeline: load it with model.pipeline: wan2.2"):
        WanPolicy.from_pretrained(tiny, max_sequence_length=SEQ)
    with pytest.raises(ValueError, match="Wan2.2 pipeline: load it with model.pipeline: wan2.2"):
        WanPolicy.model_configs(str(tiny))
    _policy(tiny).save_pretrained(tmp_path / "saved")  # both experts travel with the saved pipeline
    back = _policy(tmp_path / "saved")
    assert isinstance(back.transformer, TwoExperts) and back.num_frames == 5
    with pytest.raises(ValueError, match="differ in architecture"):
        TwoExperts(back.transformer.transformer, _policy(tiny_ti2v).transformer, 0.875)


def test_recipe_trains_both_experts_resumes_and_exports(tiny, tmp_path):
    """recipes/wan22_group_pickscore.yaml on the tiny model, its SDE window widened to every step: two GRPO
    iterations change the LoRA of both experts (EMA too); a run resumed from its first checkpoint ends on the
    same weights; the export loads into both experts and gives the trained policy's velocity."""
    import json

    from flowrl.checkpoints.common import list_checkpoints
    from flowrl.export import export_run
    from flowrl.pipelines.base import diffusers_attr
    from flowrl.trainable import load_trainable_state, set_up_trainable
    from flowrl.trainers.config import load_config
    from flowrl.trainers.online import train
    from helpers import lora_weights, tiny_overrides

    cfg = load_config(ROOT / "recipes" / "wan22_group_pickscore.yaml", tiny_overrides(tiny, "group", **{
        "sampler.sde_window": "null", "train.sharding": "none", "reward.frame_stride": 2}))
    assert cfg.model.pipeline == "wan2.2" and cfg.model.options["train_experts"] == ["high", "low"]
    run = tmp_path / "run"
    assert train(cfg, run)["iterations_done"] == 2
    ck = list_checkpoints(run / "checkpoints")
    first, last = lora_weights(ck[0]), lora_weights(ck[-1])
    for expert in ("transformer.", "transformer_2."):
        assert any(k.startswith(expert) and ".lora_B." in k and v.abs().sum() > 0 for k, v in last.items())
        assert any(k.startswith(expert) and not torch.equal(first[k], last[k]) for k in first)
    assert (ck[-1] / "ema.safetensors").is_file()

    resumed = tmp_path / "resumed"
    shutil.copytree(run, resumed)
    shutil.rmtree(resumed / "checkpoints" / ck[-1].name)
    assert train(cfg, resumed, resume=True)["iterations_done"] == 2
    again = lora_weights(list_checkpoints(resumed / "checkpoints")[-1])
    assert again.keys() == last.keys() and all(torch.equal(again[k], last[k]) for k in last)

    info = export_run(run, tmp_path / "export")
    assert info["files"] == {"transformer": "pytorch_lora_weights.safetensors",
                             "transformer_2": "pytorch_lora_weights_transformer_2.safetensors"}
    assert "load_into_transformer_2=True" in info["load"]
    assert json.loads((tmp_path / "export" / "flowrl_export.json").read_text())["files"] == info["files"]
    pipe = diffusers_attr("WanPipeline").from_pretrained(str(tiny))
    pipe.load_lora_weights(tmp_path / "export")
    pipe.load_lora_weights(tmp_path / "export", weight_name=info["files"]["transformer_2"], load_into_transformer_2=True)
    policy = _policy(tiny, guidance_scale_2=G2)
    trained = _policy(tiny, guidance_scale_2=G2).transformer
    set_up_trainable(trained, cfg.train.lora_rank, cfg.train.lora_alpha, cfg.train.lora_targets)
    load_trainable_state(trained, last)
    loaded = Wan22Policy(pipe, max_sequence_length=SEQ, guidance_scale=G, guidance_scale_2=G2).transformer
    torch.testing.assert_close(fixed_velocity(policy, loaded.eval()), fixed_velocity(policy, trained.eval()),
                               rtol=1e-5, atol=1e-6)  # sigmas 0.9 / 0.45: one row per expert


def test_published_models_plan_and_build_with_two_experts():
    """The published Wan2.2 configs on the meta device: T2V-A14B is two 14.29B experts (28.58B), its LoRA on both
    or on the one train_experts names; TI2V-5B one 5.0B transformer on latents (48, (F - 1) / 4 + 1, H / 16, W / 16)."""
    from flowrl.bench.precision_arch_models import arch_model, build_transformer
    from flowrl.plan.budget import model_items
    from flowrl.plan.models import meta_components, num_params
    from flowrl.trainers.config import load_config

    a14b, model = arch_model("wan2.2-a14b-arch")
    assert a14b is Wan22Policy and model.source == "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
    tr = build_transformer(a14b, model.transformer, torch.device("meta"), torch.bfloat16)
    assert isinstance(tr, TwoExperts) and tr.boundary == 875.0 and 28.5e9 < num_params(tr) < 28.6e9
    ti2v, model = arch_model("wan2.2-5b-arch")
    tr = build_transformer(ti2v, model.transformer, torch.device("meta"), torch.bfloat16)
    assert not isinstance(tr, TwoExperts) and 4.9e9 < num_params(tr) < 5.1e9
    g = ti2v.geometry(model, {"num_frames": 121, "resolution": [704, 1280]})  # TI2V-5B's 720p video
    assert g.latent_shape == (48, 31, 44, 80) and g.frames == 121

    recipe = ROOT / "recipes" / "wan22_group_pickscore.yaml"
    both = meta_components(load_config(recipe), with_text_encoders=False)
    high = meta_components(load_config(recipe, ["model.options.train_experts=[high]"]), with_text_encoders=False)
    n_both, n_high = num_params(both.transformer, trainable=True), num_params(high.transformer, trainable=True)
    assert n_both == 2 * n_high > 0
    assert {n.split(".")[0] for n, p in high.transformer.named_parameters() if p.requires_grad} == {"transformer"}
    weights = model_items(load_config(recipe), both, 8)[0]
    assert "2 experts" in weights.note and "both resident" in weights.note


def test_arch_bench_routes_both_experts_tiny(tmp_path):
    """``flowrl bench precision --pipeline wan2.2-a14b-arch --tiny``: the shrunk pair, full precision and a
    quantized copy of both experts (their output layers kept in full precision)."""
    from flowrl.bench.precision_arch import bench_arch
    from flowrl.quant.common import merged_copy, replace_linears

    out = bench_arch("wan2.2-a14b-arch", ["full", "nvfp4-emulated:engine=torch"], tmp_path / "w.json",
                     resolutions=(32,), batch=1, steps=2, repeats=1, device="cpu", tiny=True, verbose=False,
                     model_options={"num_frames": 5})
    assert out["arch"]["config"]["boundary_ratio"] == 0.875
    row = out["backends"]["nvfp4-emulated:engine=torch"]["resolutions"]["32"]
    assert 0 < row["velocity_rel_error"] < 0.2
    pair = TwoExperts.from_config({**Wan22Policy.shrink_config(Wan22Policy.published[
        "Wan-AI/Wan2.2-T2V-A14B-Diffusers"].transformer)})
    names = replace_linears(merged_copy(pair), lambda n, m: m)
    assert not any(n.endswith("proj_out") and n.count(".") == 1 for n in names)


def test_two_processes_each_with_rows_of_one_expert_under_ddp_and_fsdp(tmp_path):
    """Two gloo processes, the first with a high-noise row, the second with a low-noise one (tests/
    experts_dist_worker.py): under DDP and under FSDP2 two training steps and a no-grad forward complete, and
    outputs and averaged gradients equal one process's computation of both rows."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(port), str(ROOT / "tests" / "experts_dist_worker.py"), str(tmp_path)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT,
                       env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    for rank in (0, 1):
        result = torch.load(tmp_path / f"{rank}.pt")
        for mode in ("ddp", "fsdp"):
            out_diff, grad_diff = result[mode]
            assert out_diff < 1e-5 and grad_diff < 1e-6, (rank, mode, result[mode])
