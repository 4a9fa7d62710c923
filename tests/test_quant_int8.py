"""int8-dynamic (flowrl.quant.int8) by hand: every kernel (oneDNN, fbgemm, the sentinel fallback)
against quantization computed here in float64, batch independence bit for bit, odd shapes,
every mode."""
import copy
import threading

import pytest
import torch
from torch import nn

from flowrl.quant import get_quantizer
from flowrl.quant.int8 import ACTIVATION_MODES, WEIGHT_MODES, DynamicInt8Linear
from flowrl.quant.int8_kernels import KERNELS, LEVELS, SharedInput, kernel_available

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not get_quantizer("int8-dynamic").available(),
                                 reason="no fbgemm dynamic int8 Linear in this torch build")]
FIXED_SCALE = [k for k in ("onednn", "fbgemm") if kernel_available(k)]  # the kernels that run here
WORKING = [k for k in KERNELS if kernel_available(k)]


def _linear(i: int, o: int, bias: bool = True, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(i, o, bias=bias)
    with torch.no_grad():
        lin.weight.mul_(torch.linspace(0.2, 3.0, o)[:, None])  # output channels of different ranges
    return lin


def _weight_codes(lin: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-output-channel symmetric int8 by hand: codes [O, I] and scales [O] (float64)."""
    w = lin.weight.detach().double()
    s = (w.abs().amax(dim=1) / 127.0).float().double()  # the float32 scale the layer computes
    return torch.round(w / s[:, None]).clamp(-127, 127), s


def _per_row_reference(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """Row i quantized with step amax_i / 63 to codes in [-63, 63], int x int products summed
    exactly in float64, rescaled by (row step) x (channel scale), plus the bias."""
    x2 = x.reshape(-1, x.shape[-1])
    a = x2.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)  # [N, 1] float32
    xn = x2 * a.reciprocal()  # float32, as the layer scales the rows
    qx = torch.round(xn.double() * LEVELS)  # [N, I] codes
    qw, s = _weight_codes(lin)
    y = (qx @ qw.t()) * (a.double() / LEVELS) * s[None, :]  # integer matmul (exact in float64), rescale
    if lin.bias is not None:
        y = y + lin.bias.detach().double()
    return y.reshape(*x.shape[:-1], lin.out_features)


def _error_bound(lin: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """|y_int8 - x W^T| <= sum_k |x_k - x~_k| |w_k| + |x_k| |w_k - w~_k|: half a step each."""
    x2 = x.reshape(-1, x.shape[-1]).double()
    w = lin.weight.detach().double()
    _, s = _weight_codes(lin)
    a = x2.abs().amax(dim=1, keepdim=True)
    return (a / LEVELS / 2) * w.abs().sum(dim=1)[None, :] + x2.abs() @ (s[:, None] / 2).expand_as(w).t()


# ------------------------------------------------------------------ numerics by hand
@pytest.mark.parametrize("kernel", FIXED_SCALE)
@pytest.mark.parametrize("shape,i,o,bias", [((5, 64), 64, 48, True), ((3, 7, 13), 13, 9, True),
                                            ((2, 4, 100), 100, 33, False), ((1, 3), 3, 1, True)])
def test_per_row_matches_hand_quantization(shape, i, o, bias, kernel):
    lin = _linear(i, o, bias)
    torch.manual_seed(1)
    x = torch.randn(shape) * torch.logspace(-3, 2, shape[-2] if len(shape) > 1 else 1)[:, None]  # rows of any size
    q = DynamicInt8Linear(lin, kernel=kernel)
    assert q.kernel == kernel
    y = q(x)
    ref = _per_row_reference(lin, x)
    scale = ref.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    assert y.shape == (*shape[:-1], o) and y.dtype == torch.float32
    assert ((y.double() - ref).abs() / scale).max() < 1e-5  # same codes, fp32 epilogue rounding only
    exact = lin(x).double()
    assert ((y.double() - exact).abs() <= _error_bound(lin, x).reshape(ref.shape) * 1.001 + 1e-6).all()


@pytest.mark.parametrize("kernel", FIXED_SCALE)
def test_static_matches_hand_quantization_and_clamps(kernel):
    lin = _linear(24, 10)
    torch.manual_seed(2)
    cal = torch.randn(6, 24)
    q = DynamicInt8Linear(lin, activation="static", kernel=kernel)
    assert torch.equal(q(cal), lin(cal))  # calibration pass: full precision
    q.finish_calibration()
    amax = float(cal.abs().max())
    x = torch.randn(5, 24) * 1.5  # some entries beyond the calibrated range: clamped
    y = q(x)
    step = amax / LEVELS
    qx = torch.round(x.clamp(-amax, amax).double() / step)  # codes in [-63, 63]
    qw, s = _weight_codes(lin)
    ref = (qx @ qw.t()) * step * s[None, :] + lin.bias.detach().double()
    assert ((y.double() - ref).abs() / ref.abs().max()).max() < 1e-5


def test_modes_close_to_fp32_and_bias_free():
    lin = _linear(40, 24, bias=False)
    x = torch.randn(3, 5, 40)
    y = lin(x)
    for act in ACTIVATION_MODES:
        for wmode in WEIGHT_MODES:
            q = DynamicInt8Linear(lin, act, wmode)
            if act == "static":
                q(x)
                q.finish_calibration()
            assert (q(x) - y).abs().max() < 0.05 * y.abs().max(), (act, wmode)


# ------------------------------------------------------------------ batch independence, bit for bit
@pytest.mark.parametrize("kernel", WORKING)
@pytest.mark.parametrize("activation", ["per_row", "static"])
def test_rows_do_not_depend_on_batch_mates(kernel, activation):
    lin = _linear(37, 29)
    q = DynamicInt8Linear(lin, activation, kernel=kernel)
    torch.manual_seed(3)
    x = torch.randn(4, 9, 37)  # [B, L, D]
    if activation == "static":
        q(x)
        q.finish_calibration()
    mates = torch.randn(3, 9, 37) * 1000.0  # wildly different batch-mates
    alone = q(x[:2])
    assert torch.equal(q(torch.cat([x[:2], mates])[:2].contiguous()), alone)
    assert torch.equal(q(torch.cat([x[:2], mates]))[:2], alone)
    assert torch.equal(q(torch.cat([mates[:1], x[:2]]))[1:], alone)
    assert torch.equal(q(x)[:2], alone)


@pytest.mark.parametrize("activation", ["per_row", "static"])
def test_kernels_agree(activation):
    """oneDNN, fbgemm and the sentinel fallback quantize the same codes: outputs agree to fp32
    rounding (the sentinel path rounds 2 * amax / 127-steps, so only close)."""
    lin = _linear(64, 40)
    x = torch.randn(2, 9, 64)
    outs = {}
    for k in WORKING:
        q = DynamicInt8Linear(lin, activation, kernel=k)
        if activation == "static":
            q(x)
            q.finish_calibration()
        outs[k] = q(x)
    ref = lin(x)
    for k, y in outs.items():
        assert (y - ref).abs().max() < 0.03 * ref.abs().max(), k
    if len(FIXED_SCALE) == 2:
        assert torch.allclose(outs["onednn"], outs["fbgemm"], rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_unknown_or_missing_kernel_is_a_clear_error():
    with pytest.raises(ValueError, match="kernel must be 'auto' or one of"):
        get_quantizer("int8-dynamic", kernel="cublas")
    with pytest.raises(ValueError, match="kernel must be 'auto' or one of"):
        DynamicInt8Linear(_linear(4, 4), kernel="cublas")


def test_per_tensor_couples_batch_mates():
    lin = _linear(37, 29)
    q = DynamicInt8Linear(lin, "per_tensor")
    x = torch.randn(2, 37)
    assert not torch.equal(q(torch.cat([x, 1000.0 * torch.randn(1, 37)]))[:2], q(x))


# ------------------------------------------------------------------ odd shapes and inputs
@pytest.mark.parametrize("kernel", WORKING)
@pytest.mark.parametrize("activation", ACTIVATION_MODES)
def test_zero_rows_zero_inputs_and_dtypes(activation, kernel):
    lin = _linear(13, 7)
    q = DynamicInt8Linear(lin, activation, kernel=kernel)
    if activation == "static":
        q(torch.randn(4, 13))
        q.finish_calibration()
    assert q(torch.empty(0, 13)).shape == (0, 7)
    assert q(torch.empty(2, 0, 13)).shape == (2, 0, 7)
    z = q(torch.zeros(3, 13))  # all-zero rows: exactly the bias (no 0/0)
    assert torch.isfinite(z).all()
    if activation != "per_tensor":
        assert torch.allclose(z, lin.bias.detach().expand(3, 7), atol=1e-6)
    xb = torch.randn(2, 3, 13, dtype=torch.bfloat16)
    yb = q(xb)
    assert yb.dtype == torch.bfloat16 and yb.shape == (2, 3, 7)
    xt = torch.randn(13, 6).t()  # non-contiguous input
    assert torch.allclose(q(xt), q(xt.contiguous()))


def test_inference_mode_and_grad_inputs():
    lin = _linear(16, 8)
    q = DynamicInt8Linear(lin)
    x = torch.randn(4, 16)
    want = q(x)
    with torch.inference_mode():
        xi = x.clone()
        assert torch.equal(q(xi), want)
        assert torch.equal(q(xi), want)  # inference tensors are never memoized
    assert torch.equal(q(x.clone().requires_grad_()), want)


# ------------------------------------------------------------------ the shared memo and workspace
def test_layers_fed_the_same_tensor_share_its_preparation_safely():
    shared = SharedInput()
    la, lb = DynamicInt8Linear(_linear(32, 16, seed=1), shared=shared), DynamicInt8Linear(_linear(32, 8, seed=2),
                                                                                            shared=shared)
    x = torch.randn(6, 32)
    ya, yb = la(x), lb(x)  # lb reuses la's scaled rows
    assert shared.get(x, "row") is not None
    assert torch.equal(ya, la(x.clone())) and torch.equal(yb, lb(x.clone()))
    lb(x)
    x.mul_(3.0)  # modified in place: the memo must not match any more
    assert shared.get(x, "row") is None
    assert torch.equal(lb(x), lb(x.clone()))
    v = x.view(3, 64)  # another tensor object over the same memory: not matched either
    assert shared.get(v, "row") is None
    other = DynamicInt8Linear(_linear(64, 4), shared=shared)
    y_other = other(v)  # reuses (overwrites) the workspace
    assert torch.equal(la(x), la(x.clone())) and torch.equal(y_other, other(v.clone()))


def test_threads_sharing_a_copy_get_their_own_results():
    model = nn.Sequential(nn.Linear(48, 64), nn.GELU(), nn.Linear(64, 16))
    q = get_quantizer("int8-dynamic").quantize(model)
    xs = [torch.randn(5, 48) * (i + 1) for i in range(4)]
    want = [q(x) for x in xs]
    got: dict[int, list] = {}

    def work(i):
        got[i] = [q(xs[i]) for _ in range(20)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(torch.equal(y, want[i]) for i in range(4) for y in got[i])


def test_thread_counts_restored_on_every_thread():
    """The element-wise passes run single-threaded on the main thread; the intra-op thread
    count is restored after, and a layer run on another thread changes no thread's count."""
    q = DynamicInt8Linear(_linear(16, 8))
    s = DynamicInt8Linear(_linear(16, 8), "static")
    s(torch.randn(3, 16))
    s.finish_calibration()
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        q(torch.randn(3, 16)), s(torch.randn(3, 16))
        assert torch.get_num_threads() == 2
        seen = {}

        def work():
            seen["before"] = torch.get_num_threads()
            for _ in range(50):
                q(torch.randn(3, 16)), s(torch.randn(3, 16))
            seen["after"] = torch.get_num_threads()

        t = threading.Thread(target=work)
        t.start()
        t.join()
        assert seen["after"] == seen["before"] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(n)



# ------------------------------------------------------------------ the quantizer, every mode
class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj_in = nn.Linear(12, 20)
        self.to_q, self.to_k = nn.Linear(20, 20), nn.Linear(20, 20, bias=False)
        self.proj_out = nn.Linear(20, 5)  # in the default skip-list

    def forward(self, x):
        h = self.proj_in(x)
        return self.proj_out(torch.tanh(self.to_q(h) * self.to_k(h)))


@pytest.mark.parametrize("weight", WEIGHT_MODES)
@pytest.mark.parametrize("activation", ACTIVATION_MODES)
def test_every_mode_quantizes_and_runs(activation, weight):
    torch.manual_seed(4)
    model = _Tiny().eval()
    x = torch.randn(3, 7, 12)
    quantizer = get_quantizer("int8-dynamic", activation=activation, weight=weight)
    q = quantizer.quantize(model, (lambda m: m(x)) if quantizer.needs_calibration else None)
    assert isinstance(q.to_q, DynamicInt8Linear) and isinstance(q.proj_out, nn.Linear)
    assert q.to_q.shared is q.to_k.shared is q.proj_in.shared
    with torch.no_grad():
        y, ref = q(x), model(x)
    assert y.shape == ref.shape and (y - ref).abs().max() < 0.1 * ref.abs().max()
    assert isinstance(model.to_q, nn.Linear)  # the source is untouched
    q2 = copy.deepcopy(q)  # copies get their own scratch
    assert q2.to_q.shared is q2.to_k.shared and q2.to_q.shared is not q.to_q.shared
    with torch.no_grad():
        assert torch.equal(q2(x), y)


# ------------------------------------------------------------------ video and image adapters
@pytest.mark.parametrize("kind", ["wan", "qwen-image"])
def test_adapter_transformers_quantize_and_run(kind):
    """int8-dynamic on the tiny Wan2.1 and Qwen-Image transformers: the quantized copy runs the
    policy's velocity (Wan's condition_embedder stays in full precision: its forward reads the time
    embedder's parameter dtype) and stays close to the full-precision velocity."""
    from flowrl.pipelines import policy_class
    from flowrl.pipelines.tiny import tiny_pipeline
    from flowrl.quant.sync import QuantizedCopy

    policy = policy_class(kind)(tiny_pipeline(kind, image_size=32), max_sequence_length=8, resolution=32)
    copy_ = QuantizedCopy(get_quantizer("int8-dynamic"))
    copy_.sync(policy.transformer)
    swapped = [n for n, m in copy_.module.named_modules() if isinstance(m, DynamicInt8Linear)]
    assert swapped and not [n for n in swapped if "condition_embedder" in n or "time_text_embed" in n]
    cond = policy.encode_prompts(["a red car", "a cat"])
    x = policy.initial_noise([1, 2])
    with torch.no_grad():
        ref = policy.velocity(x, 0.6, cond)
        with copy_.active(policy):
            v = policy.velocity(x, 0.6, cond)
    assert v.shape == ref.shape and torch.isfinite(v).all()
    assert (v - ref).abs().max() < 0.1 * ref.abs().max()
