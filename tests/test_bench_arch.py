"""The architecture benchmark (flowrl.bench.precision_arch): published configs (declared by the adapters),
the CPU error, and the whole code path end to end on shrunken configs in fp32 (``tiny``), iteration timing
included."""
import argparse
import json

import pytest
import torch

from flowrl.bench.precision_arch import bench_arch
from flowrl.bench.precision_arch_models import arch_model, arch_models, build_transformer
from flowrl.bench.precision_cli import add_precision_parser
from flowrl.quant.common import BackendUnavailable

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_architecture_names_are_the_adapters_published_models():
    from flowrl.pipelines.flux import FluxPolicy
    from flowrl.pipelines.sana import SanaPolicy
    from flowrl.pipelines.sd3 import SD3Policy

    from flowrl.pipelines.flux_kontext import FluxKontextPolicy
    from flowrl.pipelines.qwen_image import QwenImagePolicy
    from flowrl.pipelines.wan import WanPolicy

    models = arch_models()
    assert {"sd35m-arch", "sd35l-arch", "flux-arch", "sana-arch", "qwen-image-arch", "flux-kontext-arch",
            "wan-1.3b-arch", "wan-14b-arch", "qwen-image-edit-arch", "qwen-image-edit-2511-arch"} <= set(models)
    assert models["sd35m-arch"] == (SD3Policy, SD3Policy.published["stabilityai/stable-diffusion-3.5-medium"])
    assert models["flux-arch"][0] is FluxPolicy and models["sana-arch"][0] is SanaPolicy
    assert models["qwen-image-arch"][0] is QwenImagePolicy and models["flux-kontext-arch"][0] is FluxKontextPolicy
    assert models["wan-14b-arch"] == (WanPolicy, WanPolicy.published["Wan-AI/Wan2.1-T2V-14B-Diffusers"])
    assert {"flux2-arch", "flux2-klein-arch", "flux2-klein-9b-arch", "z-image-arch"} <= set(models)
    assert [models[n][0].kind for n in ("flux2-arch", "flux2-klein-arch", "z-image-arch")] == [
        "flux2", "flux2-klein", "z-image"]
    assert models["flux2-klein-arch"][1].title == "FLUX.2-klein-4B"  # base and distilled share it
    assert {"wan2.2-a14b-arch", "wan2.2-5b-arch"} <= set(models)  # Wan2.2 (tests/test_wan22.py: two experts)


@pytest.mark.parametrize("pipeline,low,high", [("sd35m-arch", 2.2e9, 2.3e9), ("sd35l-arch", 8.0e9, 8.1e9),
                                                ("flux-arch", 11.8e9, 12.0e9), ("sana-arch", 1.59e9, 1.61e9),
                                                ("qwen-image-arch", 20.42e9, 20.44e9),
                                                ("flux-kontext-arch", 11.8e9, 12.0e9),
                                                ("qwen-image-edit-arch", 20.42e9, 20.44e9),
                                                ("wan-1.3b-arch", 1.41e9, 1.43e9), ("wan-14b-arch", 14.2e9, 14.3e9),
                                                ("flux2-arch", 32.2e9, 32.3e9), ("flux2-klein-arch", 3.8e9, 4.0e9),
                                                ("flux2-klein-9b-arch", 9.0e9, 9.2e9), ("z-image-arch", 6.1e9, 6.2e9)])
def test_published_configs_have_the_published_sizes(pipeline, low, high):
    """Built on the meta device (no memory): 2.24B (+0.23B position table) / 8.06B / 11.9B / 1.6B parameters;
    Qwen-Image 20.43B ("20B"), FLUX.1 Kontext [dev] 11.9B ("12B"), Wan2.1 1.42B ("1.3B") and 14.29B ("14B"),
    FLUX.2 [dev] 32.22B ("32B"), FLUX.2 [klein] 3.88B ("4B") and 9.08B ("9B"), Z-Image 6.15B ("6B")."""
    adapter, model = arch_model(pipeline)
    m = build_transformer(adapter, model.transformer, torch.device("meta"), torch.bfloat16)
    n = sum(p.numel() for p in m.parameters())
    assert low < n < high
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    if pipeline == "sd35m-arch":
        assert m.config.dual_attention_layers == list(range(13)) and m.config.qk_norm == "rms_norm"
    if pipeline == "flux-arch":
        assert m.config.guidance_embeds and m.config.num_single_layers == 38


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU error")
def test_full_size_architectures_need_cuda():
    with pytest.raises(BackendUnavailable, match="needs a CUDA GPU.*--pipeline sd3-mid"):
        bench_arch("sd35m-arch", ["full"], verbose=False)


@pytest.mark.parametrize("pipeline,resolutions", [("sd35m-arch", (32, 48)), ("flux-arch", (32, 48)),
                                                  ("sana-arch", (32, 64)), ("qwen-image-arch", (32, 48)),
                                                  ("flux-kontext-arch", (32, 48)), ("wan-1.3b-arch", (32, 48)),
                                                  ("qwen-image-edit-2511-arch", (32,)),
                                                  ("flux2-arch", (32, 48)), ("flux2-klein-arch", (32, 48)),
                                                  ("z-image-arch", (32, 48))])
def test_arch_bench_end_to_end_tiny(tmp_path, pipeline, resolutions):
    out = bench_arch(pipeline, ["full", "fp8:simulate_on_cpu=true", "nvfp4-emulated:engine=torch"],
                     tmp_path / "a.json", resolutions=resolutions, batch=2, steps=2, repeats=1, device="cpu",
                     tiny=True, iteration_timing=pipeline == "sd35m-arch", verbose=False,
                     iteration_options=dict(resolution=32, pool_size=4, preview_steps=2, keep=2, train_steps=2,
                                            minibatch=2, lora_rank=2))
    saved = json.loads((tmp_path / "a.json").read_text())
    assert out["png"] == str(tmp_path / "a.png") and out["tiny"] is True  # the returned record names its picture
    assert (tmp_path / "a.png").is_file() and saved["tiny"] is True and saved["dtype"] == "float32"
    assert saved["arch"]["config_source"].endswith("transformer/config.json") and saved["arch"]["parameters"] > 0
    assert list(saved["backends"]) == ["full", "fp8:simulate_on_cpu=true", "nvfp4-emulated:engine=torch"]
    full = saved["backends"]["full"]
    assert full["real_kernels"] is True and full["label"] == "full"
    for spec in ("fp8:simulate_on_cpu=true", "nvfp4-emulated:engine=torch"):
        r = saved["backends"][spec]
        assert r["real_kernels"] is False and r["label"] == f"{spec} (simulated)" and r["sync_seconds"] > 0
        for px in map(str, resolutions):
            row = r["resolutions"][px]
            assert 0 < row["velocity_rel_error"] < 0.2  # quantized, yet close to full precision
            assert row["images_per_second"] > 0 and row["forward_ms"] > 0 and row["speedup_vs_full"] > 0
    for px in map(str, resolutions):
        assert full["resolutions"][px]["speedup_vs_full"] == 1.0 and full["resolutions"][px]["velocity_rel_error"] == 0
    assert "fidelity off" in saved["fidelity_note"]
    if pipeline == "sd35m-arch":
        it = saved["iteration_timing"]
        assert it["settings"]["explore_backend"] == "fp8:simulate_on_cpu=true"
        assert it["sol"]["explore_model_evals"] == 4 * 2 and it["sol"]["label"].endswith("(simulated)")
        for name in ("sol", "grpo"):
            r = it[name]
            assert r["samples_trained"] == 2 and r["transitions_trained"] == 2 * 2
            assert r["total_seconds"] >= r["update_seconds"] > 0
            assert abs(r["first_ratio_mean"] - 1) < 1e-4  # the update rescores the rollout's own transitions
        assert it["sol"]["sync_seconds"] > 0  # the update changed the LoRA: the copy was re-quantized


def test_cli_routes_arch_pipelines_and_rejects_arch_flags_elsewhere():
    parser = argparse.ArgumentParser()
    add_precision_parser(parser.add_subparsers())
    a = parser.parse_args(["precision", "--pipeline", "flux-arch", "--resolutions", "512,1024", "--compile",
                           "reduce-overhead", "--iteration-timing", "--pool-size", "48", "--tiny"])
    assert a.pipeline == "flux-arch" and a.compile == "reduce-overhead" and a.pool_size == 48 and a.tiny
    b = parser.parse_args(["precision", "--pipeline", "sd3-mid", "--tiny"])
    with pytest.raises(ValueError, match="--tiny apply to the architecture pipelines"):
        b.fn(b)
    with pytest.raises(SystemExit):
        parser.parse_args(["precision", "--pipeline", "sd35m-arch", "--compile", "fast"])


def test_arch_bench_validates_before_building():
    with pytest.raises(ValueError, match="compile must be one of"):
        bench_arch("sd35m-arch", ["full"], tiny=True, device="cpu", compile="fast", verbose=False)
    with pytest.raises(ValueError, match="unknown architecture 'sd4-arch'; valid: .*flux-arch"):
        bench_arch("sd4-arch", ["full"], tiny=True, device="cpu", verbose=False)
    parser = argparse.ArgumentParser()
    add_precision_parser(parser.add_subparsers())
    with pytest.raises(SystemExit):  # an argparse error (rc 2) that lists the names
        parser.parse_args(["precision", "--pipeline", "sd4-arch"])


def test_video_architecture_takes_a_frame_count(tmp_path):
    """--num-frames sets a video architecture's frames (latents (C, (F - 1) / 4 + 1, h, w)); the record says so."""
    import argparse

    out = bench_arch("wan-14b-arch", ["full"], tmp_path / "w.json", resolutions=(32,), batch=1, steps=1, repeats=1,
                     device="cpu", tiny=True, verbose=False, model_options={"num_frames": 9})
    assert out["arch"]["frames"] == 9 and out["arch"]["config"]["num_layers"] == 2
    assert out["backends"]["full"]["resolutions"]["32"]["images_per_second"] > 0
    parser = argparse.ArgumentParser()
    add_precision_parser(parser.add_subparsers())
    assert parser.parse_args(["precision", "--pipeline", "wan-1.3b-arch", "--num-frames", "33"]).num_frames == 33
    b = parser.parse_args(["precision", "--pipeline", "sd3-mid", "--num-frames", "33"])
    with pytest.raises(ValueError, match="--num-frames apply to the architecture pipelines"):
        b.fn(b)


def test_arch_bench_compiled_rows_and_what_a_run_cut_short_leaves(tmp_path, monkeypatch):
    """--compile: each backend eager, then compiled (aot_eager here: inductor's C++ build would take minutes),
    side by side; the JSON is written after each backend, so a run stopped midway keeps what it measured."""
    import flowrl.bench.precision_arch as pa
    from flowrl.bench.precision_arch_report import format_arch_table

    monkeypatch.setenv("FLOWRL_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    real = pa.measure_backend

    def cut_after_full(policy, spec, *a, **k):
        if spec != "full":
            raise RuntimeError("time cap")
        return real(policy, spec, *a, **k)

    monkeypatch.setattr(pa, "measure_backend", cut_after_full)
    with pytest.raises(RuntimeError, match="time cap"):
        bench_arch("sd35m-arch", ["full", "fp8:simulate_on_cpu=true"], tmp_path / "p.json", resolutions=(32,),
                   batch=1, steps=1, repeats=1, device="cpu", tiny=True, compile="default", verbose=False)
    saved = json.loads((tmp_path / "p.json").read_text())
    assert saved["partial"] == "1 of 2 backends measured" and list(saved["backends"]) == ["full"]
    c = saved["backends"]["full"]["compiled"]
    row = c["resolutions"]["32"]
    assert (c["mode"], c["backend"], c["compiles"], row["recompiles_timed"]) == ("default", "aot_eager", 1, 0)
    assert row["images_per_second"] > 0 and row["forward_ms"] > 0 and row["speedup_vs_eager"] > 0
    assert row["velocity_rel_error_vs_eager"] < 1e-5 and row["speedup_vs_full_compiled"] == 1.0
    assert "full +c" in format_arch_table(saved)
    torch._dynamo.reset()


def test_iteration_timing_alone_with_compiled_rollouts(tmp_path, monkeypatch):
    """--iteration-only --compile: no backend timed; Sol-RL and flat GRPO iterations with compiled rollouts (the
    exploration copy re-synced in place after the update), the timed iterations compile nothing."""
    monkeypatch.setenv("FLOWRL_COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    out = bench_arch("sd35m-arch", ["full"], tmp_path / "i.json", resolutions=(32,), device="cpu", tiny=True,
                     compile="default", iteration_only=True, verbose=False,
                     iteration_options=dict(resolution=32, pool_size=4, preview_steps=2, keep=2, train_steps=2,
                                            minibatch=2, lora_rank=2, explore_backend="fp8:simulate_on_cpu=true"))
    it = json.loads((tmp_path / "i.json").read_text())["iteration_timing"]
    assert out["backends"] == {} and (tmp_path / "i.png").is_file() and it["settings"]["compile"] == "default"
    assert it["sol"]["recompiles"] == 0 and it["grpo"]["recompiles"] == 0 and it["sol"]["sync_seconds"] > 0
    assert it["sol_over_grpo"] > 0
    torch._dynamo.reset()
