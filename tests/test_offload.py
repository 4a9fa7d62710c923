"""`train.offload` (flowrl/distributed/offload.py): the settings and their errors, modules kept in host memory
and moved to the device for each call, the EMA in host memory, and text encoders not loaded at all when the
text-embedding cache holds every prompt."""
import pytest
import torch

from flowrl.errors import ConfigError
from flowrl.trainers.config import load_config
from helpers import ROOT, tiny_overrides

WAN = ROOT / "recipes" / "wan_group_ocr.yaml"


def test_offload_settings_and_their_errors():
    cfg = load_config(WAN, ["train.sharding=fsdp", "train.cpu_offload=true", "train.offload={vae: true}"])
    assert cfg.train.offload == {"fsdp": True, "text_encoders": False, "vae": True, "reference": False, "ema": False}
    assert load_config(WAN, ["train.sharding=fsdp", "train.offload={fsdp: true}"]).train.cpu_offload is True
    for bad, match in [("train.offload={gpu: true}", "train.offload.gpu: unknown"),
                       ("train.offload={vae: yes please}", "must be true or false"),
                       ("train.offload={fsdp: true}", "needs train.sharding=fsdp"),
                       ("train.offload={reference: true}", "train.sharding=fsdp"),
                       ("train.offload=[vae]", "train.offload must be a mapping")]:
        with pytest.raises(ConfigError, match=match):
            load_config(WAN, [bad])
    with pytest.raises(ConfigError, match="no effect with LoRA"):
        load_config(WAN, ["train.sharding=fsdp", "train.offload={reference: true}"])
    with pytest.raises(ConfigError, match="without train.ema=true"):
        load_config(WAN, ["train.ema=false", "train.offload={ema: true}"])


class Recording(torch.nn.Linear):
    """A layer that records where it is moved."""

    moves: list

    def to(self, *args, **kwargs):
        self.moves.append(str(args[0]))
        return super().to(*args, **kwargs)

    def twice(self, x):  # a method calling the forward (as a VAE's decode calls its decoder)
        return self(self(x))


def test_keep_on_host_moves_in_for_each_call_and_back():
    from flowrl.distributed.offload import keep_on_host

    m = Recording(2, 2)
    m.moves = []
    keep_on_host(m, torch.device("cpu"), ("forward", "twice"))
    assert m.moves == ["cpu"]  # to the host at once
    assert m(torch.ones(1, 2)).shape == (1, 2) and m.moves == ["cpu", "cpu", "cpu"]  # in for the call, back after
    m.moves.clear()
    m.twice(torch.ones(1, 2))
    assert m.moves == ["cpu", "cpu"]  # nested calls: one move in, one back


def test_offloaded_components_and_text_encoders_not_loaded(tiny_model, tmp_path):
    from flowrl.builders import build_policy_from_config
    from flowrl.data.embeddings import attach_text_cache, text_cache_covers
    from flowrl.distributed.offload import Offload, offload_idle

    ov = tiny_overrides(tiny_model("wan"), "group", **{"model.text_embedding_cache": str(tmp_path / "emb"),
                                                        "model.drop_text_encoders": "true"})
    cfg = load_config(WAN, ov)
    prompts = cfg.data.train_prompts() + cfg.data.eval_prompt_set()
    assert not text_cache_covers(cfg.model, prompts)  # no cache yet
    policy = build_policy_from_config(cfg, "cpu")
    assert offload_idle(policy, Offload(text_encoders=True, vae=True), torch.device("cpu")) == ["text_encoder", "vae"]
    assert hasattr(policy.vae.decode, "__wrapped__") and hasattr(policy.pipe.text_encoder.forward, "__wrapped__")
    cached = attach_text_cache(policy, cfg.model, prompts)  # encodes through the offloaded encoder, then drops it
    first = cached.encode_prompts(prompts[:1])
    assert text_cache_covers(cfg.model, prompts) and not text_cache_covers(cfg.model, prompts + ["a new prompt"])
    again = build_policy_from_config(cfg, "cpu", without_text_encoders=True)
    assert again.pipe.text_encoder is None  # never loaded
    served = attach_text_cache(again, cfg.model, prompts).encode_prompts(prompts[:1])
    assert all(torch.equal(first[k], served[k]) for k in first)


def test_ema_in_host_memory_averages_the_same():
    from flowrl.trainable import EMA

    torch.manual_seed(0)
    m = torch.nn.Linear(3, 3)
    a, b = EMA(m, 0.9), EMA(m, 0.9, host=True)
    with torch.no_grad():
        m.weight.add_(1.0)
    a.update(m)
    b.update(m)
    assert all(torch.equal(a.shadow[k], b.shadow[k]) and b.shadow[k].device.type == "cpu" for k in a.shadow)
