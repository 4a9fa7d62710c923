"""`flowrl export`: a trained run's LoRA loads into diffusers and reproduces the trained policy.

Tiny SD3 / FLUX pipelines (make_tiny) are trained for one iteration with a large learning rate and
a LoRA whose alpha differs from its rank (scaling 4), exported, loaded back with diffusers' own
`load_lora_weights` (`load_lora_adapter` for the pipeline-less digits model), and the transformer's
velocity on fixed latents, sigma and prompt embeddings must equal the trained policy's.
"""
import json
import shutil

import pytest
import torch
from safetensors import safe_open

from conftest import tiny_train_overrides
from flowrl.cli import main as cli_main
from flowrl.export import EXPORT_JSON, LORA_WEIGHT_NAME, ExportError, export_run
from flowrl.pipelines.tiny import make_tiny
from flowrl.checkpoints.common import list_checkpoints
from flowrl.trainers.config import load_config
from flowrl.trainers.online import train
from flowrl.trainable import add_lora, load_trainable_state
from helpers import IMAGE, ROOT, fixed_velocity, tiny_overrides

RANK, ALPHA = 4, 16  # scaling alpha / r = 4: lost if the export dropped alpha (diffusers' default alpha = r)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One trained run per kind: 1 iteration, lr 1e-2, LoRA r=4 alpha=16, EMA updated every step."""
    root = tmp_path_factory.mktemp("export-runs")
    out = {}
    for kind in ("sd3", "flux"):
        model = make_tiny(kind, root / f"{kind}-model", image_size=IMAGE)
        cfg = load_config(ROOT / "recipes" / f"{kind}_group_pickscore.yaml", tiny_overrides(
            model, "group", **{"train.iterations": 1, "train.lora_rank": RANK, "train.lora_alpha": ALPHA,
                               "sampler.group_size": 4, "train.batch_size": 8, "train.ema_decay": 0.5}))
        train(cfg, root / f"{kind}-run")
        out[kind] = (model, root / f"{kind}-run")
    return out


def _policy(kind, model):
    from flowrl.pipelines.flux import FluxPolicy
    from flowrl.pipelines.sd3 import SD3Policy

    cls = {"sd3": SD3Policy, "flux": FluxPolicy}[kind]
    return cls.from_pretrained(model, max_sequence_length=8, guidance_scale={"sd3": 4.5, "flux": 3.5}[kind])


def _trained_transformer(kind, model, run, ema=False):
    """The policy's transformer as training left it: base + the run's LoRA (the trainer's code path)."""
    cfg = load_config(run / "config.yaml")
    policy = _policy(kind, model)
    tr = policy.transformer
    add_lora(tr, cfg.train.lora_rank, cfg.train.lora_alpha, cfg.train.lora_targets or policy.lora_target_modules)
    from safetensors.torch import load_file

    ck = list_checkpoints(run / "checkpoints")[-1]
    load_trainable_state(tr, load_file(str(ck / ("ema.safetensors" if ema else "trainable.safetensors"))))
    return tr.eval()


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_exported_lora_loads_into_the_diffusers_pipeline(runs, tmp_path, kind):
    from diffusers import FluxPipeline, StableDiffusion3Pipeline

    model, run = runs[kind]
    out = tmp_path / "lora"
    info = export_run(run, out)
    assert info["kind"] == "lora" and info["rank"] == RANK and info["alpha"] == ALPHA and info["iteration"] == 1
    assert json.loads((out / EXPORT_JSON).read_text()) == info
    with safe_open(str(out / LORA_WEIGHT_NAME), "pt") as f:
        keys = list(f.keys())
        meta = json.loads(f.metadata()["lora_adapter_metadata"])
    assert keys and all(k.startswith("transformer.") and ".default." not in k for k in keys)
    assert meta["transformer.r"] == RANK and meta["transformer.lora_alpha"] == ALPHA

    policy = _policy(kind, model)
    v_trained = fixed_velocity(policy, _trained_transformer(kind, model, run))
    pipe = {"sd3": StableDiffusion3Pipeline, "flux": FluxPipeline}[kind].from_pretrained(model)
    v_base = fixed_velocity(policy, pipe.transformer)
    pipe.load_lora_weights(out)
    v_loaded = fixed_velocity(policy, pipe.transformer)
    torch.testing.assert_close(v_loaded, v_trained, rtol=1e-5, atol=1e-6)
    gap = (v_trained - v_base).abs().max().item()
    assert gap > 1e-3, gap  # the LoRA really moved the model (so the equality above means something)


def test_ema_export_is_the_ema_policy(runs, tmp_path):
    from diffusers import StableDiffusion3Pipeline

    model, run = runs["sd3"]
    info = export_run(run, tmp_path / "ema", ema=True)
    assert info["weights"] == "ema"
    policy = _policy("sd3", model)
    v_ema = fixed_velocity(policy, _trained_transformer("sd3", model, run, ema=True))
    v_trained = fixed_velocity(policy, _trained_transformer("sd3", model, run))
    pipe = StableDiffusion3Pipeline.from_pretrained(model)
    pipe.load_lora_weights(tmp_path / "ema")
    v_loaded = fixed_velocity(policy, pipe.transformer)
    torch.testing.assert_close(v_loaded, v_ema, rtol=1e-5, atol=1e-6)
    assert (v_ema - v_trained).abs().max() > 1e-4


def test_digits_lora_loads_with_load_lora_adapter(tiny_digits_dir, tmp_path):
    from diffusers import SD3Transformer2DModel

    run = tmp_path / "run"
    train(load_config(ROOT / "recipes" / "digits.yaml", tiny_train_overrides(
        tiny_digits_dir, **{"train.iterations": 1, "train.lr": 1e-2, "train.lora_rank": RANK,
                            "train.lora_alpha": ALPHA})), run)
    info = export_run(run, tmp_path / "out")
    assert info["pipeline"] == "digits" and "load_lora_adapter" in info["load"]
    cfg = load_config(run / "config.yaml")
    trained = SD3Transformer2DModel.from_pretrained(tiny_digits_dir / "transformer")
    add_lora(trained, RANK, ALPHA, cfg.train.lora_targets or ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj",
                                                               "add_k_proj", "add_v_proj", "to_add_out"])
    from safetensors.torch import load_file

    load_trainable_state(trained, load_file(str(list_checkpoints(run / "checkpoints")[-1] / "trainable.safetensors")))
    loaded = SD3Transformer2DModel.from_pretrained(tiny_digits_dir / "transformer")
    base = SD3Transformer2DModel.from_pretrained(tiny_digits_dir / "transformer")
    loaded.load_lora_adapter(tmp_path / "out", weight_name=LORA_WEIGHT_NAME)
    g = torch.Generator().manual_seed(0)
    c = trained.config
    inputs = dict(hidden_states=torch.randn(2, c.in_channels, 16, 16, generator=g),
                  timestep=torch.tensor([900.0, 300.0]),
                  encoder_hidden_states=torch.randn(2, 5, c.joint_attention_dim, generator=g),
                  pooled_projections=torch.randn(2, c.pooled_projection_dim, generator=g), return_dict=False)
    with torch.no_grad():
        out_t, out_l, out_b = (m.eval()(**inputs)[0] for m in (trained, loaded, base))
    torch.testing.assert_close(out_l, out_t, rtol=1e-5, atol=1e-6)
    assert (out_t - out_b).abs().max() > 1e-3


def test_full_finetune_exports_the_transformer(tiny_digits_dir, tmp_path):
    from diffusers import SD3Transformer2DModel
    from safetensors.torch import load_file

    run = tmp_path / "run"
    train(load_config(ROOT / "recipes" / "digits.yaml", tiny_train_overrides(
        tiny_digits_dir, **{"train.iterations": 1, "train.lr": 1e-3, "train.lora_rank": 0,
                            "train.loss_options.beta_kl": 0})), run)
    info = export_run(run, tmp_path / "out")
    assert info["kind"] == "full"
    exported = SD3Transformer2DModel.from_pretrained(tmp_path / "out", subfolder="transformer")
    base = SD3Transformer2DModel.from_pretrained(tiny_digits_dir / "transformer")
    trained = load_file(str(list_checkpoints(run / "checkpoints")[-1] / "trainable.safetensors"))
    params = dict(exported.named_parameters())
    assert set(params) == set(trained)
    assert all(torch.equal(params[k], trained[k]) for k in trained)
    assert any(not torch.equal(p, dict(base.named_parameters())[k]) for k, p in params.items())


def test_export_errors(runs, tmp_path, monkeypatch, capsys):
    model, run = runs["sd3"]
    with pytest.raises(ExportError, match="not a flowrl run directory"):
        export_run(tmp_path / "nowhere", tmp_path / "o")
    fresh = tmp_path / "fresh-run"
    fresh.mkdir()
    shutil.copy(run / "config.yaml", fresh / "config.yaml")
    with pytest.raises(ExportError, match="no checkpoint yet"):
        export_run(fresh, tmp_path / "o")
    with pytest.raises(ExportError, match="--checkpoint iter_999999: not a checkpoint directory.*iter_000001"):
        export_run(run, tmp_path / "o", checkpoint="iter_999999")
    assert export_run(run, tmp_path / "by-name", checkpoint="iter_000001")["checkpoint"] == "iter_000001"
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(ExportError, match="not empty.*--overwrite"):
        export_run(run, busy)
    with pytest.raises(ExportError, match="only a previous export"):
        export_run(run, busy, overwrite=True)
    assert (busy / "notes.txt").read_text() == "mine"  # left alone
    export_run(run, tmp_path / "by-name", overwrite=True)  # replacing a previous export is fine
    # the FLUX tiny model is not this run's base: names/shapes do not fit
    with pytest.raises(ExportError, match="does not fit the base model"):
        export_run(run, tmp_path / "wrong-base", model_path=str(runs["flux"][0]))
    assert not (tmp_path / "wrong-base").exists()  # nothing half-written
    with pytest.raises(ExportError, match="cannot read the transformer config"):
        export_run(run, tmp_path / "no-base", model_path=str(tmp_path / "missing-model"))
    # a run trained without EMA: --ema says so
    no_ema = tmp_path / "no-ema"
    shutil.copytree(run, no_ema)
    for ck in list_checkpoints(no_ema / "checkpoints"):
        (ck / "ema.safetensors").unlink()
    with pytest.raises(ExportError, match="without train.ema"):
        export_run(no_ema, tmp_path / "o", ema=True)
    # a pipeline export does not know: the error names the ones it does
    from flowrl import pipelines

    monkeypatch.setitem(pipelines.REGISTRY, "mymodel", lambda path, **kw: None)  # a loader declaring nothing
    odd = tmp_path / "odd-run"
    shutil.copytree(run, odd)
    (odd / "config.yaml").write_text((run / "config.yaml").read_text().replace("pipeline: sd3", "pipeline: mymodel"))
    known = ", ".join(n for n in pipelines.available() if n != "mymodel")  # every shipped adapter exports
    assert "flux2, flux2-klein" in known and known.startswith("digits, ") and "sd3" in known  # sorted, all of them
    with pytest.raises(ExportError, match=f"does not know pipeline 'mymodel'.*{known}"):
        export_run(odd, tmp_path / "o")
    # the CLI: exit status 2 and the message on stderr, JSON summary on success
    assert cli_main(["export", str(fresh), str(tmp_path / "o")]) == 2
    assert "no checkpoint yet" in capsys.readouterr().err
    assert cli_main(["export", str(run), str(tmp_path / "cli"), "--ema"]) == 0
    assert json.loads(capsys.readouterr().out)["weights"] == "ema"
    assert (tmp_path / "cli" / LORA_WEIGHT_NAME).is_file()
