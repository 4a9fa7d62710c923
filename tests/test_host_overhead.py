"""Host overhead (issue 15, item 6): the transformer dtype is read without walking the model, samplers
keep transitions where they were made, per-seed noise keeps its CPU values, the update reuses the
rollout's conditioning and reads device values once per optimizer step, and a training forward
with the unconditional CFG half detached runs that half outside the autograd graph."""
import json

import pytest
import torch
from diffusers import SD3Transformer2DModel

from flowrl.bench.host import HostOptions, bench_trainer, host_counters
from flowrl.pipelines import common
from flowrl.pipelines.common import forget_module_dtype, module_dtype, transformer_dtype
from flowrl.pipelines.digits import tiny_transformer_config
from flowrl.rollout.branch import BranchSampler
from flowrl.rollout.group import GroupSampler
from flowrl.rollout.ode import ode_rollout
from flowrl.rollout.tempflow import TempFlowSampler
from flowrl.seeding import seeded_randn, seeded_randn_rows
from flowrl.updates.base import Batch, Update

pytestmark = pytest.mark.usefixtures("one_thread")
P = ["a handwritten digit 3", "a handwritten digit 7"]


def _root_walks(monkeypatch, root) -> list:
    """Counter of ``named_modules()`` walks started on ``root`` (what diffusers' ``.dtype`` does per read)."""
    n, orig = [0], torch.nn.Module.named_modules

    def spy(self, *a, **k):
        n[0] += self is root and not a
        return orig(self, *a, **k)

    monkeypatch.setattr(torch.nn.Module, "named_modules", spy)
    return n


def _mean_pixel(images, prompts, **meta):
    return images.float().mean(dim=(1, 2, 3))


@pytest.fixture(scope="module")
def tiny_pipelines(tmp_path_factory):
    from flowrl.pipelines.tiny import make_tiny

    root = tmp_path_factory.mktemp("tiny-pipelines")
    return {kind: make_tiny(kind, root / kind, image_size=32) for kind in ("sd3", "flux")}


def _tiny_policy(tiny_pipelines, kind: str, cfg: float):
    from flowrl.pipelines.flux import FluxPolicy
    from flowrl.pipelines.sd3 import SD3Policy

    if kind == "sd3":
        return SD3Policy.from_pretrained(tiny_pipelines["sd3"], guidance_scale=cfg, max_sequence_length=8)
    return FluxPolicy.from_pretrained(tiny_pipelines["flux"], true_cfg_scale=cfg, max_sequence_length=8)


# ---------------------------------------------------------------- dtype
@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_velocity_reads_the_dtype_without_walking_the_model(tiny_pipelines, monkeypatch, kind):
    pol = _tiny_policy(tiny_pipelines, kind, 1.0)
    x, s, cond = pol.initial_noise([1, 2]), torch.tensor([0.5, 0.5]), pol.encode_prompts(["a cat", "a dog"])
    walks = _root_walks(monkeypatch, pol.transformer)
    with torch.no_grad():
        pol.velocity(x, s, cond)  # the first read walks (and caches)
        first = walks[0]
        for _ in range(5):
            pol.velocity(x, s, cond)
    assert first >= 1 and walks[0] == first  # diffusers' .dtype: 2 walks per read, 1-2 reads per call


def test_cached_dtype_follows_casts_and_replaced_parameters():
    m = SD3Transformer2DModel(**{**tiny_transformer_config(), "num_layers": 1})
    assert module_dtype(m) == m.dtype == torch.float32
    m.to(torch.float64)  # in place: the cached probe parameter changes dtype
    assert module_dtype(m) == m.dtype == torch.float64
    old = torch.__future__.get_overwrite_module_params_on_conversion()
    torch.__future__.set_overwrite_module_params_on_conversion(True)
    try:
        m.half()  # new Parameter objects: the cached probe is no longer registered
        assert module_dtype(m) == m.dtype == torch.float16
    finally:
        torch.__future__.set_overwrite_module_params_on_conversion(old)
    m.to(torch.bfloat16)
    wrapper = torch.nn.Module()
    wrapper.module = m  # DDP / FSDP keep the model in .module
    assert transformer_dtype(wrapper) == torch.bfloat16
    forget_module_dtype(wrapper)
    assert common._DTYPE_CACHE.get(m) is None and module_dtype(m) == torch.bfloat16
    assert module_dtype(torch.nn.Linear(2, 2).double()) == torch.float64  # plain modules: first parameter


# ---------------------------------------------------------------- CFG in training
def _forward_log(module):
    log = []
    hook = module.register_forward_pre_hook(
        lambda mod, args, kw: log.append((kw["hidden_states"].shape[0], torch.is_grad_enabled())), with_kwargs=True)
    return log, hook


def _saved_bytes(fn):
    """(output, bytes of the tensors autograd saved for backward while running ``fn``)."""
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total[0]


def test_training_cfg_runs_the_unconditional_half_outside_the_graph(tiny_digits_policy):
    pol = tiny_digits_policy
    pol.guidance_scale = 3.0
    pol.transformer.requires_grad_(True)
    x, s, cond = pol.initial_noise([1, 2]), torch.tensor([0.8, 0.4]), pol.encode_prompts(P)
    log, hook = _forward_log(pol.transformer)
    pol.cfg_uncond_grad = False  # as the trainer sets it from train.loss_options.cfg_uncond_grad (default)
    v_split, split_bytes = _saved_bytes(lambda: pol.velocity(x, s, cond))
    assert log == [(2, False), (2, True)]  # uncond alone under no_grad, then cond with the graph
    log.clear()
    with torch.no_grad():
        v_sample = pol.velocity(x, s, cond)
    assert log == [(4, False)]  # sampling keeps the one doubled batch

    def doubled_detached():  # what the trainer ran before: one [2B] graph, uncond detached after
        out = pol._forward(torch.cat([x, x]), torch.cat([s, s]),
                           torch.cat([cond["neg_encoder_hidden_states"], cond["encoder_hidden_states"]]),
                           torch.cat([cond["neg_pooled_projections"], cond["pooled_projections"]]))
        u, c = out.float().chunk(2)
        return u.detach() + 3.0 * (c - u.detach())

    v_doubled, doubled_bytes = _saved_bytes(doubled_detached)
    hook.remove()
    assert split_bytes < 0.6 * doubled_bytes  # the uncond activations are not kept for backward
    torch.testing.assert_close(v_split, v_sample, rtol=1e-4, atol=1e-5)
    grads = []
    for v in (v_split, v_doubled):
        pol.transformer.zero_grad(set_to_none=True)
        v.pow(2).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in pol.transformer.parameters() if p.grad is not None]))
    assert (grads[0] - grads[1]).norm() <= 1e-5 * grads[1].norm()


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_sd3_and_flux_training_cfg_split(tiny_pipelines, kind):
    pol = _tiny_policy(tiny_pipelines, kind, 2.0)
    pol.transformer.requires_grad_(True)
    x, s, cond = pol.initial_noise([1, 2]), torch.tensor([0.8, 0.4]), pol.encode_prompts(["a cat", "a dog"])
    log, hook = _forward_log(pol.transformer)
    pol.cfg_uncond_grad = False
    v = pol.velocity(x, s, cond)
    with torch.no_grad():
        v_sample = pol.velocity(x, s, cond)
    hook.remove()
    assert log == [(2, False), (2, True), (4, False)]
    torch.testing.assert_close(v, v_sample, rtol=1e-4, atol=1e-5)


def test_flux_image_ids_are_built_on_the_device():
    from flowrl.pipelines.packing import latent_image_ids

    ids = torch.zeros(4, 3, 3)
    ids[..., 1], ids[..., 2] = torch.arange(4)[:, None], torch.arange(3)[None, :]
    assert torch.equal(latent_image_ids(8, 6, "cpu"), ids.reshape(-1, 3))


# ---------------------------------------------------------------- per-seed noise
def _seeded_randn_before(seeds, shape, stream=0):
    """The implementation before device-side draws (one CPU generator per row, stacked)."""
    rows = [torch.randn(shape, generator=torch.Generator().manual_seed((int(s) * 1_000_003 + int(stream) * 7919)
                                                                       % (2**63 - 1)), dtype=torch.float32)
            for s in seeds]
    return torch.stack(rows) if rows else torch.zeros((0, *shape))


@pytest.mark.parametrize("shape", [(), (3,), (16,), (17,), (1, 16, 16), (16, 4, 4), (7, 9, 5)])
def test_cpu_noise_is_bit_identical_to_before(shape):
    seeds = [0, 1, 12345, 2**31 - 1]
    for stream in (0, 1, 9001):
        assert torch.equal(seeded_randn(seeds, shape, stream), _seeded_randn_before(seeds, shape, stream))
    rows = seeded_randn_rows(seeds, [0, 1, 9001, 5], shape)
    for i, (s, st) in enumerate(zip(seeds, [0, 1, 9001, 5])):
        assert torch.equal(rows[i], _seeded_randn_before([s], shape, st)[0])
    assert seeded_randn([], shape).shape == (0, *shape)
    with pytest.raises(ValueError, match="one stream per seed"):
        seeded_randn_rows([1, 2], [0], shape)


# ---------------------------------------------------------------- transitions stay on the device
@pytest.mark.parametrize("make", [
    lambda t: GroupSampler(group_size=2, num_steps=t),
    lambda t: BranchSampler(num_steps=t, split_steps=(0,), branch_factor=2, window=1),
    lambda t: TempFlowSampler(num_steps=t, branch_steps=(0,), branches=2, seeds_per_prompt=1),
], ids=["group", "branch", "tempflow"])
def test_samplers_copy_nothing_to_the_host_per_step(tiny_digits_policy, make):
    counts = []
    for t in (2, 5):
        with host_counters() as c:
            ro = make(t)(tiny_digits_policy, P, _mean_pixel, seed=1)
        counts.append(c["cpu_calls"])
    assert counts[0] == counts[1]  # constant: images / tree metadata once, never the transitions per step
    tr = ro.transitions
    assert tr.to(tr.latents.device).latents.data_ptr() == tr.latents.data_ptr()  # .to(dev) there: no copy
    assert ro.cond is not None and ro.x0.device == tr.latents.device


# ---------------------------------------------------------------- the update
def _digits_trainer(pol, tmp_path, *overrides, minibatch=4, grad_accum=2):
    o = HostOptions(pipeline="digits", device="cpu", minibatch=minibatch, grad_accum=grad_accum)
    return bench_trainer(pol, o, tmp_path, overrides)


def _encode_spy(pol, monkeypatch):
    calls, orig = [], pol.encode_prompts
    monkeypatch.setattr(pol, "encode_prompts", lambda prompts: calls.append(list(prompts)) or orig(prompts))
    return calls


@pytest.mark.parametrize("loss", ["grpo", "nft", "dpo"])
def test_update_reuses_the_rollout_conditioning(tiny_digits_policy, tmp_path, loss, monkeypatch):
    pol = tiny_digits_policy
    own = [] if loss == "grpo" else ["train.loss_options={}"]
    tr = _digits_trainer(pol, tmp_path, f"train.loss={loss}", *own)  # (the recipe's options and KL are GRPO's)
    ro = (GroupSampler(group_size=4, num_steps=2)(pol, P, _mean_pixel, seed=3) if loss == "grpo" else
          ode_rollout(pol, P, list(range(8)), 2, _mean_pixel))
    with torch.no_grad():
        want = pol.encode_prompts(ro.prompts)
    assert all(torch.equal(ro.cond[k], want[k]) for k in want)  # encoded in the same batch: bit for bit
    calls = _encode_spy(pol, monkeypatch)
    tr.train_on(ro, 0)
    assert calls == []  # before: one encode_prompts(rollout.prompts) per update
    ro.cond = None  # a rollout that kept none: encoded once, as before
    tr.train_on(ro, 1)
    assert calls == [list(ro.prompts)]


def test_update_reads_device_values_once_per_optimizer_step(tiny_digits_policy, tmp_path):
    pol = tiny_digits_policy
    tr = _digits_trainer(pol, tmp_path, minibatch=4, grad_accum=2)  # the digits recipe: KL on
    ro = GroupSampler(group_size=4, num_steps=2)(pol, P, _mean_pixel, seed=3)  # 16 transitions: 4 minibatches
    upd = tr.update_object()
    per_minibatch, mbl = [], upd.minibatch_loss

    def counted(*a, **k):
        with host_counters() as c:
            out = mbl(*a, **k)
        per_minibatch.append(c["reads_flowrl"])
        return out

    upd.minibatch_loss = counted
    stats, _ = tr.train_on(ro, 0)
    assert per_minibatch == [0] * 4  # before: 5 each (.item() of 3 loss stats, the loss, the KL)
    assert tr.steps.opt_steps + tr.steps.skipped == 2 and not any(isinstance(v, torch.Tensor) for v in stats.values())
    batch = upd.batch(ro, 1)  # what the update trains on (its advantages read the rewards once, before the loop)
    with host_counters() as c:
        stats, trained = tr.steps.train(upd, batch, 1)
    # the update loop: one step-or-skip read per optimizer step, one for all the stats (before: 3 per minibatch
    # + 2 per step)
    assert trained == 16 and len(per_minibatch) == 8 and c["reads_flowrl"] == 2 + 1
    assert {"loss", "kl", "clip_fraction", "ratio_mean", "grad_norm", "policy_loss"} <= set(stats)


def test_nonfinite_pass_skips_its_group_and_leaves_the_weights_alone(tiny_digits_policy, tmp_path):
    import copy

    pols = [tiny_digits_policy, copy.deepcopy(tiny_digits_policy)]
    trs = [_digits_trainer(p, tmp_path / str(i), minibatch=2, grad_accum=2) for i, p in enumerate(pols)]
    x, s = pols[0].initial_noise([1, 2]), torch.tensor([0.5, 0.5])

    class Passes(Update):  # minibatch i of the epoch is NaN where bad[i]: a stand-in for a real update
        def __init__(self, pol, bad):
            self.pol, self.bad, self.cond = pol, bad, pol.encode_prompts(P)

        def loss(self, batch, mb):
            nan = float("nan") if self.bad[mb.index] else 1.0
            return self.pol.velocity(x, s, self.cond).pow(2).mean() * nan, {"stat": torch.tensor(1.0)}

    with host_counters() as c:  # group 1 has a NaN minibatch
        stats, trained = trs[0].steps.train(Passes(pols[0], [False, True, False, False]),
                                            Batch(torch.arange(4), 1, shuffle=None), 0)
    trs[1].steps.train(Passes(pols[1], [False, False]), Batch(torch.arange(2), 1, shuffle=None), 0)  # group 2 alone
    assert c["reads_flowrl"] == 2 + 1
    assert trained == 4 and stats["stat"] == 1.0 and stats["loss"] > 0  # the mean over the 3 finite minibatches
    assert trs[0].steps.skipped == 1 and trs[0].steps.opt_steps == 1
    assert torch.isnan(torch.as_tensor(stats["grad_norm"])).item()  # NaN logged for the skipped step, as before
    w = [{k: v for k, v in t.unwrapped.state_dict().items() if "lora" in k} for t in trs]
    assert w[0] and all(torch.equal(w[0][k], w[1][k]) for k in w[0])  # the NaN group left no trace


# ---------------------------------------------------------------- the harness
def test_bench_host_command(tmp_path):
    from flowrl.cli import main

    out = tmp_path / "host.json"
    assert main(["bench", "host", "--pipeline", "digits", "--device", "cpu", "--num-steps", "2", "--prompts", "1",
                 "--json", str(out)]) == 0
    rep = json.loads(out.read_text())
    assert rep["update"]["encode_prompts_calls"] == 0 and rep["update"]["minibatches"] > 0
    assert rep["rollout"]["transformer_walks_per_forward"] == 0 and rep["rollout"]["bare_forward_seconds"] > 0


def test_a_later_run_in_the_same_process_may_change_mixed_precision(tmp_path):
    """accelerate keeps one process-wide state and refuses another mixed precision: a notebook's second run
    (or the GPU tests' fp32 trainer after a bf16 one) must still set up."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from flowrl.bench.host import build_host_policy

    from flowrl.distributed.accelerate_state import accelerate_settings_differ, forget_stale_accelerate_settings

    forget_stale_accelerate_settings("bf16", True)  # whatever an earlier test of this session left
    Accelerator(cpu=True, mixed_precision="bf16")  # the earlier run
    assert accelerate_settings_differ(AcceleratorState._shared_state, "no", True)
    assert not accelerate_settings_differ(AcceleratorState._shared_state, "bf16", True)  # same: kept
    o = HostOptions(pipeline="digits", device="cpu", minibatch=4, grad_accum=2)
    tr = bench_trainer(build_host_policy(o, tmp_path), o, tmp_path)
    assert AcceleratorState().mixed_precision == "no" and tr.acc.mixed_precision == "no"


# ---------------------------------------------------------------- on a GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_noise_is_drawn_on_the_device_per_seed():
    torch.cuda.init()
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")  # a host-to-device copy or a read would raise
    try:
        batch = seeded_randn([5, 6, 7], (16, 8, 8), stream=3, device="cuda")
        alone = seeded_randn([6], (16, 8, 8), stream=3, device="cuda")
    finally:
        torch.cuda.set_sync_debug_mode(old)
    assert batch.is_cuda and torch.equal(batch[1], alone[0])  # depends on the seed only


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_rollout_and_update_sync_per_step_not_per_row(tmp_path):
    from flowrl.bench.host import build_host_policy

    o = HostOptions(pipeline="digits", device="cuda", minibatch=4, grad_accum=2)
    pol = build_host_policy(o, tmp_path)
    syncs = []
    for t in (2, 4):
        with host_counters(pol.transformer) as c:
            ro = GroupSampler(group_size=4, num_steps=t)(pol, P, _mean_pixel, seed=1)
        syncs.append(c["cuda_syncs"])
    assert syncs[0] == syncs[1]  # nothing per step: the end of the rollout only
    assert ro.transitions.latents.is_cuda and ro.x0.is_cuda
    tr = bench_trainer(pol, o, tmp_path)
    with host_counters(pol.transformer) as c:
        tr.train_on(ro, 0)
    assert c["cuda_syncs"] <= (tr.steps.opt_steps + tr.steps.skipped) + 8  # per optimizer step, not per minibatch


def test_bench_host_sd35m_path_with_a_small_config(monkeypatch):
    """The GPU command's pipeline (SD3 adapter, random text embeddings, recipe sd3_group_pickscore), shrunk."""
    import flowrl.bench.host as host

    monkeypatch.setattr(host, "SD35M_CONFIG", dict(
        sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=16,
        pos_embed_max_size=8, dual_attention_layers=(0,), qk_norm="rms_norm"))
    rep = host.run_host_bench(HostOptions(pipeline="sd35m", device="cpu", resolution=64, prompts=1, group_size=2,
                                          num_steps=2, minibatch=2, grad_accum=2))
    assert rep["rollout"]["transformer_forwards"] == 2 and rep["update"]["encode_prompts_calls"] == 0
    assert rep["update"]["minibatches"] == 2 and rep["update"]["optimizer_steps"] == 1
