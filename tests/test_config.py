from pathlib import Path

import pytest

from flowrl.trainers.config import Config, dump_config, load_config, samples_per_prompt
from flowrl.errors import ConfigError
from flowrl.trainers.config_text import parse_override, shipped_recipes

ROOT = Path(__file__).resolve().parents[1]


def test_every_shipped_recipe_loads(tmp_path):
    recipes = shipped_recipes()
    assert ROOT / "recipes" / "digits.yaml" in recipes
    for r in recipes:
        cfg = load_config(r)
        assert isinstance(cfg, Config)
        # whole prompts per iteration: batch = prompts x the sampler's samples per prompt, at least one prompt
        spp = samples_per_prompt(cfg.sampler.build())
        assert cfg.prompts_per_iteration >= 1 and cfg.prompts_per_iteration * spp == cfg.train.batch_size, r
        dumped = tmp_path / r.name  # the dumped YAML (what a run writes next to its outputs) loads back the same
        dumped.write_text(dump_config(cfg))
        assert load_config(dumped).to_dict() == cfg.to_dict(), r


def test_overrides_apply_with_types():
    cfg = load_config(ROOT / "recipes/digits.yaml", ["train.lr=3e-4", "sampler.group_size=4", "train.batch_size=40",
                                                     "reward.weights={digits: 1.0, jpeg_compressibility: 0.1}"])
    assert cfg.train.lr == pytest.approx(3e-4) and isinstance(cfg.train.lr, float)
    assert cfg.sampler.options["group_size"] == 4
    assert cfg.prompts_per_iteration == 10
    assert cfg.reward.weights == {"digits": 1.0, "jpeg_compressibility": 0.1}


def test_round_trip_to_dict():
    cfg = load_config(ROOT / "recipes/digits.yaml")
    again = Config.from_dict(cfg.to_dict())
    assert again.to_dict() == cfg.to_dict()


@pytest.mark.parametrize("overrides,match", [
    (["train.lrr=1e-3"], r"unknown key train\.lrr.*Did you mean train\.lr"),
    (["trian.lr=1e-3"], r"unknown section 'trian'.*Did you mean 'train'"),
    (["sampler.group_sise=4"], r"sampler\.group_sise.*Did you mean sampler\.group_size"),
    (["sampler.name=grop"], r"unknown sampler 'grop'.*Did you mean 'group'"),
    (["reward.weights={pickscor: 1.0}"], r"unknown reward 'pickscor'"),
    (["model.pipeline=sdxl"], r"unknown pipeline 'sdxl'"),
    (["sampler.group_size=1"], r"group_size must be an integer >= 2"),
    (["train.batch_size=30"], r"not a multiple of the sampler's 8 samples per prompt"),
    (["train.batch_size=0"], r"train\.batch_size must be a positive integer"),
    (["train.lr=-1"], r"train\.lr must be a positive number"),
    (["train.lr=fast"], r"train\.lr must be a number"),
    (["sampler.step=ddim"], r"unknown step type 'ddim'"),
    (["train.mixed_precision=fp8"], r"mixed_precision"),
    (["lr=1"], r"must be dotted"),
    (["train.lr"], r"must look like section\.key=value"),
    (["model.guidance_scale=0.5"], r"guidance_scale must be >= 1.0"),
    (["logging.trackers=[mlflow]"], r"unknown \['mlflow'\]"),
])
def test_bad_config_errors_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(ROOT / "recipes/digits.yaml", overrides)


def test_missing_recipe_lists_shipped(tmp_path):
    with pytest.raises(ConfigError, match="digits.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_invalid_yaml(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(p)


def test_parse_override_yaml_values():
    assert parse_override("a.b=[1, 2]") == (["a", "b"], [1, 2])
    assert parse_override("a.b=true") == (["a", "b"], True)


def test_a_whole_section_can_be_replaced():
    """``sampler={...}`` swaps the sampler (the recipe's other sampler keys are dropped); a plain
    value for a section name is still an error."""
    cfg = load_config(ROOT / "recipes/digits_sol_nft.yaml", ["sampler={name: ode, group_size: 8, num_steps: 10}"])
    assert cfg.sampler.to_dict() == {"name": "ode", "group_size": 8, "num_steps": 10} and cfg.train.loss == "nft"
    with pytest.raises(ConfigError, match="must be dotted"):
        load_config(ROOT / "recipes/digits.yaml", ["sampler=ode"])


def test_shipped_recipe_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a, b = load_config("digits"), load_config("recipes/digits_branch.yaml")
    assert a.sampler.name == "group" and b.sampler.name == "branch"
    with pytest.raises(ConfigError, match="not found"):
        load_config("elsewhere/digits.yaml")  # a path that names another folder is not a shipped name


def _old_format(cfg: Config) -> dict:
    """``cfg`` as flowrl wrote a run's config.yaml before the updates owned their options (issues 23 and 30):
    every train.* alias and GRPO knob, the KL, advantage clip and CFG-gradient knobs in train, and offline
    GDRO's loss knobs in the offline section."""
    d = cfg.to_dict()
    t, opts = d["train"], cfg.effective_loss_options()
    t.update({"clip_range": 1e-3, "global_std": False, "advantage_options": {}, "nft_beta": 1.0, "pref_beta": 12.0,
              "pref_tau": 0.05, "adv_clip_max": 5.0, "beta_kl": 0.0, "kl_form": "flow_grpo",
              "cfg_uncond_grad": opts["cfg_uncond_grad"]})
    t.update({k: opts[k] for k in ("adv_clip_max", "beta_kl", "kl_form") if k in opts})
    if t["loss"] in ("grpo", "grpo_guard"):
        t.update({k: opts[k] for k in ("clip_range", "global_std", "advantage_options")})
    if t["loss"] == "nft":
        t.update({"nft_beta": opts["beta"], "global_std": opts["global_std"]})
    d["offline"].update({"beta": 12.0, "tau": 0.05, "gamma": 0.5, "t_sampling": "uniform", "t_min": 0.02,
                         "t_max": 0.98, "t_mean": 0.0, "t_std": 1.0})
    if t["loss"] == "offline_gdro":
        d["offline"].update({k: opts[k] for k in ("beta", "tau", "gamma", "t_sampling", "t_min", "t_max")})
        t["loss"] = "grpo"  # an offline run's loss was never read: the default stood in its config.yaml
    t["loss_options"] = {}
    return d


@pytest.mark.parametrize("recipe", ["digits", "digits_branch", "digits_sol_nft", "digits_gdro", "sd3_group_pickscore"])
def test_a_run_saved_before_the_options_moved_loads_and_resumes(recipe, tmp_path):
    import yaml

    from flowrl.trainers.config import load_run_config
    from flowrl.trainers.run_dir import RunDirectory, config_differences

    cfg = load_config(recipe)
    saved = tmp_path / "config.yaml"
    saved.write_text(yaml.safe_dump(_old_format(cfg)))
    with pytest.raises(ConfigError, match="It is an option of the update now"):
        load_config(saved)  # a recipe with the old keys: the error names their new place
    old = load_run_config(saved)  # a run directory's config: upgraded
    assert old.train.loss == cfg.train.loss and old.effective_loss_options() == cfg.effective_loss_options()
    assert config_differences(old, cfg, set()) == []
    RunDirectory(tmp_path, cfg, resume=True, resume_free=set())  # --resume accepts the recipe it was started with
    with pytest.raises(ConfigError, match="train.loss_options"):
        RunDirectory(tmp_path, load_config(recipe, ["train.loss_options.beta=0.5" if cfg.train.loss in
                                                    ("nft", "offline_gdro") else "train.loss_options.clip_range=0.5"]),
                     resume=True, resume_free=set())


def test_a_loss_given_on_the_command_line_keeps_only_its_own_recipe_options(capsys):
    """``--config digits train.loss=X``: one rule for every update, said in one line: the recipe's GRPO options
    X takes are kept (GRPO -> GRPO-Guard keeps the shared clip range, AWM its clip range and KL), the others
    dropped (DPO all, Flow-DPPO the clip range); options given too are the user's."""
    cfg = load_config("digits", ["train.loss=dpo"])
    assert cfg.train.loss == "dpo" and cfg.train.loss_options == {}
    assert "dropped where it does not (beta_kl, clip_range, kl_form)" in capsys.readouterr().err
    recipe = load_config("digits").train.loss_options
    guard = load_config("digits", ["train.loss=grpo_guard"])
    assert guard.train.loss_options == recipe
    assert f"kept where grpo_guard takes them ({', '.join(sorted(recipe))})" in capsys.readouterr().err
    for loss, kept, dropped in (("dppo", "beta_kl, kl_form", "clip_range"), ("awm", "beta_kl, clip_range", "kl_form")):
        assert sorted(load_config("digits", [f"train.loss={loss}"]).train.loss_options) == kept.split(", ")
        err = capsys.readouterr().err
        assert f"kept where {loss} takes them ({kept}) and dropped where it does not ({dropped})" in err, err
    with pytest.raises(ConfigError, match="not an option of train.loss='dpo'"):
        load_config("digits", ["train.loss=dpo", "train.loss_options.clip_range=0.1"])
