"""``flowrl train --smoke``: every shipped recipe, shrunk by ``flowrl/smoke.py`` onto its pipeline's
tiny random model, trains one iteration on the CPU (the check a cluster user runs before spending
GPU hours), and the shrinking never touches the recipe's own cache paths."""
import json
from pathlib import Path

import pytest

from flowrl.smoke import SAMPLERS, smoke_config, smoke_run
from flowrl.checkpoints.common import list_checkpoints
from flowrl.trainers.config import load_config
from flowrl.trainers.config_text import shipped_recipes

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread
RECIPES = [p.stem for p in shipped_recipes()]
# a shipped prompt set on the line, for recipes whose prompt files are not on this machine
SAMPLE = ["data.prompts=flowgrpo-pickscore-sample", "data.eval_prompts=flowgrpo-pickscore-sample"]


def test_every_shipped_sampler_has_a_row():
    assert {load_config(f"{r}.yaml").sampler.name for r in RECIPES} <= set(SAMPLERS)


def provide_recipe_files(recipe: str, where: Path) -> None:
    """The files a recipe names (prompt files, reward weights), put under ``where`` as a user copies them
    before the real run: a shipped sample set for a prompt file (the editing set with its images for a
    ``.jsonl``), an empty file for a reward's weights (the smoke run checks they exist, then swaps the reward)."""
    import shutil

    from flowrl.data.prompts import available_sets
    from flowrl.smoke import _names_a_local_file

    sets = Path(__import__("flowrl.data", fromlist=["x"]).__file__).parent / "prompt_sets"
    cfg = load_config(f"{recipe}.yaml")
    for source in (cfg.data.prompts, cfg.data.eval_prompts):
        if isinstance(source, str) and source not in available_sets() and not (where / source).exists():
            (where / source).parent.mkdir(parents=True, exist_ok=True)
            if source.endswith(".jsonl"):
                shutil.copy(sets / "digits_edit_sample.jsonl", where / source)
                shutil.copytree(sets / "digits_edit", (where / source).parent / "digits_edit", dirs_exist_ok=True)
            else:
                shutil.copy(sets / "flowgrpo_pickscore_sample.txt", where / source)
    for spec in (cfg.reward.options, cfg.reward.heldout):
        for options in spec.values():
            for value in (options or {}).values():
                if _names_a_local_file(value) and not value.startswith(("/", "~")):
                    (where / value).parent.mkdir(parents=True, exist_ok=True)
                    (where / value).touch()


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_smoke_run(recipe, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the recipe's files are, as for the real run
    provide_recipe_files(recipe, tmp_path)
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
    editing = {"flux-kontext": "digits-edit-sample", "qwen-image-edit": "digits-edit-multi-sample"}
    if full.model.pipeline in editing:  # an editing run: digits_edit is NaN for a row without its sources
        from helpers import train_records

        assert editing[full.model.pipeline] in saved and all(0 <= r["reward_mean"] <= 1 for r in train_records(run))


def test_smoke_checks_what_the_real_run_reads(tmp_path, monkeypatch, capsys):
    """A prompt file or reward weights the recipe names but this machine lacks fail the smoke run, as they
    would fail the real one (one line from the CLI, nothing written); given on the line, a shipped set passes."""
    from flowrl.cli import main
    from flowrl.errors import ConfigError

    monkeypatch.chdir(tmp_path)  # no data/ here
    with pytest.raises(ConfigError, match=r"--smoke checks what the real run reads, and data\.prompts fails: "
                                          r"prompt file 'data/pickscore/train\.txt' not found.*flowgrpo-pickscore"):
        smoke_config("recipes/sd3_group_pickscore.yaml", [], tmp_path)
    with pytest.raises(ConfigError, match=r"reward\.options\.hps\.checkpoint=checkpoints/HPS_v2\.1_compressed\.pt "
                                          r"is no file here"):
        smoke_config("recipes/sd3_branch_hps.yaml", SAMPLE, tmp_path)
    cfg, _ = smoke_config("recipes/sd3_group_pickscore.yaml", SAMPLE, tmp_path)
    assert cfg.data.prompts == "flowgrpo-pickscore-sample"
    capsys.readouterr()  # what building the tiny model printed
    assert main(["train", "--smoke", "--config", "recipes/sd3_group_pickscore.yaml", "--output-dir",
                 str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("flowrl train: error: --smoke checks what the real run reads")
    assert not (tmp_path / "run").exists()


def test_an_editing_recipe_on_the_hints_prompts(tmp_path, monkeypatch):
    """For an editing model the --smoke error's hint names an editing set; on a text-only set given as that
    hint once did, FLUX.1 Kontext's smoke run keeps the JPEG reward (digits_edit would score nothing: NaN
    reward and loss) and trains text-to-image, and Qwen-Image-Edit, which cannot generate without a source,
    is refused in one line before any model is built."""
    from flowrl.errors import ConfigError

    monkeypatch.chdir(tmp_path)  # no data/ here
    with pytest.raises(ConfigError, match=r"data\.prompts fails: .*\(e\.g\. the shipped digits-edit-sample, an editing "
                                          r"set\)"):
        smoke_config("recipes/flux_kontext_edit.yaml", [], tmp_path)
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
    cfg, ov = smoke_config("recipes/sd3_sol_nvfp4.yaml", SAMPLE, tmp_path)
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
