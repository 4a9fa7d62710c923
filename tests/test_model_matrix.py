"""Every sampler and every update on each of the newer models (Qwen-Image, FLUX.1 Kontext, Wan2.1 and
Wan2.2 text-to-video, Qwen-Image-Edit, FLUX.2 [dev], FLUX.2 [klein], Z-Image-Turbo, Qwen-Image 2.1, Krea 2,
ERNIE-Image, HunyuanImage 2.1), two iterations each, through the model's own shipped recipe.

Each case takes the recipe, swaps in the sampler and update under test, and shrinks the rest with
``flowrl train --smoke``'s table (``flowrl.smoke.smoke_overrides``: the tiny random model, 32 px, a
few steps and samples). The group sampler with GRPO is each model's own test (test_qwen_image.py,
test_flux_kontext.py, test_wan.py, test_flux2.py, test_z_image.py, test_qwen_image21.py, test_krea2.py,
test_ernie_image.py, test_hunyuan_image.py); here: branch with GRPO-Guard, TempFlow with GRPO, Sol exploring
with ``int8-dynamic`` (DiffusionNFT) and with ``nvfp4-emulated`` (online DPO), online GDRO, and
offline GDRO on a generated dataset. Kontext trains on the shipped digits editing set with the
``digits_edit`` reward (NaN without a source: a finite reward shows the source reached it),
Qwen-Image-Edit on the multi-source one (one to three sources per row; NaN without every source an
instruction needs); Wan on videos with a per-frame reward, Wan2.2 with both experts trained (the LoRA of
each changes; under its recipe's FSDP2 sharding). The exported LoRA of each model loading into its
diffusers pipeline is in the model's own test."""
import math

import pytest
import torch

from flowrl.checkpoints import checkpoint_tensors
from flowrl.checkpoints.common import list_checkpoints
from flowrl.smoke import sampler_smoke_options, smoke_overrides
from flowrl.trainers.config import load_config
from helpers import train_records

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models run best on one thread

RECIPES = {"qwen-image": "qwen_image_group_pickscore", "flux-kontext": "flux_kontext_edit", "wan": "wan_group_ocr",
           "qwen-image-edit": "qwen_image_edit_group_pickscore", "flux2": "flux2_group_pickscore",
           "flux2-klein": "flux2_klein_group_pickscore", "z-image": "z_image_turbo_group_pickscore",
           "wan2.2": "wan22_group_pickscore", "qwen-image-2.1": "qwen_image21_group_pickscore",
           "krea2": "krea2_group_pickscore", "ernie-image": "ernie_image_group_pickscore",
           "hunyuan-image": "hunyuan_image_group_pickscore", "ltx2": "ltx2_group_pickscore",
           "hunyuan-video-1.5": "hunyuan_video15_group_pickscore"}
EDITING = {"flux-kontext": "digits-edit-sample", "qwen-image-edit": "digits-edit-multi-sample"}  # flowrl.smoke


def sampler(name: str, **extra) -> str:
    """An override replacing the recipe's sampler section with ``name`` at its smoke size (the table's
    dotted keys nested), so the recipe's batch size check passes before the shrinking."""
    opts: dict = {}
    for k, v in {**sampler_smoke_options(name), **extra}.items():
        head, _, tail = k.partition(".")
        if tail:
            opts.setdefault(head, {})[tail] = v
        else:
            opts[k] = v
    flow = lambda d: "{" + ", ".join(f"{k}: {flow(v) if isinstance(v, dict) else v}" for k, v in d.items()) + "}"  # noqa: E731
    return f"sampler={flow({'name': name, **opts})}"


# case -> (overrides before the smoke shrinking: the sampler and update; overrides after it)
CASES = {
    "branch-grpo_guard": ([sampler("branch"), "train.loss=grpo_guard"], []),
    "tempflow-grpo": ([sampler("tempflow")], []),
    "sol_int8-nft": ([sampler("sol", regen="ode"), "train.loss=nft"], []),
    "sol_nvfp4-dpo": ([sampler("sol", explore_backend="nvfp4-emulated"), "train.loss=dpo"],
                      ["sampler.explore_backend=nvfp4-emulated"]),
    "group-gdro": ([sampler("group"), "train.loss=gdro"], []),
    "offline_gdro": (["train.mode=offline", "train.loss=offline_gdro"],
                     ["offline.max_steps=2", "offline.epochs=2"]),
}
BATCH = ["train.batch_size=4"]  # every smoke row's samples per prompt divides it
# per model, after the shrinking: Qwen-Image and FLUX.2 [dev] unsharded (their LoRA read back as one file), Wan's
# reward scores every 2nd frame (Kontext: the smoke table's editing set and digits_edit)
# Qwen-Image-Edit: the tiny random model's digits_edit scores on the multi-source sums differ by ~1e-6 within a
# tree, under the advantage's eps; a dense 0.001 x JPEG size term gives every case a signal (digits_edit's NaN
# without its sources still makes the total NaN, so a finite reward still shows every source arrived)
MODEL = {"qwen-image": ["train.sharding=none"], "wan": ["reward.frame_stride=2"], "flux-kontext": [],
         "qwen-image-edit": ["reward.weights={digits_edit: 1.0, jpeg_incompressibility: 0.001}"],
         "flux2": ["train.sharding=none"], "flux2-klein": [], "z-image": [],
         "wan2.2": ["reward.frame_stride=2", "train.batch_size=8"], "qwen-image-2.1": [], "krea2": [],
         "ernie-image": [], "hunyuan-image": [], "ltx2": ["reward.frame_stride=2"],
         "hunyuan-video-1.5": ["reward.frame_stride=2"]}
# per model, before the shrinking: FLUX.2 [dev]'s recipe normalises per reward (Flow-Factory's GDPO), which only
# the GRPO-family updates take; the smoke run has one reward, where the sum is the same
FIRST = {"flux2": ["reward.aggregate=sum"]}
# Wan2.2's two experts both train: the trained steps lie on both sides of the tiny's boundary (timestep 500; the
# smoke schedule's 3 steps are at 1000, 750, 3: TempFlow branches at the last two), and 8 samples per iteration
# give the updates that draw a time per sample (NFT, DPO, GDRO) times on both sides
EXPERTS = {"wan2.2": ("transformer.", "transformer_2.")}
CASE_MODEL = {("wan2.2", "tempflow-grpo"): ["sampler.branch_steps=[1, 2]"]}
TWO = ["train.iterations=2", "logging.progress=false"]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("pipeline", list(RECIPES))
def test_two_iterations(pipeline, case, tiny_model, tmp_path):
    before, after = CASES[case]
    recipe = f"recipes/{RECIPES[pipeline]}.yaml"
    before = [*before, *FIRST.get(pipeline, [])]
    first = load_config(recipe, [*before, *BATCH])
    cfg = load_config(recipe, ov := [*before, *smoke_overrides(first, tiny_model(pipeline), tmp_path), *TWO,
                                     *MODEL[pipeline], *CASE_MODEL.get((pipeline, case), []), *after])
    assert cfg.model.pipeline == pipeline and cfg.train.loss == first.train.loss
    assert cfg.data.prompts == EDITING.get(pipeline, cfg.data.prompts) and (cfg.data.prompts in EDITING.values()) == (
        pipeline in EDITING)
    run = tmp_path / "run"
    if cfg.train.mode == "offline":
        from flowrl.trainers.offline import generate_offline, train

        generate_offline(cfg, str(tmp_path / "dataset"), progress=False)
        cfg = load_config(recipe, [*ov, f"offline.dataset={tmp_path / 'dataset'}"])
        summary = train(cfg, run)
        assert summary["steps_done"] == 2
    else:
        from flowrl.trainers.online import train

        summary = train(cfg, run)
        assert summary["iterations_done"] == 2 and summary["skipped_steps"] == 0
        recs = train_records(run)
        assert [r["iteration"] for r in recs] == [0, 1]
        assert all(math.isfinite(r["reward_mean"]) and math.isfinite(r["loss"]) for r in recs)
        if pipeline in EDITING:
            assert all(0 <= r["reward_mean"] <= 1 for r in recs)  # digits_edit saw every source
    ck = list_checkpoints(run / "checkpoints")
    assert len(ck) == 2
    w1, w2 = checkpoint_tensors(ck[0], "trainable"), checkpoint_tensors(ck[1], "trainable")  # either format
    for prefix in EXPERTS.get(pipeline, ("",)):  # each expert of a two-expert model
        part = {k: v for k, v in w2.items() if k.startswith(prefix)}
        assert any(".lora_B." in k and v.abs().sum() > 0 for k, v in part.items()), prefix  # B starts at 0: it trained
        assert any(not torch.equal(w1[k], part[k]) for k in part), prefix  # and again in the second iteration
