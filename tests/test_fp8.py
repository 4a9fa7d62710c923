"""fp8 (flowrl.quant.fp8 / fp8_linear): torch._scaled_mm FP8-E4M3 numerics on the CPU, by hand and
against a dequantized reference; static scales (batch independence); padding; errors and labels."""
import importlib.util

import pytest
import torch

from flowrl.quant import BackendUnavailable, get_quantizer
from flowrl.quant.fp8_linear import E4M3, FP8Linear, scaled_mm_problem
from flowrl.quant.kernels import display_label, kernel_info
from flowrl.types import swapped_transformer
from flowrl.rollout.ode import ode_sample
from flowrl.seeding import derive_seeds

pytestmark = pytest.mark.usefixtures("one_thread")
HAS_MODELOPT = importlib.util.find_spec("modelopt") is not None


def _reference(x, lin, input_amax, per_channel: bool):
    """Hand-computed FP8 linear: quantize x and W to E4M3 with their scales, fp32 matmul, rescale, + bias."""
    w = lin.weight.detach().float()  # [N, K]
    s_x = torch.tensor(input_amax / 448.0)
    s_w = (w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()) / 448.0  # [N, 1] or []
    xq = (x / s_x).clamp(-448, 448).to(E4M3).float()  # [M, K]
    wq = (w / s_w).clamp(-448, 448).to(E4M3).float()  # [N, K]
    return (xq @ wq.t()) * s_x * s_w.reshape(1, -1) + lin.bias.detach()  # [M, N]


def test_scaled_mm_runs_on_this_cpu():
    assert scaled_mm_problem("cpu", "per_tensor") is None
    assert scaled_mm_problem("cpu", "per_channel") is None


def test_fp8_linear_hand_values():
    """Input scale 1 (amax 448) and an identity weight: the output is x rounded to E4M3, saturating at 448."""
    lin = torch.nn.Linear(16, 16, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(16))
    q = FP8Linear(lin, 448.0, weight="per_tensor")
    x = torch.zeros(2, 16)
    x[0, :4] = torch.tensor([1.0, 3.0, 0.3, -500.0])  # 0.3 = 1.2 * 2^-2 -> 1.25 * 2^-2; -500 -> -448
    x[1, :2] = torch.tensor([17.0, 0.0137])  # 17 -> 16 (step 2 at [16, 32), tie to even); 0.0137 -> 7 * 2^-9
    y = q(x)
    assert torch.equal(y[0, :4], torch.tensor([1.0, 3.0, 0.3125, -448.0]))
    assert torch.equal(y[1, :2], torch.tensor([16.0, 7 * 2.0**-9]))
    assert torch.equal(y[:, 4:], torch.zeros(2, 12))


@pytest.mark.parametrize("weight", ["per_channel", "per_tensor"])
@pytest.mark.parametrize("k,n", [(64, 48), (40, 24)])  # 40 and 24 are not multiples of 16: padded
def test_fp8_linear_equals_dequantized_reference(weight, k, n):
    torch.manual_seed(0)
    lin = torch.nn.Linear(k, n)
    x = torch.randn(3, 5, k)  # [B, L, K]
    amax = float(x.abs().max()) * 0.9  # a few inputs saturate
    q = FP8Linear(lin, amax, weight=weight)
    assert (q.pad_k, q.pad_n) == ((-k) % 16, (-n) % 16)
    y = q(x)
    ref = _reference(x.reshape(-1, k), lin, amax, weight == "per_channel").reshape(3, 5, n)
    assert y.shape == (3, 5, n) and y.dtype == torch.float32
    assert torch.allclose(y, ref, rtol=1e-5, atol=1e-5)
    full = lin(x)
    assert 0 < (y - full).norm() / full.norm() < 0.06  # E4M3: about 4% relative error on random data


def test_fp8_linear_static_scale_is_batch_independent():
    torch.manual_seed(1)
    lin = torch.nn.Linear(32, 16)
    q = FP8Linear(lin, 4.0)
    x = torch.randn(4, 32)
    outlier = torch.cat([x[:2], 100 * torch.randn(2, 32)])  # other rows 25x larger: no effect on rows 0, 1
    assert torch.equal(q(x)[:2], q(outlier)[:2])
    assert torch.allclose(q(x[:1]), q(x)[:1], rtol=0, atol=1e-6)  # another M: fp32 GEMM blocking only


def _calibrator(policy, prompts, seeds, steps=2):
    def calibrate(module):
        with torch.no_grad(), swapped_transformer(policy, module):
            ode_sample(policy, prompts, seeds, steps)
    return calibrate


PROMPTS = [f"a handwritten digit {d}" for d in range(8)]
SEEDS = derive_seeds(3, 8)


def _x0(policy, module, idx, steps=3):
    with torch.no_grad(), swapped_transformer(policy, module):
        return ode_sample(policy, [PROMPTS[i] for i in idx], [SEEDS[i] for i in idx], steps)[0]


def test_fp8_quantizer_on_cpu_copy_labels_and_batch_independence(tiny_digits_policy):
    pol = tiny_digits_policy
    before = {n: p.clone() for n, p in pol.transformer.named_parameters()}
    q = get_quantizer("fp8", simulate_on_cpu=True).quantize(pol.transformer, _calibrator(pol, PROMPTS[:4], SEEDS[:4]))
    layers = [m for m in q.modules() if isinstance(m, FP8Linear)]
    assert layers and all(m.weight_scaling == "per_channel" for m in layers)  # auto: row-wise works on this CPU
    assert not any(isinstance(m, FP8Linear) for n, m in q.named_modules() if "pos_embed" in n or n == "proj_out")
    assert all(torch.equal(p, before[n]) for n, p in pol.transformer.named_parameters())  # policy untouched
    info = kernel_info("fp8:simulate_on_cpu=true", q)
    assert info["real_kernels"] is False and "simulated" in info["kernel"]
    assert display_label("fp8", info) == "fp8 (simulated)"
    a, b = _x0(pol, q, [0, 1, 2, 3]), _x0(pol, q, [0, 1, 6, 7])
    assert torch.equal(a[:2], b[:2])
    full = _x0(pol, pol.transformer, [0, 1, 2, 3])
    assert 0 < (a - full).abs().max() < 0.1


def test_fp8_errors_name_what_runs_here(tiny_digits_policy):
    tr = tiny_digits_policy.transformer
    with pytest.raises(ValueError, match="kernel must be one of"):
        get_quantizer("fp8", kernel="cutlass")
    with pytest.raises(ValueError, match="weight must be one of"):
        get_quantizer("fp8", weight="per_block")
    with pytest.raises(ValueError, match="fast_accum must be true or false"):
        get_quantizer("fp8", fast_accum="yes")
    q = get_quantizer("fp8", simulate_on_cpu=True)
    with pytest.raises(ValueError, match="pass calibrate"):
        q.quantize(tr, None)
    with pytest.raises(ValueError, match="saw no calibration data"):
        q.quantize(tr, lambda m: None)
    with pytest.raises(ValueError, match="nothing to quantize"):
        get_quantizer("fp8", simulate_on_cpu=True, skip=("*",)).quantize(tr, lambda m: None)
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailable, match="CUDA GPU.*int8-dynamic.*nvfp4-emulated"):
            get_quantizer("fp8")


@pytest.mark.skipif(not HAS_MODELOPT, reason="nvidia-modelopt is not installed")
def test_fp8_modelopt_kernel_is_kept_and_labelled_simulated(tiny_digits_policy):
    pol = tiny_digits_policy
    q = get_quantizer("fp8", kernel="modelopt", simulate_on_cpu=True).quantize(
        pol.transformer, _calibrator(pol, PROMPTS[:2], SEEDS[:2]))
    assert not any(isinstance(m, FP8Linear) for m in q.modules())
    assert any(n.endswith("input_quantizer") for n, _ in q.named_modules())
    assert kernel_info("fp8:kernel=modelopt", q)["real_kernels"] is False


def test_fp8_fuse_qkv_quantizes_each_attention_input_once(tiny_digits_policy):
    """fp8:fuse_qkv=true fuses q/k/v first: fewer FP8 layers (one per attention input instead of three) and
    the same samples as the unfused copy (same weights, per-channel scales and input scale)."""
    from flowrl.quant.fp8 import FP8Quantizer

    pol = tiny_digits_policy
    cal = _calibrator(pol, PROMPTS[:4], SEEDS[:4])
    plain = FP8Quantizer(simulate_on_cpu=True).quantize(pol.transformer, cal)
    fused = FP8Quantizer(simulate_on_cpu=True, fuse_qkv=True).quantize(pol.transformer, cal)
    count = lambda m: sum(isinstance(x, FP8Linear) for x in m.modules())  # noqa: E731
    names = {n.rsplit(".", 1)[-1] for n, x in fused.named_modules() if isinstance(x, FP8Linear)}
    assert {"to_qkv", "to_added_qkv"} <= names and "to_q" not in names
    assert count(fused) == count(plain) - 4  # one joint block: 3 + 3 projections -> 1 + 1
    a, b = _x0(pol, plain, [0, 1, 2, 3]), _x0(pol, fused, [0, 1, 2, 3])
    assert torch.allclose(a, b, rtol=0, atol=1e-5), float((a - b).abs().max())
    assert not any(n.endswith("to_qkv") for n, _ in pol.transformer.named_modules())  # the policy is untouched


def test_fp8_fuse_qkv_on_a_model_without_it_is_a_clear_error():
    from flowrl.quant.fp8 import fuse_qkv_projections

    with pytest.raises(ValueError, match="fuse_qkv_projections.*drop fuse_qkv"):
        fuse_qkv_projections(torch.nn.Sequential(torch.nn.Linear(4, 4)))


def test_fuse_qkv_keeps_a_flux_transformer_s_output():
    """FLUX (double and single blocks): the fused copy, unfused projections dropped, computes the same."""
    import copy

    from diffusers import FluxTransformer2DModel

    from flowrl.quant.fp8 import fuse_qkv_projections

    torch.manual_seed(0)
    tr = FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=1, num_single_layers=1, attention_head_dim=8,
                                num_attention_heads=2, joint_attention_dim=16, pooled_projection_dim=8,
                                axes_dims_rope=(2, 2, 4)).eval()
    fused = copy.deepcopy(tr)
    fuse_qkv_projections(fused)
    assert not any(n.endswith((".to_q", ".add_q_proj")) for n, _ in fused.named_modules())
    kw = dict(hidden_states=torch.randn(2, 16, 8), encoder_hidden_states=torch.randn(2, 4, 16),
              pooled_projections=torch.randn(2, 8), timestep=torch.rand(2), img_ids=torch.rand(16, 3),
              txt_ids=torch.zeros(4, 3), return_dict=False)
    with torch.no_grad():
        a, b = tr(**kw)[0], fused(**kw)[0]  # [2, 16, 8]
    assert torch.allclose(a, b, atol=1e-5), float((a - b).abs().max())


# ------------------------------------------------------------------ kernel=torchao (its float8 runs on CUDA only)
HAS_TORCHAO = importlib.util.find_spec("torchao") is not None


def test_fp8_torchao_kernel_wiring_on_this_machine(tiny_digits_policy):
    """The layers torchao quantizes are the hand-written kernel's, less those whose sizes its GEMMs refuse; it
    needs no calibration, re-syncs in place; without CUDA (or torchao) it is refused before any model is used."""
    from flowrl.quant.common import DEFAULT_SKIP, is_skipped
    from flowrl.quant.fp8_torchao import check_torchao_module, torchao_layers

    tr = tiny_digits_policy.transformer
    q = get_quantizer("fp8", kernel="torchao", require_available=False)
    assert q.needs_calibration is False and q.syncs_in_place and q.skip == DEFAULT_SKIP
    hand = [n for n, m in tr.named_modules() if isinstance(m, torch.nn.Linear) and not is_skipped(n, DEFAULT_SKIP)]
    fits, left = torchao_layers(tr, q.skip)
    assert fits and sorted(fits + left) == sorted(hand) and not any("pos_embed" in n or n == "proj_out" for n in fits)
    odd = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 8), torch.nn.Linear(24, 32))
    assert torchao_layers(odd, ()) == (["0"], ["1", "2"])  # K and N multiples of 16 only
    with pytest.raises(ValueError, match="no CPU simulation"):
        get_quantizer("fp8", kernel="torchao", simulate_on_cpu=True, require_available=False)
    with pytest.raises(ValueError, match="kernel=torchao quantizes a model on a CUDA device"):
        check_torchao_module(tr, "auto")
    if not torch.cuda.is_available():
        why = q.unavailable_reason()
        assert ("refuses them elsewhere" in why) if HAS_TORCHAO else ("not installed" in why)
        with pytest.raises(BackendUnavailable, match="fp8:kernel=torchao"):
            get_quantizer("fp8", kernel="torchao")


@pytest.mark.skipif(not HAS_TORCHAO, reason="torchao is not installed (pip install 'torchao>=0.18', in flowrl's "
                                            "quant extra): its config cannot be built here")
def test_fp8_torchao_config_is_row_wise_dynamic_float8():
    from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, PerTensor

    from flowrl.quant.fp8_torchao import torchao_config

    c = torchao_config("auto", True)
    assert isinstance(c, Float8DynamicActivationFloat8WeightConfig)
    assert all(isinstance(g, PerRow) for g in c.granularity)  # activations and weights: one scale per row
    assert c.mm_config.use_fast_accum is True and c.set_inductor_config is False  # inductor's settings left alone
    t = torchao_config("per_tensor", False)
    assert all(isinstance(g, PerTensor) for g in t.granularity) and t.mm_config.use_fast_accum is False
