"""``flowrl train --smoke``: every shipped recipe, shrunk by ``flowrl/smoke.py`` onto its pipeline's
tiny random model, trains one iteration on the CPU (the check a cluster user runs before spending
GPU hours), and the shrinking never touches the recipe's own cache paths."""
import json
from pathlib import Path

import pytest

from flowrl.registry import SAMPLERS
from flowrl.smoke import sampler_smoke_options, smoke_config, smoke_run
from flowrl.checkpoints.common import list_checkpoints
from flowrl.trainers.config import load_config
from flowrl.trainers.config_text import shipped_recipes

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread
RECIPES = [p.stem for p in shipped_recipes()]


@pytest.mark.parametrize("name", SAMPLERS.names())
def test_every_sampler_declares_its_smoke_size(name):
    """Each registered sampler shrinks itself (its smoke_options): a valid sampler whose samples per prompt
    divide the smoke batch of 4."""
    from flowrl.trainers.config import SamplerConfig

    shrunk = load_config("digits", [f"sampler={{name: {name}}}", *(f"sampler.{k}={v}" for k, v in
                                                             sampler_smoke_options(name).items()),
                                    "train.batch_size=4", "train.loss=nft"]).sampler
    assert isinstance(shrunk, SamplerConfig) and 4 % shrunk.samples_per_prompt == 0


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_smoke_run(recipe, tmp_path, monkeypatch, capsys):
    """Each shipped recipe exactly as shipped, from a fresh working directory (no data/, no checkpoints/), with
    no data or reward overrides: what a fresh clone runs as the README prints it."""
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    summary = smoke_run(f"recipes/{recipe}.yaml", str(run), ["logging.progress=false"])
    full = load_config(f"{recipe}.yaml")
    assert summary["smoke"]["sampler"] == full.sampler.name
    assert summary.get("iterations_done", summary.get("steps_done")) >= 1
    assert list_checkpoints(run / "checkpoints")
    saved = (run / "config.yaml").read_text()
    for kept in (f"pipeline: {full.model.pipeline}", f"name: {full.sampler.name}", f"loss: {full.train.loss}",
                 f"mode: {full.train.mode}"):
        assert kept in saved, kept  # the recipe's structure survives the shrinking
    if full.data.source:  # data flowrl cannot ship: one note naming the recipe's file and where to get it
        notes = [ln for ln in capsys.readouterr().err.splitlines() if "is not on this machine" in ln
                 or "are not on this machine" in ln]
        assert len(notes) == 1 and f"data.prompts {full.data.prompts}" in notes[0], notes
        assert notes[0].endswith(f"from: {full.data.source} (the smoke run goes on with its own prompts)")
    editing = {"flux-kontext": "digits-edit-sample", "qwen-image-edit": "digits-edit-multi-sample"}
    if full.model.pipeline in editing:  # an editing run: digits_edit is NaN for a row without its sources
        from helpers import train_records

        assert editing[full.model.pipeline] in saved and all(0 <= r["reward_mean"] <= 1 for r in train_records(run))


def test_smoke_notes_the_recipes_data_and_fails_on_the_users(tmp_path, monkeypatch, capsys):
    """The recipe's own prompt files, missing here, are one note saying where to get them (data.source); a
    prompt file or reward file given on the command line, or named by a recipe that does not say where to get
    it, fails as it would fail the real run (one line from the CLI, nothing written)."""
    from huggingface_hub import constants

    from flowrl.cli import main
    from flowrl.errors import ConfigError

    monkeypatch.chdir(tmp_path)  # no data/ here
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))  # empty; downloads off (conftest)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    cfg, _ = smoke_config("recipes/sd3_group_pickscore.yaml", [], tmp_path)
    note = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[flowrl] note: data.")]
    assert note == [f"[flowrl] note: data.prompts data/pickscore/train.txt and data.eval_prompts "
                    f"data/pickscore/test_64.txt are not on this machine and the real run reads them; get them "
                    f"from: {cfg.data.source} (the smoke run goes on with its own prompts)"]
    assert cfg.data.source.startswith("Flow-GRPO's dataset/pickscore/train.txt")
    smoke_config("recipes/sd3_branch_hps.yaml", [], tmp_path)  # its weights: a hub file, not cached here
    assert ("reward.options.hps.checkpoint=hf://xswu/HPSv2/HPS_v2.1_compressed.pt is not in the local Hugging Face "
            "cache and HF_HUB_OFFLINE is set" in capsys.readouterr().err)
    with pytest.raises(ConfigError, match=r"--smoke checks what the real run reads, and data\.prompts fails: "
                                          r"prompt file 'data/mine\.txt' not found.*flowgrpo-pickscore"):
        smoke_config("recipes/sd3_group_pickscore.yaml", ["data.prompts=data/mine.txt"], tmp_path)
    mine = tmp_path / "mine.yaml"  # a recipe of the user's own, its data not here and no data.source
    mine.write_text((ROOT / "recipes" / "digits.yaml").read_text().replace("prompts: digits", "prompts: data/mine.txt"))
    with pytest.raises(ConfigError, match=r"data\.prompts fails: prompt file 'data/mine\.txt' not found"):
        smoke_config(str(mine), [], tmp_path)
    with pytest.raises(ConfigError, match=r"reward\.options\.hps\.checkpoint=checkpoints/HPS_v2\.1_compressed\.pt "
                                          r"is no file here"):
        smoke_config("recipes/sd3_branch_hps.yaml", ["reward.options.hps.checkpoint=checkpoints/HPS_v2.1_compressed.pt"],
                     tmp_path)
    with pytest.raises(ConfigError, match=r"reward\.options\.hps\.checkpoint: 'hf://xswu/HPS\.pt' is not a hub file"):
        smoke_config("recipes/sd3_branch_hps.yaml", ["reward.options.hps.checkpoint=hf://xswu/HPS.pt"], tmp_path)
    capsys.readouterr()
    assert main(["train", "--smoke", "--config", "recipes/sd3_group_pickscore.yaml", "--output-dir",
                 str(tmp_path / "run"), "data.eval_prompts=data/missing.txt"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("flowrl train: error: --smoke checks what the real run reads")
    assert not (tmp_path / "run").exists()


def test_an_editing_recipe_on_the_hints_prompts(tmp_path, monkeypatch):
    """For an editing model the --smoke error's hint names an editing set; on a text-only set given as that
    hint once did, FLUX.1 Kontext's smoke run keeps the JPEG reward (digits_edit would score nothing: NaN
    reward and loss) and trains text-to-image, and Qwen-Image-Edit, which cannot generate without a source,
    is refused in one line before any model is built."""
    from flowrl.errors import ConfigError

    SAMPLE = ["data.prompts=flowgrpo-pickscore-sample", "data.eval_prompts=flowgrpo-pickscore-sample"]  # text only
    monkeypatch.chdir(tmp_path)  # no data/ here
    with pytest.raises(ConfigError, match=r"data\.prompts fails: .*\(e\.g\. the shipped digits-edit-sample, an editing "
                                          r"set\)"):  # a file of the user's that is not there
        smoke_config("recipes/flux_kontext_edit.yaml", ["data.prompts=mine.jsonl"], tmp_path)
    cfg, _ = smoke_config("recipes/flux_kontext_edit.yaml", SAMPLE, tmp_path)
    assert cfg.data.prompts == "flowgrpo-pickscore-sample" and dict(cfg.reward.weights) == {"jpeg_compressibility": 1.0}
    edits = ["data.prompts=digits-edit-sample", "data.eval_prompts=digits-edit-sample"]
    cfg, _ = smoke_config("recipes/flux_kontext_edit.yaml", edits, tmp_path)
    assert dict(cfg.reward.weights) == {"digits_edit": 1.0}  # the user's editing set: the editing reward
    with pytest.raises(ConfigError, match=r"^data\.prompts: 36 of 36 prompts carry no source image, and qwen-image-edit "
                                          r"is an editing model that cannot generate without one"):
        smoke_config("recipes/qwen_image_edit_group_pickscore.yaml", SAMPLE, tmp_path)


def test_smoke_keeps_the_recipes_cache_paths_clean(tmp_path):
    """A recipe with a relative text-embedding cache (shared with the real run) gets a scratch one."""
    cfg, ov = smoke_config("recipes/sd3_sol_nvfp4.yaml", [], tmp_path)
    assert load_config("recipes/sd3_sol_nvfp4.yaml").model.text_embedding_cache.startswith("cache/")
    assert Path(cfg.model.text_embedding_cache).parent == tmp_path
    assert cfg.sampler.to_dict()["explore_backend"] == "int8-dynamic" and cfg.model.device == "cpu"
    assert cfg.model.options["resolution"] == 32 and cfg.train.iterations == 1
    assert "reward.weights={jpeg_compressibility: 1.0}" in ov


def test_user_overrides_apply_under_the_smoke_sizes(tmp_path):
    cfg, _ = smoke_config("recipes/digits.yaml", ["train.loss=dpo", "train.iterations=50"], tmp_path)
    assert cfg.train.loss == "dpo" and cfg.train.iterations == 1  # the user's choice kept, the size shrunk


def test_the_users_prompts_and_reward_are_what_the_smoke_run_checks(tmp_path):
    prompts = tmp_path / "mine.txt"
    prompts.write_text("a handwritten digit 5\na handwritten digit 6\n")
    cfg, _ = smoke_config("recipes/digits.yaml", [f"data.prompts={prompts}", "reward.weights={digits: 1.0}"], tmp_path)
    assert cfg.data.prompts == str(prompts) and dict(cfg.reward.weights) == {"digits": 1.0}
    assert cfg.train.iterations == 1 and cfg.data.eval_seeds_per_prompt == 2  # the rest still shrunk
    cfg, _ = smoke_config("recipes/digits.yaml", ["reward={weights: {digits: 0.5}}"], tmp_path)  # a whole section
    assert dict(cfg.reward.weights) == {"digits": 0.5}


def test_smoke_from_the_command_line(tmp_path, capsys):
    from flowrl.cli import main

    assert main(["train", "--smoke", "--config", "recipes/digits_tempflow.yaml", "--output-dir",
                 str(tmp_path / "run"), "logging.progress=false"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["smoke"]["sampler"] == "tempflow" and "[flowrl] smoke run of" in cap.err
