"""GPU tests (``pytest -m gpu``): each is skipped, with its reason shown, on a machine without CUDA.

bf16 training iterations of the tiny SD3 and FLUX recipes (the first minibatch's PPO ratio is 1:
rollout and training numerics agree), fp8 / nvfp4 copies close to full precision, the Sol sampler
end to end, flowrl's nvfp4-emulated against modelopt's CUDA fake quantization, the
architecture benchmark's CUDA-event path, and model.compile on CUDA (inductor, CUDA graphs, torchao's
float8 exploration copy re-synced in place). See docs/gpu_benchmark.md for the full-size runs.
"""
import importlib.util

import pytest
import torch

from flowrl.quant import get_quantizer
from flowrl.quant.kernels import kernel_info
from flowrl.types import swapped_transformer
from flowrl.rollout.ode import ode_sample
from flowrl.seeding import derive_seeds

HAS_CUDA = torch.cuda.is_available()
HAS_MODELOPT = importlib.util.find_spec("modelopt") is not None
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None
CAP = torch.cuda.get_device_capability() if HAS_CUDA else (0, 0)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (torch.cuda.is_available() "
                                                                      "is False); run with `pytest -m gpu` on one")]
_HERE = f"this GPU: sm_{CAP[0]}{CAP[1]}" if HAS_CUDA else "no CUDA GPU here"
needs_fp8 = pytest.mark.skipif(CAP < (8, 9), reason=f"real FP8 GEMMs need an sm_89+ GPU ({_HERE})")
needs_modelopt = pytest.mark.skipif(not HAS_MODELOPT, reason="nvidia-modelopt is not installed")
needs_torchao = pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed (pip install 'torchao>=0.18')")
PROMPTS = [f"a handwritten digit {d}" for d in range(8)]
SEEDS = derive_seeds(3, 8)


def _digits_policy():
    """The tiny digits policy on CUDA (fp32: the digits pipeline runs in fp32; the arch test covers bf16)."""
    from diffusers import SD3Transformer2DModel

    from flowrl.pipelines.digits import DigitsPolicy, DigitTextEncoder, tiny_transformer_config

    torch.manual_seed(0)
    pol = DigitsPolicy(SD3Transformer2DModel(**tiny_transformer_config()).eval(), DigitTextEncoder().eval(),
                       device="cuda")
    return pol


def _calibrator(policy, prompts, seeds, steps=2):
    def calibrate(module):
        with torch.no_grad(), swapped_transformer(policy, module):
            ode_sample(policy, prompts, seeds, steps)
    return calibrate


def _x0(policy, module, idx, steps=3):
    with torch.no_grad(), swapped_transformer(policy, module):
        return ode_sample(policy, [PROMPTS[i] for i in idx], [SEEDS[i] for i in idx], steps)[0]


# ------------------------------------------------------------------ training numerics
@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_bf16_training_iteration_first_ratio_is_one(tmp_path, monkeypatch, kind):
    """One bf16 iteration of the tiny recipe on CUDA: the update rescores the rollout's own transitions
    before any optimizer step, so the first minibatch's ratio exp(logp - logp_old) is 1."""
    import flowrl.updates.grpo as grpo  # the GRPO update calls the loss and the KL
    import flowrl.trainers.online as online
    from flowrl.pipelines.tiny import make_tiny
    from flowrl.trainers.config import load_config
    from helpers import IMAGE, ROOT, tiny_overrides

    ratios = []
    real = grpo.grpo_clipped_loss

    def spy(*args, **kwargs):
        loss, stats = real(*args, **kwargs)
        ratios.append(float(stats["ratio_mean"]))
        return loss, stats

    monkeypatch.setattr(grpo, "grpo_clipped_loss", spy)
    path = make_tiny(kind, tmp_path / kind, image_size=IMAGE)
    cfg = load_config(ROOT / "recipes" / f"{kind}_group_pickscore.yaml",
                      tiny_overrides(path, "group", **{"model.device": "cuda", "model.options.dtype": "bfloat16",
                                                       "train.mixed_precision": "bf16", "train.iterations": 1}))
    summary = online.train(cfg, tmp_path / "run")
    assert summary["iterations_done"] == 1 and summary["skipped_steps"] == 0
    assert ratios, "the update ran no minibatch"
    assert abs(ratios[0] - 1) < 1e-3, f"first minibatch ratio {ratios[0]:.6f}: rollout and training numerics differ"


# ------------------------------------------------------------------ quantized copies on CUDA
@needs_fp8
def test_fp8_linear_cuda_matches_the_reference_numerics():
    from flowrl.quant.fp8_linear import E4M3, FP8Linear

    torch.manual_seed(0)
    lin = torch.nn.Linear(1536, 1536).cuda().to(torch.bfloat16)  # an SD3.5-M projection
    x = torch.randn(333, 1536, device="cuda", dtype=torch.bfloat16)
    amax = float(x.abs().max())
    for weight in ("per_tensor", "per_channel"):
        q = FP8Linear(lin, amax, weight=weight, fast_accum=False)
        y = q(x).float()  # [333, 1536]
        w = lin.weight.float()
        s_w = (w.abs().amax(dim=1, keepdim=True) if weight == "per_channel" else w.abs().amax()) / 448
        s_x = amax / 448
        xq = (x / torch.tensor(s_x, device="cuda")).clamp(-448, 448).to(E4M3).float()
        ref = (xq @ ((w / s_w).clamp(-448, 448).to(E4M3).float()).t()) * s_x * s_w.reshape(1, -1) + lin.bias.float()
        assert (y - ref).norm() / ref.norm() < 1e-2  # bf16 output rounding
        full = lin(x).float()
        assert (y - full).norm() / full.norm() < 0.06


@pytest.mark.parametrize("backend", [pytest.param("fp8", marks=needs_fp8),
                                     pytest.param("nvfp4", marks=needs_modelopt)])
def test_cuda_copies_close_batch_independent_and_labelled(backend):
    pol = _digits_policy()
    q = get_quantizer(backend).quantize(pol.transformer, _calibrator(pol, PROMPTS[:4], SEEDS[:4]))
    info = kernel_info(backend, q)
    assert info["real_kernels"] == (backend == "fp8" or CAP >= (10, 0))
    a, b = _x0(pol, q, [0, 1, 2, 3]), _x0(pol, q, [0, 1, 6, 7])
    assert torch.equal(a[:2], b[:2])  # static scales: a sample does not depend on its batch-mates
    full = _x0(pol, pol.transformer, [0, 1, 2, 3])
    assert 0 < (a - full).norm() / full.norm() < 0.25


@needs_modelopt
def test_nvfp4_emulated_equals_modelopt_cuda_fake_quantization():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.GELU(), torch.nn.Linear(48, 32)).cuda()
    x = torch.randn(16, 64, device="cuda") * 2

    def calibrate(m):
        with torch.no_grad():
            m(x)

    emu = get_quantizer("nvfp4-emulated", engine="torch", skip=()).quantize(model, calibrate)
    mo = get_quantizer("nvfp4", kernel="modelopt", skip=()).quantize(model, calibrate)
    with torch.no_grad():
        ye, ym, yf = emu(x), mo(x), model(x)
    assert not torch.equal(ye, yf)  # it does quantize
    assert torch.allclose(ye, ym, rtol=1e-5, atol=1e-5), float((ye - ym).abs().max())


# ------------------------------------------------------------------ samplers and benchmark
def test_sol_sampler_end_to_end_on_cuda():
    from flowrl.rollout.sol import SolSampler

    pol = _digits_policy()
    backend = "fp8" if CAP >= (8, 9) else "none"
    sampler = SolSampler(explore_backend=backend, pool_size=8, preview_steps=2, keep=4, regen="group",
                         regen_options={"num_steps": 3})
    reward = lambda images, prompts, **meta: images.float().mean(dim=(1, 2, 3))  # noqa: E731
    r = sampler(pol, PROMPTS[:2], reward, seed=1)
    assert r.num_samples == 2 * 4 and len(r.transitions) > 0 and r.rewards.shape == (8,)
    assert r.stats["sol/explore_model_evals"] == 2 * 8 * 2 and r.stats["sol/syncs"] == 1
    assert torch.isfinite(r.rewards).all()


def test_arch_bench_cuda_event_path(tmp_path):
    from flowrl.bench.precision_arch import bench_arch

    backends = ["full"] + (["fp8"] if CAP >= (8, 9) else [])
    out = bench_arch("sd35m-arch", backends, tmp_path / "a.json", resolutions=(64,), batch=2, steps=2, repeats=2,
                     tiny=True, device="cuda", verbose=False)
    for r in out["backends"].values():
        row = r["resolutions"]["64"]
        assert row["peak_mb"] > 0 and row["forward_ms"] > 0 and row["images_per_second"] > 0
    if CAP >= (8, 9):
        assert out["backends"]["fp8"]["real_kernels"] is True
        assert out["backends"]["fp8"]["resolutions"]["64"]["velocity_rel_error"] < 0.1


# ------------------------------------------------------------------ model.compile on CUDA
def _bf16_digits_policy():
    pol = _digits_policy()
    pol.transformer.to(torch.bfloat16)
    return pol


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compiled_rollouts_on_cuda_equal_eager_and_reuse_their_graph(mode):
    """bf16 sampling compiled by inductor (reduce-overhead: CUDA graphs, whose outputs a later step would reuse)
    equals eager within bf16 round-off, and a second sampling with changed weights compiles nothing."""
    from flowrl.utils.compile import compile_rollouts

    torch._dynamo.reset()
    pol = _bf16_digits_policy()
    eager = _x0(pol, pol.transformer, [0, 1, 2, 3])
    log = compile_rollouts(pol.transformer, mode)
    compiled = _x0(pol, pol.transformer, [0, 1, 2, 3])
    assert (log.compiles, log.recompiles) == (1, 0)
    assert (compiled - eager).norm() / eager.norm() < 2e-2
    with torch.no_grad():
        pol.transformer.proj_out.weight.mul_(1.5)  # an update, in place
    again = _x0(pol, pol.transformer, [0, 1, 2, 3])
    assert (log.compiles, log.recompiles) == (1, 0) and not torch.equal(again, compiled)


@needs_fp8
@needs_torchao
def test_fp8_torchao_copy_close_compiled_and_resynced_in_place():
    from flowrl.quant.sync import QuantizedCopy
    from flowrl.trainable import add_lora
    from flowrl.utils.compile import compile_rollouts, compiled_forward

    torch._dynamo.reset()
    pol = _bf16_digits_policy()
    q = get_quantizer("fp8", kernel="torchao")
    copy = q.quantize(pol.transformer, None)
    info = kernel_info("fp8:kernel=torchao", copy)
    assert info["real_kernels"] is True and "torchao float8" in info["kernel"]
    a, full = _x0(pol, copy, [0, 1, 2, 3]), _x0(pol, pol.transformer, [0, 1, 2, 3])
    assert 0 < (a - full).norm() / full.norm() < 0.25
    add_lora(pol.transformer, 4, 8)
    pol.transformer.to(torch.bfloat16)
    log = compile_rollouts(pol.transformer, "default")
    qc = QuantizedCopy(q)
    qc.sync(pol.transformer)
    held = qc.module
    with qc.active(pol):
        first = _x0(pol, pol.transformer, [0, 1])
    with torch.no_grad():
        for n, p in pol.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    assert qc.sync(pol.transformer) > 0 and qc.module is held and compiled_forward(held).role == "exploration"
    with qc.active(pol):
        second = _x0(pol, pol.transformer, [0, 1])
    assert log.recompiles == 0 and not torch.equal(first, second)
