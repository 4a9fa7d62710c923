"""`flowrl train` on tiny SD3 and FLUX pipelines, through the shipped GPU recipes.

Each recipe keeps its structure (sampler, step type, guidance, KL, EMA, LoRA targets) and is only
shrunk by overrides (`helpers.tiny_overrides`): tiny offline models from `make_tiny`, 32 px images, a few
steps, a cheap reward. Also: the accelerate configs parse as `accelerate launch` reads them.
"""
import json

import pytest
import torch
from safetensors.torch import load_file

from flowrl.pipelines.tiny import make_tiny
from flowrl.checkpoints.common import list_checkpoints
from flowrl.trainers.config import load_config
from flowrl.trainers.online import train
from helpers import IMAGE, ROOT, lora_weights, tiny_overrides, train_records

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-models")
    return {kind: make_tiny(kind, root / kind, image_size=IMAGE) for kind in ("sd3", "flux")}


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_group_recipe_trains(tiny_models, tmp_path, kind):
    recipe = ROOT / "recipes" / f"{kind}_group_pickscore.yaml"
    cfg = load_config(recipe, tiny_overrides(tiny_models[kind], "group"))
    assert cfg.model.pipeline == kind and cfg.train.lora_rank > 0 and cfg.train.ema
    run = tmp_path / "run"
    summary = train(cfg, run)
    assert summary["iterations_done"] == 2 and summary["skipped_steps"] == 0
    recs = train_records(run)
    assert [r["iteration"] for r in recs] == [0, 1]
    for r in recs:  # 2 prompts x 2 samples x 1 trained step (timestep_fraction 0.99), less zero-variance groups
        assert 0 < r["transitions_trained"] <= 4
        assert torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all()
    # the update rescores the rollout's own transitions: before any step, new == old policy
    assert abs(recs[0]["ratio_mean"] - 1) < 1e-4
    # SD3 recipe: KL to the adapter-disabled model, logged; FLUX recipe (beta 0): no KL term, none logged
    beta_kl = cfg.train.update_options.beta_kl
    assert ("kl" in recs[1]) == (beta_kl > 0) and beta_kl == {"sd3": 0.04, "flux": 0.0}[kind]
    ck1, ck2 = list_checkpoints(run / "checkpoints")
    w1, w2 = lora_weights(ck1), lora_weights(ck2)
    assert w2 and all(".lora_A." in k or ".lora_B." in k for k in w2)
    assert all(v.dtype == torch.float32 for v in w2.values())
    assert any(".lora_B." in k and v.abs().sum() > 0 for k, v in w1.items())  # B starts at 0
    assert any(not torch.equal(w1[k], w2[k]) for k in w1)  # the second iteration changed them again
    ema = load_file(str(ck2 / "ema.safetensors"))
    assert ema.keys() == w2.keys() and any(not torch.equal(ema[k], w2[k]) for k in w2)


@pytest.mark.parametrize("recipe", ["sd3_branch_hps", "flux_branch_hps", "sd3_tempflow_pickscore",
                                    "flux_tempflow_pickscore"])
def test_tree_and_tempflow_recipes_train(tiny_models, tmp_path, recipe):
    kind, sampler = recipe.split("_")[:2]
    cfg = load_config(ROOT / "recipes" / f"{recipe}.yaml",
                      tiny_overrides(tiny_models[kind], sampler, **{"train.iterations": 1}))
    assert cfg.sampler.name == sampler
    run = tmp_path / "run"
    train(cfg, run)
    (rec,) = train_records(run)
    assert rec["transitions_trained"] > 0 and abs(rec["ratio_mean"] - 1) < 1e-4
    w = lora_weights(list_checkpoints(run / "checkpoints")[-1])
    assert any(".lora_B." in k and v.abs().sum() > 0 for k, v in w.items())


@pytest.mark.parametrize("recipe", ["sd3_sol_nvfp4", "flux_sol_nvfp4"])
def test_sol_recipes_train(tiny_models, tmp_path, recipe):
    """Sol-RL recipes (DiffusionNFT on regenerated samples) run end to end; the SD3.5-M one also
    caches the text embeddings on disk and drops the text encoders."""
    kind = recipe.split("_")[0]
    cfg = load_config(ROOT / "recipes" / f"{recipe}.yaml",
                      tiny_overrides(tiny_models[kind], "sol", **{"train.iterations": 1,
                                                                   "model.text_embedding_cache": str(tmp_path / "emb"),
                                                                   "model.drop_text_encoders": "true"}))
    assert cfg.sampler.name == "sol" and cfg.train.loss == "nft"
    run = tmp_path / "run"
    assert train(cfg, run)["iterations_done"] == 1
    (rec,) = train_records(run)
    assert torch.isfinite(torch.tensor(rec["loss"])) and rec["sol/explore_model_evals"] == 2 * 4 * 2  # prompts x pool x steps
    assert len(json.loads((tmp_path / "emb" / "index.json").read_text())["shards"][0]["prompts"]) == 2
    w = lora_weights(list_checkpoints(run / "checkpoints")[-1])
    assert any(".lora_B." in k and v.abs().sum() > 0 for k, v in w.items())


def test_accelerate_configs_parse_as_launch_reads_them():
    """Every shipped accelerate config passes `accelerate launch`'s own parsing and validation, and
    every nested option is one of its launch flags (a misspelt key would be silently ignored)."""
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import DistributedType

    files = sorted((ROOT / "configs" / "accelerate").glob("*.yaml"))
    kinds = {}
    for f in files:
        cfg = ClusterConfig.from_yaml_file(str(f))
        parser = launch_command_parser()
        flags = {a.dest for a in parser._actions}
        nested = [k if k.startswith("fsdp_") else f"fsdp_{k}" for k in cfg.fsdp_config] + list(cfg.deepspeed_config)
        assert not [k for k in nested if k not in flags], f.name
        args = parser.parse_args(["--config_file", str(f), "-m", "flowrl", "train", "--config", "x",
                                  "--output-dir", "y"])
        args, _, _ = _validate_launch_command(args)
        assert args.num_processes == cfg.num_processes >= 8 and args.module
        kinds[f.stem] = (cfg.distributed_type, cfg.num_machines)
    assert kinds == {"ddp": (DistributedType.MULTI_GPU, 1), "multi_node": (DistributedType.MULTI_GPU, 2),
                     "fsdp": (DistributedType.MULTI_GPU, 1)}  # fsdp: flowrl shards (train.sharding=fsdp)
    assert "train.sharding=fsdp" in (ROOT / "configs" / "accelerate" / "fsdp.yaml").read_text()
