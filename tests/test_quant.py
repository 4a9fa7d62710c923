"""Quantization backends (flowrl.quant): NVFP4 numerics by hand, registry, private copies,
batch independence, re-sync."""
import importlib.util

import pytest
import torch

from flowrl.quant import (BackendUnavailable, available_backends, backend_status, get_quantizer, merged_copy,
                          parse_backend_spec)
from flowrl.quant.fidelity import kendall_tau, ranking_fidelity, spearman, topk_hit_rate
from flowrl.quant.nvfp4_numerics import e2m1_round, e4m3_round, nvfp4_fake_quant
from flowrl.quant.sync import QuantizedCopy
from flowrl.types import swapped_transformer
from flowrl.rollout.ode import ode_sample
from flowrl.seeding import derive_seeds

HAS_MODELOPT = importlib.util.find_spec("modelopt") is not None
needs_modelopt = pytest.mark.skipif(not HAS_MODELOPT, reason="nvidia-modelopt is not installed")
S_G1 = 6.0 * 448.0  # a global amax whose fp32 global scale is exactly 1


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


# ------------------------------------------------------------------ NVFP4 numerics by hand
def test_e2m1_rounding_ties_to_even_and_saturates():
    y = torch.tensor([0.2, 0.25, 0.3, 0.75, 1.25, 1.3, 1.75, 2.5, 2.6, 3.5, 5.0, 5.1, 7.0, -0.75, -3.2, 0.0])
    want = torch.tensor([0.0, 0.0, 0.5, 1.0, 1.0, 1.5, 2.0, 2.0, 3.0, 4.0, 4.0, 6.0, 6.0, -1.0, -3.0, 0.0])
    assert torch.equal(e2m1_round(y), want)


def test_e4m3_block_scale_rounding():
    s = torch.tensor([0.3, 448.0, 500.0, 1e-4, 0.0029, 1.0625, 1.1875, 0.5])
    # 0.3 = 1.2 * 2^-2 -> 1.25 * 2^-2; 500 clamps to 448; 1e-4 clamps to 2^-9; 0.0029 -> 1 * 2^-9
    # (subnormal step 2^-9); 1.0625 and 1.1875 are ties -> even mantissa (1.0, 1.25)
    want = torch.tensor([0.3125, 448.0, 448.0, 2.0**-9, 2.0**-9, 1.0, 1.25, 0.5])
    assert torch.equal(e4m3_round(s), want)


def _block(*head):
    return torch.tensor(list(head) + [0.0] * (16 - len(head)))


def test_nvfp4_block_hand_values():
    # global scale 1, block max 3 -> block scale 0.5: x / 0.5 = [6, 2, 0.6, -1.4] -> [6, 2, 0.5, -1.5]
    x = _block(3.0, 1.0, 0.3, -0.7)
    assert torch.equal(nvfp4_fake_quant(x, S_G1), _block(3.0, 1.0, 0.25, -0.75))
    # block max 1.8 -> scale 0.3 -> e4m3 0.3125: 1.8 / 0.3125 = 5.76 -> 6; 1.0 -> 3.2 -> 3; 0.1 -> 0.32 -> 0.5
    x = _block(1.8, 1.0, 0.1)
    assert torch.equal(nvfp4_fake_quant(x, S_G1), _block(1.875, 0.9375, 0.15625))
    # global scale 2: block scale 3 / 12 = 0.25, effective 0.5: same values as the first block
    assert torch.equal(nvfp4_fake_quant(_block(3.0, 1.0, 0.3, -0.7), 2 * S_G1), _block(3.0, 1.0, 0.25, -0.75))


def test_nvfp4_static_amax_saturates_and_blocks_are_independent():
    # calibrated amax 26.88 -> global 0.01; block max 100 -> block scale 1666 clamps to 448 -> step 4.48:
    # 100 -> 22.3 -> 6 -> 26.88, 10 -> 2.23 -> 2 -> 8.96
    x = _block(100.0, 10.0)
    assert torch.allclose(nvfp4_fake_quant(x, 26.88), _block(26.88, 8.96), rtol=1e-6)
    row = torch.cat([_block(3.0, 1.0), _block(0.6, 0.2)])  # [32]: two blocks, two scales
    # second block: scale 0.1 -> e4m3 0.1015625: 0.6 -> 5.9 -> 6 -> 0.609375; 0.2 -> 1.97 -> 2 -> 0.203125
    assert torch.equal(nvfp4_fake_quant(row, S_G1), torch.cat([_block(3.0, 1.0), _block(0.609375, 0.203125)]))


def test_nvfp4_zero_block_padding_and_dtype():
    assert torch.equal(nvfp4_fake_quant(torch.zeros(2, 16), S_G1), torch.zeros(2, 16))
    x = torch.zeros(20)
    x[0], x[17] = 3.0, 3.0  # 20 = one full block + a block of 4 padded with zeros
    assert torch.equal(nvfp4_fake_quant(x, S_G1), x)
    y = nvfp4_fake_quant(torch.randn(3, 32, dtype=torch.bfloat16), 4.0)
    assert y.dtype == torch.bfloat16 and y.shape == (3, 32)


@needs_modelopt
def test_nvfp4_matches_modelopt_reference():
    from flowrl.quant.modelopt_support import import_mtq

    import_mtq()  # imports modelopt with its import-time warnings silenced
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    torch.manual_seed(0)
    w = torch.randn(32, 64) * torch.rand(32, 1) * 3  # [32, 64]
    qt, s_block, s_global = NVFP4QTensor.quantize(w, 16)
    ref = qt.dequantize(dtype=torch.float32, scale=s_block, double_scale=s_global, block_sizes={-1: 16})
    assert torch.equal(nvfp4_fake_quant(w, w.abs().amax()), ref)


# ------------------------------------------------------------------ real NVFP4 layout (packing, swizzled scales)
def test_e2m1_codes_and_nibble_packing_by_hand():
    from flowrl.quant.nvfp4_kernels import e2m1_codes, e2m1_values, pack_pairs, unpack_pairs

    v = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -6.0])
    codes = e2m1_codes(v)
    assert codes.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 9, 15]
    assert torch.equal(e2m1_values(codes), v)
    packed = pack_pairs(codes)  # element 2j in the low nibble
    assert packed.tolist() == [0x10, 0x32, 0x54, 0x76, 0xF9]
    assert torch.equal(unpack_pairs(packed), codes)


def test_nvfp4_pack_decodes_to_the_emulated_numerics():
    from flowrl.quant.nvfp4_kernels import nvfp4_pack, nvfp4_unpack

    torch.manual_seed(0)
    x = torch.randn(20, 48) * torch.rand(20, 1) * 3  # [R, K]
    packed, scales, s_g = nvfp4_pack(x, 10.0)
    assert packed.shape == (20, 24) and packed.dtype == torch.uint8 and scales.shape == (20, 3)
    assert scales.dtype == torch.float8_e4m3fn
    assert torch.equal(nvfp4_unpack(packed, scales, s_g), nvfp4_fake_quant(x, 10.0))


def test_swizzled_block_scales_follow_the_cublas_layout():
    from flowrl.quant.nvfp4_kernels import swizzle_scales

    r, c = 130, 6  # padded to 256 x 8: two row tiles, two column tiles
    s = torch.arange(r * c, dtype=torch.float32).reshape(r, c)
    flat = swizzle_scales(s)
    assert flat.numel() == 256 * 8
    for i, j in [(0, 0), (1, 0), (0, 3), (33, 2), (127, 3), (128, 0), (129, 5), (64, 4)]:
        tile = (i // 128) * 2 + j // 4  # 2 column tiles per row of tiles
        offset = 512 * tile + (i % 32) * 16 + ((i % 128) // 32) * 4 + j % 4
        assert flat[offset] == s[i, j]
    assert flat.sum() == s.sum()  # the padding is zeros


def test_nvfp4_kernel_option_and_real_gemm_availability():
    from flowrl.quant.nvfp4_kernels import nvfp4_gemm_problem

    with pytest.raises(ValueError, match="kernel must be one of"):
        get_quantizer("nvfp4", require_available=False, kernel="te")
    assert "sm_100" in nvfp4_gemm_problem("cpu") or "float4" in nvfp4_gemm_problem("cpu")
    q = get_quantizer("nvfp4", require_available=False)
    if not torch.cuda.is_available():
        assert q.resolved_kernel() == "modelopt"


def test_kernel_labels():
    from flowrl.quant.kernels import display_label, kernel_info, tag_kernel

    assert kernel_info("full")["real_kernels"] and kernel_info("int8-dynamic:activation=static")["real_kernels"]
    assert not kernel_info("nvfp4-emulated")["real_kernels"] and not kernel_info("nvfp4")["real_kernels"]
    m = tag_kernel(torch.nn.Linear(2, 2), real=True, kernel="x")
    assert kernel_info("nvfp4", m) == {"real_kernels": True, "kernel": "x"}
    assert display_label("nvfp4", {"real_kernels": False}) == "nvfp4 (simulated)"
    assert display_label("fp8", {"real_kernels": True}) == "fp8"


# ------------------------------------------------------------------ registry and errors
def test_registry_names_status_and_errors():
    names = available_backends()
    assert {"none", "int8-dynamic", "nvfp4-emulated"} <= set(names)
    status = backend_status()
    assert set(status) == {"none", "int8-dynamic", "nvfp4-emulated", "nvfp4", "fp8"}
    with pytest.raises(ValueError, match="Valid quantization backends: fp8, int8-dynamic"):
        get_quantizer("int4")
    with pytest.raises(ValueError, match="valid options: activation, weight, skip"):
        get_quantizer("int8-dynamic", bits=4)
    if not torch.cuda.is_available():
        for name in ("nvfp4", "fp8"):
            assert "CUDA" in status[name]
            with pytest.raises(BackendUnavailable, match="work on this machine: .*int8-dynamic.*nvfp4-emulated"):
                get_quantizer(name)
    assert parse_backend_spec("int8-dynamic:activation=per_tensor") == ("int8-dynamic", {"activation": "per_tensor"})
    assert parse_backend_spec("fp8:simulate_on_cpu=true") == ("fp8", {"simulate_on_cpu": True})
    with pytest.raises(ValueError, match="key=value"):
        parse_backend_spec("int8-dynamic:per_tensor")


# ------------------------------------------------------------------ private copies
def _lora_policy(policy):
    from flowrl.trainable import add_lora

    add_lora(policy.transformer, 4, 8)
    with torch.no_grad():
        for n, p in policy.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    return policy


def _velocity_of(policy, module, x, s, c):
    with torch.no_grad(), swapped_transformer(policy, module):
        return policy.velocity(x, s, c)


def test_merged_copy_merges_lora_and_shares_nothing(tiny_digits_policy):
    pol = _lora_policy(tiny_digits_policy)
    x, s = pol.initial_noise([1, 2]), torch.tensor([0.6, 0.3])
    c = pol.encode_prompts(["a handwritten digit 3"] * 2)
    with torch.no_grad():
        v = pol.velocity(x, s, c)
    m = merged_copy(pol.transformer)
    assert not any("lora" in n for n, _ in m.named_parameters())
    assert torch.allclose(_velocity_of(pol, m, x, s, c), v, atol=1e-5)
    ptrs = {t.data_ptr() for t in list(pol.transformer.parameters()) + list(pol.transformer.buffers())}
    assert not any(t.data_ptr() in ptrs for t in list(m.parameters()) + list(m.buffers()))
    with torch.no_grad():  # mutating the copy leaves the policy alone
        for p in m.parameters():
            p.add_(1.0)
        assert torch.equal(pol.velocity(x, s, c), v)


def _calibrator(policy, prompts, seeds, steps=2):
    def calibrate(module):
        with torch.no_grad(), swapped_transformer(policy, module):
            ode_sample(policy, prompts, seeds, steps)
    return calibrate


def test_quantized_copy_resyncs_only_after_an_update(tiny_digits_policy):
    pol = _lora_policy(tiny_digits_policy)
    prompts, seeds = ["a handwritten digit 1"] * 2, [5, 6]
    qc = QuantizedCopy(get_quantizer("nvfp4-emulated", engine="torch"))
    assert qc.sync(pol.transformer, _calibrator(pol, prompts, seeds)) > 0 and qc.syncs == 1
    assert qc.sync(pol.transformer, _calibrator(pol, prompts, seeds)) == 0.0 and qc.syncs == 1
    first = qc.module
    params = [p for p in pol.transformer.parameters() if p.requires_grad]
    x, s, c = pol.initial_noise(seeds), torch.tensor([0.5, 0.5]), pol.encode_prompts(prompts)
    opt = torch.optim.SGD(params, lr=0.1)
    pol.velocity(x, s, c).pow(2).mean().backward()
    opt.step()
    assert qc.stale(pol.transformer)
    assert qc.sync(pol.transformer, _calibrator(pol, prompts, seeds)) > 0 and qc.syncs == 2
    assert qc.module is not first and qc.total_sync_seconds >= qc.last_sync_seconds > 0
    pol.transformer.disable_adapters()  # an adapter switch changes the function: stale too
    assert qc.stale(pol.transformer)
    pol.transformer.enable_adapters()


def test_calibrated_backends_need_calibration(tiny_digits_policy):
    tr = tiny_digits_policy.transformer
    with pytest.raises(ValueError, match="pass calibrate"):
        get_quantizer("nvfp4-emulated", engine="torch").quantize(tr, None)
    with pytest.raises(ValueError, match="saw no calibration data"):
        get_quantizer("nvfp4-emulated", engine="torch").quantize(tr, lambda m: None)
    assert get_quantizer("int8-dynamic", activation="static").needs_calibration
    assert not get_quantizer("int8-dynamic").needs_calibration
    with pytest.raises(ValueError, match="pass calibrate"):
        get_quantizer("int8-dynamic", activation="static").quantize(tr, None)
    with pytest.raises(RuntimeError, match="saw no calibration data"):
        get_quantizer("int8-dynamic", activation="static").quantize(tr, lambda m: None)


# ------------------------------------------------------------------ batch independence
PROMPTS = [f"a handwritten digit {d}" for d in range(8)]
SEEDS = derive_seeds(3, 8)


def _x0(policy, module, idx, steps=3):
    with torch.no_grad(), swapped_transformer(policy, module):
        return ode_sample(policy, [PROMPTS[i] for i in idx], [SEEDS[i] for i in idx], steps)[0]


BATCH_BACKENDS = [("none", {}), ("int8-dynamic", {}), ("int8-dynamic", {"activation": "static"}),
                  ("nvfp4-emulated", {"engine": "torch"})]
if HAS_MODELOPT:
    BATCH_BACKENDS.append(("nvfp4-emulated", {"engine": "modelopt"}))


@pytest.mark.parametrize("name,opts", BATCH_BACKENDS, ids=lambda v: str(v))
def test_sample_does_not_depend_on_its_batch(tiny_digits_policy, name, opts):
    pol = tiny_digits_policy
    q = get_quantizer(name, **opts).quantize(pol.transformer, _calibrator(pol, PROMPTS[:4], SEEDS[:4]))
    a = _x0(pol, q, [0, 1, 2, 3])  # seeds 0, 1 with batch-mates 2, 3 ...
    b = _x0(pol, q, [0, 1, 6, 7])  # ... or with 6, 7: bit-identical
    assert torch.equal(a[:2], b[:2])
    c = _x0(pol, q, [0, 1, 2, 3, 4, 5, 6, 7])  # another batch size: equal up to fp32 GEMM blocking
    assert torch.allclose(a, c[:4], atol=1e-5, rtol=0)


def test_torch_ao_per_tensor_scale_couples_batch_mates(tiny_digits_policy):
    """Why int8-dynamic quantizes per row: torch.ao's tensor-wide activation scale makes a
    sample depend on what else is in its batch."""
    pol = tiny_digits_policy
    q = get_quantizer("int8-dynamic", activation="per_tensor").quantize(pol.transformer, None)
    a, b = _x0(pol, q, [0, 1, 2, 3]), _x0(pol, q, [0, 1, 6, 7])
    assert (a[:2] - b[:2]).abs().max() > 1e-4


@needs_modelopt
def test_emulated_engines_agree_bitwise(tiny_digits_policy):
    pol = tiny_digits_policy
    cal = _calibrator(pol, PROMPTS[:4], SEEDS[:4])
    qt = get_quantizer("nvfp4-emulated", engine="torch").quantize(pol.transformer, cal)
    qm = get_quantizer("nvfp4-emulated", engine="modelopt").quantize(pol.transformer, cal)
    idx = [0, 1, 2, 3, 4]
    assert torch.equal(_x0(pol, qt, idx), _x0(pol, qm, idx))
    assert not torch.equal(_x0(pol, qt, idx), _x0(pol, pol.transformer, idx))  # it does quantize


def test_int8_dynamic_linear_close_to_fp32():
    from flowrl.quant.int8 import DynamicInt8Linear

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    x = torch.randn(5, 7, 64)  # [B, L, D]
    y = lin(x)
    for mode in ("per_row", "per_tensor", "static"):
        q = DynamicInt8Linear(lin, activation=mode)
        if mode == "static":
            q(x)  # calibration pass: full precision
            q.finish_calibration()
        assert (q(x) - y).abs().max() < 0.03 * y.abs().max()
    q = DynamicInt8Linear(lin)
    assert torch.equal(q(x[:2]), q(x)[:2])  # per row: independent of the other rows


# ------------------------------------------------------------------ fidelity metrics
def test_fidelity_metrics_match_hand_values():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert kendall_tau(x, x) == 1.0 and kendall_tau(x, -x) == -1.0
    # one discordant pair of six: (6 - 2) / 6
    assert kendall_tau(x, torch.tensor([1.0, 3.0, 2.0, 4.0])) == pytest.approx(4 / 6)
    # tau-b with a tie in y: C = 5, D = 0, one pair tied in y: 5 / sqrt(6 * 5)
    assert kendall_tau(x, torch.tensor([1.0, 2.0, 2.0, 4.0])) == pytest.approx(5 / 30**0.5)
    assert spearman(x, torch.tensor([1.0, 3.0, 2.0, 4.0])) == pytest.approx(0.8)
    assert topk_hit_rate(x, torch.tensor([4.0, 3.0, 2.0, 1.0]), 2) == 0.0
    assert topk_hit_rate(x, torch.tensor([1.0, 5.0, 2.0, 4.0]), 2) == 0.5
    fid = ranking_fidelity(torch.cat([x, x]), torch.cat([x, -x]), torch.tensor([0] * 4 + [1] * 4), k=2)
    assert fid["kendall_tau"] == 0.0 and fid["groups"] == 2 and fid["topk_hit_rate"] == 0.5


# ------------------------------------------------------------------ protocol and benchmark
def test_backends_follow_the_quantizer_protocol():
    from flowrl.types import Quantizer

    for name in available_backends():
        q = get_quantizer(name)
        assert isinstance(q, Quantizer) and q.name == name and q.available()


def test_bench_precision_smoke(tiny_digits_policy, tmp_path):
    import argparse
    import json

    from flowrl.bench.precision import bench_precision
    from flowrl.bench.precision_cli import add_precision_parser

    out = bench_precision("digits", ["int8-dynamic", "nvfp4-emulated:engine=torch"], tmp_path / "p.json",
                          policy=tiny_digits_policy, batch=4, steps=2, repeats=1, seeds_per_prompt=3,
                          prompts=["a handwritten digit 1", "a handwritten digit 2"], fidelity_steps=[2], ref_steps=3,
                          topk=2, reward="jpeg_compressibility", verbose=False)
    saved = json.loads((tmp_path / "p.json").read_text())
    assert (tmp_path / "p.png").is_file() and list(saved["backends"]) == ["full", "int8-dynamic",
                                                                          "nvfp4-emulated:engine=torch"]
    for r in out["backends"].values():
        assert r["images_per_second"] > 0 and "2" in r["fidelity"] and r["model_mb"] > 0
        assert r["batch_check"]["max_abs_reward_change"] == 0.0  # batch-independent backends
    assert out["backends"]["full"]["speedup_vs_full"] == 1.0
    emu, i8 = out["backends"]["nvfp4-emulated:engine=torch"], out["backends"]["int8-dynamic"]
    assert saved["backends"]["nvfp4-emulated:engine=torch"]["real_kernels"] is False and i8["real_kernels"] is True
    assert emu["label"] == "nvfp4-emulated:engine=torch (simulated)" and i8["label"] == "int8-dynamic"
    from flowrl.bench.precision_report import format_table

    table = format_table(out)
    assert "nvfp4-emulated:engine=torch (simulated)" in table and "* simulated" in table
    rows = {line.split()[0]: line for line in table.splitlines()[2:5]}
    assert f"{emu['speedup_vs_full']:.3f}*" in rows["nvfp4-emulated:engine=torch"] and "*" not in rows["int8-dynamic"]
    parser = argparse.ArgumentParser()
    add_precision_parser(parser.add_subparsers())
    a = parser.parse_args(["precision", "--pipeline", "sd3-mid", "--backends", "full,int8-dynamic", "--json", "x.json"])
    assert a.pipeline == "sd3-mid" and a.backends == "full,int8-dynamic" and callable(a.fn)
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailable, match="nvfp4-emulated"):
            bench_precision("digits", ["nvfp4"], None, policy=tiny_digits_policy)


@needs_modelopt
def test_modelopt_nvfp4_config_skips_embedders_and_output(tiny_digits_policy):
    """The CUDA nvfp4 backend's config, calibrated on the CPU (NVFP4 forward itself needs CUDA):
    Linear layers of the blocks are quantized, embedders / output layers / norms are not."""
    from flowrl.quant.modelopt_support import mtq_quantize
    from flowrl.quant.nvfp4 import NVFP4Quantizer

    pol = tiny_digits_policy
    q = mtq_quantize(pol.transformer, NVFP4Quantizer().config(), _calibrator(pol, PROMPTS[:2], SEEDS[:2]))
    on = {n.rsplit(".", 1)[0] for n, m in q.named_modules() if n.endswith("_quantizer") and m.is_enabled}
    assert "transformer_blocks.0.attn.to_q" in on and "transformer_blocks.0.ff.net.2" in on
    assert not any(k in n for n in on for k in ("pos_embed", "time_text_embed", "context_embedder", "norm_out"))
    assert "proj_out" not in on and not any(n.endswith("norm") or ".norm2" in n for n in on)
    wq = [m for n, m in q.named_modules() if n.endswith("weight_quantizer") and m.is_enabled]
    assert wq and all(m.num_bits == (2, 1) for m in wq)


@needs_modelopt
def test_fp8_simulated_on_cpu(tiny_digits_policy):
    pol = tiny_digits_policy
    q = get_quantizer("fp8", simulate_on_cpu=True).quantize(pol.transformer, _calibrator(pol, PROMPTS[:4], SEEDS[:4]))
    a, b = _x0(pol, q, [0, 1, 2, 3]), _x0(pol, q, [0, 1, 6, 7])
    assert torch.equal(a[:2], b[:2])  # static calibrated per-tensor scales: batch-independent
    full = _x0(pol, pol.transformer, [0, 1, 2, 3])
    assert 0 < (a - full).abs().max() < 0.1


# ------------------------------------------------------------------ CUDA backends (run on a GPU machine)
needs_cuda_modelopt = pytest.mark.skipif(not (HAS_MODELOPT and torch.cuda.is_available()),
                                         reason="nvfp4 / fp8 through nvidia-modelopt run on CUDA only (no GPU here)")


@needs_cuda_modelopt
@pytest.mark.parametrize("backend", ["nvfp4", "fp8"])
def test_cuda_backends_quantize_close_and_batch_independent(backend):
    """On a CUDA machine: the modelopt backends quantize a private copy whose samples stay near full
    precision and do not depend on their batch-mates (static calibrated scales)."""
    from diffusers import SD3Transformer2DModel

    from flowrl.pipelines.digits import DigitsPolicy, DigitTextEncoder, tiny_transformer_config

    torch.manual_seed(0)
    pol = DigitsPolicy(SD3Transformer2DModel(**{**tiny_transformer_config(), "num_layers": 1}).eval(),
                       DigitTextEncoder().eval(), device="cuda")
    q = get_quantizer(backend).quantize(pol.transformer, _calibrator(pol, PROMPTS[:4], SEEDS[:4]))
    assert q is not pol.transformer
    a, b = _x0(pol, q, [0, 1, 2, 3]), _x0(pol, q, [0, 1, 6, 7])
    assert torch.equal(a[:2], b[:2])
    full = _x0(pol, pol.transformer, [0, 1, 2, 3])
    assert 0 < (a - full).abs().max() < 0.2
