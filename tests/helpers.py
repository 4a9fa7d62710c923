"""Helpers shared by several test modules (test files import from here or from conftest, never from
each other): the tiny-recipe overrides of the SD3 / FLUX / SANA training tests, the fixed prompts and
the plain loops the pipeline tests compare against, readers of a run's files, the sizes of the tiny
reward models (built by conftest's fixtures), and a stub OpenAI-compatible chat server (VLM judge)."""
import base64
import contextlib
import io
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file

from flowrl.sde import ode_step
from flowrl.smoke import DEFAULT_PROMPTS, MODEL_OPTIONS, SMOKE_PIXELS, TRAIN, sampler_smoke_options

ROOT = Path(__file__).resolve().parents[1]
IMAGE = SMOKE_PIXELS  # pixels: 16 x 4 x 4 latents
PROMPTS = list(DEFAULT_PROMPTS)

# which of flowrl.smoke's model-option shrinks every tiny pipeline takes (the smoke run applies only the
# keys a recipe sets; these helpers do not see the recipe)
TINY_MODEL_OPTIONS = ("resolution", "max_sequence_length", "dtype", "gradient_checkpointing")


# For tests that compare two layouts (process counts, FSDP vs DDP, context parallelism): a smooth reward, the
# digits classifier's probability, so the layouts' float32 round-off moves rewards, advantages and gradients by
# round-off alone on any CPU (a JPEG size jumps by whole bytes when one pixel's rounding flips).
SMOOTH_REWARD = {"reward.weights": "{digits: 1.0}", "data.prompts": "[a handwritten digit 3, a handwritten digit 7]",
                 "data.eval_prompts": "[a handwritten digit 3]"}


def tiny_overrides(path, sampler: str, **extra) -> list[str]:
    """Overrides that run a GPU recipe in seconds on a tiny CPU model at ``path``: the shrink tables of
    ``flowrl train --smoke`` (:mod:`flowrl.smoke`, the one source of truth), plus what these tests need
    beyond one smoke iteration: two iterations (the second changes the LoRA again), a large lr, quiet."""
    base = {"model.path": str(path), "model.device": "cpu",
            **{f"model.options.{k}": MODEL_OPTIONS[k] for k in TINY_MODEL_OPTIONS},
            **{f"sampler.{k}": v for k, v in sampler_smoke_options(sampler).items()}, **TRAIN,
            "data.prompts": f"[{', '.join(DEFAULT_PROMPTS)}]", "data.eval_prompts": f"[{DEFAULT_PROMPTS[0]}]",
            "train.iterations": 2, "train.lr": 1e-2, "logging.progress": "false"}
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def train_records(run) -> list[dict]:
    """The training records (one per iteration) of a run's ``metrics.jsonl``."""
    return [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines() if "reward_mean" in line]


def two_grpo_iterations(run) -> tuple[list[dict], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The checks every model's two-iteration GRPO run passes -> (its training records, the LoRA tensors of
    its two checkpoints): iterations 0 and 1 logged, finite loss and gradient norm, and a first-minibatch
    ratio of 1 (the update rescores the rollout's own transitions: before any step, new == old policy)."""
    from flowrl.checkpoints.common import list_checkpoints

    recs = train_records(run)
    assert [r["iteration"] for r in recs] == [0, 1]
    assert abs(recs[0]["ratio_mean"] - 1) < 1e-4
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all() for r in recs)
    ck1, ck2 = list_checkpoints(Path(run) / "checkpoints")
    return recs, lora_weights(ck1), lora_weights(ck2)


def lora_weights(ckpt) -> dict[str, torch.Tensor]:
    """The trainable (LoRA) tensors of a checkpoint directory."""
    return load_file(str(Path(ckpt) / "trainable.safetensors"))


def fixed_velocity(policy, transformer) -> torch.Tensor:
    """v(x, sigma, c) of ``transformer`` inside ``policy`` on fixed inputs (CFG / guidance as trained):
    two seeds, sigmas 0.9 / 0.45, the two :data:`PROMPTS`."""
    policy.transformer = transformer
    cond = policy.encode_prompts(PROMPTS)
    x = policy.initial_noise([11, 12])  # [2, C, h, w]
    with torch.no_grad():
        return policy.velocity(x, torch.tensor([0.9, 0.45]), cond)


def ode_loop(policy, prompts, seeds, num_steps) -> torch.Tensor:
    """Plain Euler over ``policy.sigmas(num_steps)``, written out (no sampler) -> x0 [B, C, h, w]; ``prompts``
    are strings or prompt items (conditioned through ``flowrl.conditions.encode_conditions``)."""
    from flowrl.conditions import encode_conditions

    x = policy.initial_noise(seeds)  # [B, C, h, w]
    cond = encode_conditions(policy, prompts)
    sig = policy.sigmas(num_steps)
    with torch.no_grad():
        for i in range(num_steps):
            v = policy.velocity(x, sig[i].expand(len(seeds)), cond)
            x = ode_step(v, x, sig[i], sig[i + 1]).sample
    return x


def cli_verbs(help_text: str) -> set[str]:
    """The sub-commands an argparse ``--help`` lists, in its ``{a,b,c}`` choices or one per line under a
    sub-command metavar (exact names, so ``train`` is not found inside ``pretrain-digits``)."""
    found = re.search(r"\{([a-z0-9,_-]+)\}", help_text)
    if found:
        return set(found.group(1).split(","))
    # a sub-command metavar (VERB): one name per line, indented four spaces (descriptions wrap deeper)
    return set(re.findall(r"^    ([a-z][a-z0-9_-]*)(?= |$)", help_text, re.M))


# ---------------------------------------------------------------- tiny reward models (conftest fixtures)
TINY_VISION = dict(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=2)  # CLIP vision tower
TINY_MED = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                max_position_embeddings=40)  # ImageReward's BLIP-med text tower
TINY_BLIP_VISION = dict(image_size=32, patch_size=8, hidden_size=24, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=2)
BLIP_WORDS = "a an the of on in photo chinese temple hills red flower dog word hello sign".split()


def randomize_(module, std):
    """Spread random weights (matrices ~ N(0, std)) so tiny models give clearly distinct outputs."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return module


def fake_hub_cache(cache: Path, repo_id: str, files: dict, repo_type: str = "model", commit: str = "c" * 40) -> Path:
    """A Hugging Face hub cache at ``cache`` holding ``files`` ({path in the repository: local file to copy})
    of ``repo_id`` at ``commit``, its ``main`` branch pointing there (the layout huggingface_hub reads
    offline); returns ``cache``."""
    import shutil

    repo = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    for name, src in files.items():
        (repo / "snapshots" / commit / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(src, repo / "snapshots" / commit / name)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return cache


# ---------------------------------------------------------------- stub chat-completions server
class StubChatHandler(BaseHTTPRequestHandler):
    """Answers ``POST .../chat/completions`` like an OpenAI-compatible VLM: decodes the request's (last)
    PNG and replies "Score: 10 x mean brightness". Per-request behaviours are queued in ``server.modes``
    (``slow``, ``http500``, ``http401``, ``not_json``, ``garbage``); requests are kept in ``server.requests``."""

    def log_message(self, *args):  # keep test output quiet
        pass

    def do_POST(self):
        srv = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with srv.lock:
            srv.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
            mode = srv.modes.pop(0) if srv.modes else "ok"
        if mode == "slow":
            time.sleep(srv.slow_seconds)
        if mode == "http500":
            return self._send(500, b'{"error": "overloaded"}')
        if mode == "http401":
            return self._send(401, b'{"error": "bad key"}')
        if mode == "not_json":
            return self._send(200, b"<html>gateway error</html>")
        if mode == "garbage":
            return self._reply("I am sorry, I cannot rate images of this kind.")
        parts = body["messages"][-1]["content"]
        url = [p["image_url"]["url"] for p in parts if p["type"] == "image_url"][-1]  # an edit: source, then result
        assert url.startswith("data:image/png;base64,")
        png = Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))
        assert png.format == "PNG"
        brightness = np.asarray(png.convert("L"), dtype=np.float64).mean() / 255
        self._reply(f"The image matches the caption reasonably.\nScore: {10 * brightness:.3f}")

    def _reply(self, content):
        choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
        data = {"id": "x", "object": "chat.completion", "choices": [choice]}
        self._send(200, json.dumps(data).encode())

    def _send(self, code, payload):
        try:
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
            pass


@contextlib.contextmanager
def chat_stub_server():
    """A :class:`StubChatHandler` server on 127.0.0.1 (ephemeral port, ``server.server_port``), stopped on exit."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), StubChatHandler)
    server.daemon_threads = True
    server.requests, server.modes, server.lock, server.slow_seconds = [], [], threading.Lock(), 1.0
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def write_recipe(path, base: str, **changes):
    """Shipped recipe ``base`` with ``{section.key: value}`` changes, written to ``path`` (returned)."""
    import yaml

    from flowrl.trainers.config_text import read_recipe, recipes_dir

    d = read_recipe(recipes_dir() / base)
    for key, v in changes.items():
        sec, k = key.split(".")
        d[sec][k] = v
    path.write_text(yaml.safe_dump(d))
    return path
