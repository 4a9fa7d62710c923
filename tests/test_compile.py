"""model.compile (flowrl.utils.compile): the compiled rollout forward equals the eager one, keeps the module's
weights, names and gradients, is left by training, counts its recompiles; three digits iterations recompile only
in the first; Sol-RL's compiled exploration copy re-syncs in place; bench precision --compile's JSON.

Compiling on a CPU: inductor generates and builds C++ (a tiny model's graph takes 15-40 s on a busy 2-core
machine, each new shape again), so one case runs inductor (the digits model, sampling equal to eager) and the
others ``FLOWRL_COMPILE_BACKEND=aot_eager``: dynamo's capture, guards and recompiles and the AOT graph, without
code generation. Tolerance: float32 round-off of a reassociated graph, rtol 1e-4 / atol 1e-5 on the latents
after three ODE steps (inductor measured 2e-6 at most here; aot_eager is bit-equal).
"""
import copy
import json

import pytest
import torch
from torch import nn

from conftest import tiny_train_overrides
from flowrl.errors import ConfigError
from flowrl.rollout.ode import ode_sample
from flowrl.utils.compile import (BACKEND_ENV, CompileLog, check_mode, compile_rollouts, compiled_forward,
                                  eager_forwards, load_in_place)
from helpers import train_records

pytestmark = pytest.mark.usefixtures("one_thread")
TOL = dict(rtol=1e-4, atol=1e-5)
DIGITS = [f"a handwritten digit {d}" for d in (3, 7)]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test starts without compiled graphs (dynamo's cache is process-wide: another test's graph of the same
    shape would be reused and compile nothing)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def aot_eager(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "aot_eager")


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_compiled_forward_runs_rollouts_only_and_counts_recompiles(aot_eager):
    torch.manual_seed(0)
    m, x = Tiny(), torch.randn(4, 8)
    names = list(m.state_dict())
    log = compile_rollouts(m, "default")
    assert list(m.state_dict()) == names and compiled_forward(m).backend == "aot_eager"  # in place: same names
    with torch.no_grad():
        y = m(x)
        m.a.weight.mul_(2.0)  # an optimizer step or a re-sync: in place
        y2 = m(x)
        with eager_forwards():
            y3 = m(x)
    assert (log.compiles, log.recompiles) == (1, 0)  # the weight change ran the same graph
    torch.testing.assert_close(y2, m._call_impl(x), rtol=0, atol=0)
    assert not torch.equal(y, y2) and torch.equal(y2, y3)
    m(x).sum().backward()  # a differentiable forward: eager, nothing compiled
    assert m.a.weight.grad is not None and log.compiles == 1
    with torch.no_grad():
        m(torch.randn(2, 8))
    assert log.recompiles == 1 and "size mismatch" in log.events[0][1]  # a new batch: one more graph, its cause
    with torch.no_grad(), eager_forwards(False):  # off: the compiled forward runs (a third batch size, a graph)
        m(torch.randn(3, 8))
    with torch.no_grad(), eager_forwards(True):  # on: eager (a fourth size, no graph)
        m(torch.randn(5, 8))
    assert log.recompiles == 2
    assert compiled_forward(copy.deepcopy(m)) is None  # a copy of other weights is eager
    compile_rollouts(m, "off")
    assert compiled_forward(m) is None
    with pytest.raises(ValueError, match="must be one of off, default, reduce-overhead, max-autotune"):
        check_mode("fast")


def test_a_recompile_after_the_first_unit_is_one_warning_line(capsys):
    log = CompileLog()
    log.record("policy", 1.0, "")
    log.record("policy", 1.0, "tensor 'x' size mismatch at index 0. expected 20, actual 16")
    assert log.after_unit("iteration", 0, 0) == 1 and capsys.readouterr().err == ""  # the first unit compiles shapes
    log.record("exploration", 1.0, "")  # a role's first compile is not a recompile
    log.record("policy", 1.0, "tensor 'x' size mismatch at index 0. expected 16, actual 12")
    assert (log.compiles, log.recompiles) == (2, 2) and log.after_unit("iteration", 4, 0) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("[flowrl] WARNING: iteration 4: the compiled transformer forward "
                                               "(policy) recompiled: tensor 'x' size mismatch")
    assert log.after_unit("iteration", 5, 0) == 2 and capsys.readouterr().err == ""  # each said once


def test_load_in_place_copies_tensors_and_refuses_another_layout():
    from flowrl.quant.fp8_linear import FP8Linear

    torch.manual_seed(0)
    lin = nn.Linear(32, 16)
    a, b = FP8Linear(lin, 2.0), FP8Linear(nn.Linear(32, 16), 8.0)
    col = a._scale_a(4)  # cached [M, 1] input scale
    assert load_in_place(a, b) and torch.equal(a.qweight.float(), b.qweight.float())
    assert float(a._scale_a(4)[0, 0]) == float(b.input_scale) != float(col[0, 0])  # the cache follows the copy
    assert not load_in_place(a, FP8Linear(nn.Linear(32, 32), 1.0))  # another shape: nothing copied
    assert float(a.input_scale) == float(b.input_scale)


def _policy(name, tiny_model, tiny_digits_policy):
    from flowrl.pipelines import build_policy

    if name == "digits":
        return tiny_digits_policy, DIGITS
    opts = {"max_sequence_length": 8, "dtype": "float32", "resolution": 32, **({"num_frames": 5} if name == "wan" else {})}
    return build_policy(name, str(tiny_model(name)), device="cpu", **opts), ["a photo of a cat", "a red apple"]


@pytest.mark.parametrize("name,backend", [("digits", "inductor"), ("sd3", "aot_eager"), ("flux", "aot_eager"),
                                          ("qwen-image", "aot_eager"), ("wan", "aot_eager")])
def test_compiled_sampling_equals_eager(name, backend, tiny_model, tiny_digits_policy, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, backend)
    policy, prompts = _policy(name, tiny_model, tiny_digits_policy)
    with torch.no_grad():
        eager, _ = ode_sample(policy, prompts, [1, 2], 3)
    log = compile_rollouts(policy.transformer, "default")
    with torch.no_grad():
        compiled, _ = ode_sample(policy, prompts, [1, 2], 3)
    assert (log.compiles, log.recompiles) == (1, 0)  # the compiled forward ran: one graph for the three steps
    torch.testing.assert_close(compiled, eager, **TOL)


def test_three_digits_iterations_recompile_only_in_the_first(tiny_digits_dir, tmp_path, aot_eager, capsys):
    """recipes/digits.yaml with model.compile=default: the evaluation's batch (20 rows) and the rollout's (16) are
    two graphs, both made in iteration 0; the update runs eagerly, so its changing minibatches compile nothing."""
    from flowrl.trainers.config import load_config
    from flowrl.trainers.online import train

    cfg = load_config("recipes/digits.yaml", tiny_train_overrides(tiny_digits_dir, **{"model.compile": "default"}))
    train(cfg, tmp_path / "run")
    recs = train_records(tmp_path / "run")
    assert [r["iteration"] for r in recs] == [0, 1, 2]
    assert [r["compile/recompiles"] for r in recs] == [1, 1, 1]
    assert abs(recs[0]["ratio_mean"] - 1) < 1e-4  # compiled rollout, eager update: the same log-probs
    assert "recompiled" not in capsys.readouterr().err


class Brightness:
    name = "brightness"

    def __call__(self, images, prompts, **meta):
        return images.float().mean(dim=(1, 2, 3))


def test_compiled_exploration_copy_resyncs_in_place(tiny_digits_policy, aot_eager):
    from flowrl.quant import get_quantizer
    from flowrl.rollout.sol import SolSampler
    from flowrl.trainable import add_lora

    pol = tiny_digits_policy
    add_lora(pol.transformer, 4, 8)
    log = compile_rollouts(pol.transformer, "default")
    sol = SolSampler(explore_backend="fp8:simulate_on_cpu=true", pool_size=4, keep=2, preview_steps=2, regen="ode",
                     regen_options={"num_steps": 2}, calibration_seeds=1)
    first = sol(pol, DIGITS, Brightness(), seed=1)
    held = sol.exploration_copy.module
    assert compiled_forward(held).role == "exploration" and (log.compiles, log.recompiles) == (2, 0)
    with torch.no_grad():
        for n, p in pol.transformer.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)  # an update, in place
    after = sol(pol, DIGITS, Brightness(), seed=1)
    assert after.stats["sol/syncs"] == 2 and sol.exploration_copy.module is held  # re-synced into the same copy
    assert (log.compiles, log.recompiles) == (2, 0)  # nothing recompiled
    assert not torch.equal(after.layout.explore_rewards, first.layout.explore_rewards)
    fresh = get_quantizer("fp8", simulate_on_cpu=True).quantize(pol.transformer, sol._calibrate_fn(pol, DIGITS))
    ours, theirs = held.state_dict(), fresh.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k].float(), theirs[k].float()) for k in ours)


def test_bench_precision_puts_eager_and_compiled_side_by_side(tiny_digits_policy, tmp_path, aot_eager):
    import argparse

    from flowrl.bench.precision import bench_precision
    from flowrl.bench.precision_cli import add_precision_parser
    from flowrl.bench.precision_report import format_table

    specs = ["full", "fp8:simulate_on_cpu=true", "int8-dynamic"]
    out = bench_precision("digits", specs, tmp_path / "c.json", policy=tiny_digits_policy, batch=4, steps=2,
                          repeats=1, seeds_per_prompt=0, compile="default", verbose=False)
    saved = json.loads((tmp_path / "c.json").read_text())
    assert saved["settings"]["compile"] == "default" and list(saved["backends"]) == specs
    for spec in specs[:2]:
        e, c = saved["backends"][spec], saved["backends"][spec]["compiled"]
        assert (c["mode"], c["backend"], c["compiles"], c["recompiles"], c["recompiles_timed"]) == (
            "default", "aot_eager", 1, 0, 0)
        assert e["forward_ms"] > 0 and c["forward_ms"] > 0 and c["images_per_second"] > 0 and c["compile_seconds"] > 0
        assert c["speedup_vs_eager"] == pytest.approx(e["seconds_per_batch"] / c["seconds_per_batch"])
        assert c["speedup_vs_full"] > 0 and c["speedup_vs_full_compiled"] > 0 and c["forward_speedup_vs_eager"] > 0
        assert c["velocity_rel_error_vs_eager"] < 1e-5 and c["velocity_rel_error"] == pytest.approx(
            e["velocity_rel_error"], abs=1e-5)
    assert saved["backends"]["full"]["velocity_rel_error"] == 0 < saved["backends"][specs[1]]["velocity_rel_error"]
    assert "compiled" not in saved["backends"]["int8-dynamic"]  # fbgemm cannot be traced: left eager, and said
    table = format_table(out)
    assert "eager vs compiled (default, aot_eager)" in table and "\nint8-dynamic " in table
    parser = argparse.ArgumentParser()
    add_precision_parser(parser.add_subparsers())
    assert parser.parse_args(["precision", "--pipeline", "digits", "--compile", "default"]).compile == "default"


def test_model_compile_key():
    from flowrl.trainers.config import load_config

    assert load_config("recipes/digits.yaml").model.compile == "off"
    assert load_config("recipes/digits.yaml", ["model.compile=off"]).model.compile == "off"  # YAML: a bare off
    assert load_config("recipes/digits.yaml", ["model.compile=on"]).model.compile == "default"  # a bare on
    assert load_config("recipes/digits.yaml", ["model.compile=reduce-overhead"]).model.compile == "reduce-overhead"
    with pytest.raises(ConfigError, match=r"^model.compile must be one of off, default, .*, got 'fast'$"):
        load_config("recipes/digits.yaml", ["model.compile=fast"])
    with pytest.raises(ConfigError, match="train.sharding=fsdp.*set model.compile=off"):
        load_config("recipes/digits.yaml", ["model.compile=default", "train.sharding=fsdp"])
