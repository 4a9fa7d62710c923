"""``flowrl bench reward``: training-iteration wall time with the reward scored serially, overlapped
with sampling, and served from a second process; and a latency-bound judge, side by side in one run.

Variants (one ``OnlineTrainer`` each, the same tiny SD3 pipeline, prompts, seeds and GRPO update):

- ``ocr_serial``: the OCR reward (EasyOCR, offline weights) scored after the rollout (``reward.overlap: false``);
- ``ocr_overlap``: the same reward scoring each finished chunk (``sampler.max_batch``) while the next samples;
- ``ocr_served``: the same reward behind ``flowrl serve-reward ocr`` in a second process (``remote``), overlapped;
- ``judge_serial`` / ``judge_overlap``: the VLM judge (``vlm_judge``) against a local OpenAI-compatible stub that
  answers every request after ``judge_delay`` seconds (a latency-bound reward: a remote VLM), serial / overlapped.
  ``judge_delay="auto"`` makes the judge's time per iteration about the serial OCR run's rollout time.

The variants run iteration by iteration in turn (so the machine's load drifts alike for all),
``iterations`` timed ones after one warm-up; the JSON and the table give the mean
iteration wall time and its parts (rollout, reward, reward wait, update) and the checks that the
overlapped and served rewards equal the serial ones bit for bit. On a machine where sampling and the
reward share the same cores (this project's 2-core CPU) overlap only hides what the reward does
not compete for; a reward on its own hardware (another GPU, node, or a remote judge) hides up to
``min(rollout, reward)`` per iteration: the iteration approaches ``max(rollout, reward) + update``.

    flowrl bench reward --out bench --iterations 5
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
import numpy as np

from ..errors import BenchError
from ..utils.io import write_json
from .precision_measure import cpu_name

VARIANTS = ("ocr_serial", "ocr_overlap", "ocr_served", "judge_serial", "judge_overlap")
OCR_PROMPTS = ['a shop sign that says "OPEN"', 'a poster with the word "HELLO"', 'a mug printed with "CAFE"',
               'a street sign reading "STOP"']


def _overrides(model_dir: Path, a) -> list[str]:
    return [f"model.path={model_dir}", "model.device=cpu", f"model.options.resolution={a.resolution}",
            "model.options.max_sequence_length=16", "model.options.dtype=float32", "model.guidance_scale=1.0",
            "model.options.gradient_checkpointing=false", f"sampler.group_size={a.group_size}",
            f"sampler.num_steps={a.num_steps}", f"sampler.max_batch={a.max_batch}",
            f"train.batch_size={a.prompts * a.group_size}", "train.mixed_precision='no'",
            f"train.minibatch_size={a.max_batch}", "train.grad_accum=1000", "train.ema=false",
            "reward.heldout={}", f"data.prompts={json.dumps(OCR_PROMPTS)}", f"data.eval_prompts={json.dumps(OCR_PROMPTS[:1])}",
            "data.eval_seeds_per_prompt=2", "logging.trackers=[]", "logging.progress=false", "logging.eval_every=100000",
            "logging.image_every=100000", f"train.iterations={a.iterations + 1}", "train.checkpoint_every=100000"]


def _trainer(overrides: list[str], workdir: Path):
    from ..trainers.config import load_config
    from ..trainers.online import OnlineTrainer

    tr = OnlineTrainer(load_config("sd3_group_pickscore", overrides), Path(tempfile.mkdtemp(dir=workdir)))
    tr.setup()
    return tr


def _iteration(tr, it: int) -> tuple[dict, list]:
    t0 = time.perf_counter()
    res = tr.run_iteration(it)
    m = res.metrics
    return ({"iteration_seconds": time.perf_counter() - t0, "rollout_seconds": m["rollout_seconds"],
             "reward_seconds": m["reward_seconds"], "reward_wait_seconds": m["reward_wait_seconds"],
             "update_seconds": m["update_seconds"]}, res.rollout.rewards.tolist())


class _Stub:
    """An OpenAI-compatible chat-completions stub answering ``Score: 7`` after ``delay`` seconds per
    request (a mutable attribute), served from a thread; a context manager yielding its API base URL."""

    def __init__(self, delay: float):
        self.delay = delay

    def app(self):
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse
        from starlette.routing import Route

        async def chat(request):
            import asyncio

            await request.body()
            await asyncio.sleep(self.delay)
            return JSONResponse({"choices": [{"message": {"role": "assistant", "content": "Legible. Score: 7"}}]})

        return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])

    def __enter__(self) -> str:
        import asyncio
        import socket
        import threading

        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(256)
        self.server = uvicorn.Server(uvicorn.Config(self.app(), log_level="error", access_log=False, lifespan="off"))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])), daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def bench_reward(a) -> dict:
    """Every chosen variant set up once, then run iteration by iteration in turn (the machine's load
    drifts alike for all); iteration 0 warms up and, with ``judge_delay="auto"``, sets the judge's delay."""
    import torch

    from ..pipelines.tiny import make_tiny
    from flowrl.rewards.server_process import spawn

    unknown = set(a.variants or []) - set(VARIANTS)
    if unknown:
        raise BenchError(f"unknown variant(s) {sorted(unknown)} of bench reward; choose from {list(VARIANTS)}")
    chosen = [v for v in VARIANTS if not a.variants or v in a.variants]
    work = Path(tempfile.mkdtemp(prefix="flowrl-bench-reward-"))
    base = _overrides(make_tiny("sd3", work / "tiny-sd3", image_size=a.resolution), a)
    # every variant adds 0.001 x JPEG compressibility: a random tiny model scores 0 on OCR and a stub judge
    # answers one score, and groups without variance would skip the GRPO update the iteration time includes
    tie = "jpeg_compressibility: 0.001"
    ocr = [f"reward.weights={{ocr: 1.0, {tie}}}", f"reward.options={{ocr: {{backend: {a.ocr_backend}}}}}"]
    n = a.prompts * a.group_size
    rounds = -(-n // a.max_batch) * -(-min(a.max_batch, n) // a.judge_concurrency)  # judge request rounds per iteration
    stub = _Stub(0.0 if a.judge_delay == "auto" else float(a.judge_delay))
    with contextlib.ExitStack() as stack:
        api = stack.enter_context(stub) if any(v.startswith("judge") for v in chosen) else None
        overrides = {}
        for name in chosen:
            overlap = [f"reward.overlap={'false' if name.endswith('serial') else 'true'}"]
            if name == "ocr_served":
                print("[bench reward] starting `flowrl serve-reward ocr` in a second process", flush=True)
                server = stack.enter_context(spawn("ocr", options=[f"backend={a.ocr_backend}"]))
                overrides[name] = [f"reward.weights={{remote: 1.0, {tie}}}",
                                   f"reward.options={{remote: {{url: '{server.url}', timeout: 600}}}}"] + overlap
            elif name.startswith("judge"):
                overrides[name] = [f"reward.weights={{vlm_judge: 1.0, {tie}}}",
                                   f"reward.options={{vlm_judge: {{url: '{api}', concurrency: {a.judge_concurrency}, "
                                   f"timeout: 600}}}}"] + overlap
            else:
                overrides[name] = ocr + overlap
        trainers = {name: _trainer(base + overrides[name], work) for name in chosen}
        rows = {name: [] for name in chosen}
        rewards = {name: [] for name in chosen}
        for it in range(a.iterations + 1):
            for name, tr in trainers.items():
                print(f"[bench reward] iteration {it} {name}", flush=True)
                row, r = _iteration(tr, it)
                rewards[name].append(r)
                if it:  # iteration 0 warms up (allocations, EasyOCR's first batch, connections)
                    rows[name].append(row)
                elif name == "judge_serial" and a.judge_delay == "auto":
                    stub.delay = row["rollout_seconds"] / rounds  # judging as long as sampling
        for tr in trainers.values():
            tr.acc.end_training()
    out = {"settings": {**{k: getattr(a, k) for k in ("resolution", "prompts", "group_size", "num_steps", "max_batch",
                                                      "iterations", "ocr_backend", "judge_concurrency")},
                        "judge_delay_seconds": stub.delay, "tie_breaker": tie},
           "machine": {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads()},
           "variants": {}, "checks": {}}
    for name in chosen:
        mean = {k: float(np.mean([r[k] for r in rows[name]])) for k in rows[name][0]}
        out["variants"][name] = {**mean, "per_iteration": rows[name], "rewards": rewards[name]}
    res = out["variants"]
    for serial, others in (("ocr_serial", ("ocr_overlap", "ocr_served")), ("judge_serial", ("judge_overlap",))):
        for o in others:
            if serial in res and o in res:
                out["checks"][f"{o}_rewards_equal_{serial}"] = rewards[o] == rewards[serial]
        s = res.get(serial)
        for name in (serial, *others):
            if s and name in res:
                res[name]["speedup_vs_serial"] = s["iteration_seconds"] / res[name]["iteration_seconds"]
                res[name]["bound_max_rollout_reward_plus_update"] = max(s["rollout_seconds"], s["reward_seconds"]) \
                    + s["update_seconds"]
    if a.out:
        path = Path(a.out) / "reward.json"
        write_json(out, path)
        print(f"[bench reward] wrote {path}", flush=True)
    return out


def table(out: dict) -> str:
    rows = [f"{'variant':<15}{'iter s':>8}{'rollout':>9}{'reward':>9}{'wait':>8}{'update':>8}{'vs serial':>11}"
            f"{'bound':>8}"]
    for name, r in out["variants"].items():
        sp = r.get("speedup_vs_serial")
        bound = r.get("bound_max_rollout_reward_plus_update")
        rows.append(f"{name:<15}{r['iteration_seconds']:>8.2f}{r['rollout_seconds']:>9.2f}{r['reward_seconds']:>9.2f}"
                    f"{r['reward_wait_seconds']:>8.2f}{r['update_seconds']:>8.2f}"
                    f"{(f'{sp:.2f}x' if sp else '-'):>11}{(f'{bound:.2f}' if bound else '-'):>8}")
    rows += [f"check {k}: {v}" for k, v in out.get("checks", {}).items()]
    rows.append(f"machine: {out['machine']['cpu']}, {out['machine']['cores']} cores ('bound': the serial run's "
                f"max(rollout, reward) + update, what overlap approaches when the reward has its own hardware)")
    return "\n".join(rows)


def add_reward_parser(bench_sub) -> None:
    p = bench_sub.add_parser("reward", help="iteration time: reward serial vs overlapped vs served, and a latency-bound "
                                            "judge (JSON + table)")
    p.add_argument("--resolution", type=int, default=128)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--num-steps", type=int, default=10)
    p.add_argument("--max-batch", type=int, default=8, help="samples per chunk (scored while the next samples)")
    p.add_argument("--iterations", type=int, default=3, help="timed iterations per variant (after one warm-up)")
    p.add_argument("--ocr-backend", default="easyocr", choices=("easyocr", "rapidocr", "tesseract"),
                   help="the OCR engine (easyocr: the engine docs/bench_reward.json was measured with)")
    p.add_argument("--judge-delay", default="auto", help="seconds the judge stub takes per request; 'auto': the "
                                                         "judge's time per iteration = the serial OCR rollout's")
    p.add_argument("--judge-concurrency", type=int, default=4)
    p.add_argument("--variants", nargs="*", default=None, help=f"subset of {list(VARIANTS)}")
    p.add_argument("--out", default=None, help="directory for reward.json (default: none written; the table is "
                                               "printed on stdout)")
    p.set_defaults(fn=lambda a: table(bench_reward(a)))

