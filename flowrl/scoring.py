"""The reward call: scoring finished samples, one chunk at a time, off the sampler's critical path.

:func:`score_images` is the one call every reward goes through (samplers, evaluation, held-out
rewards, the offline dataset's generation and rescoring, the judge): prompt items become texts plus
``sources=`` (:func:`flowrl.conditions.reward_inputs`), videos are reduced to one score per video by
:func:`flowrl.media.score_per_frame` with the stride given as an argument, and a wrong shape is an
error naming the reward.

Flow-GRPO and DDPO hand every sampling batch's images to a thread pool (``executor.submit(reward_fn,
...)``) and keep sampling; every flowrl sampler does the same through one object, :class:`ChunkScorer`:
it samples ``max_batch`` finished samples at a time (a chunk), decodes them, ``submit``s them, and
reads all scores with ``result()`` once the last chunk is out::

    with ChunkScorer(reward) as scorer:
        for rows in row_chunks(n, max_batch):
            images = policy.decode(sample(rows)).float().cpu()   # [n_c, 3, H, W] (videos [n_c, 3, F, H, W])
            scorer.submit(images, prompts[rows])
        scores = scorer.result()                                  # rewards [N], in submission order

Scoring runs on one worker thread shared by the process (chunks are scored one at a time, in order,
so a reward model is never used by two threads at once). The worker scores under ``torch.no_grad``
with the caller's intra-op thread count and CUDA device (both are per thread in torch), so the
overlapped scores are the serial ones bit for bit: the same calls on the same chunks, only their
timing differs. ``reward.overlap = False`` (``reward.overlap: false`` in a config; a reward without
the attribute overlaps) scores each chunk at once on the calling thread, the serial path. A reward
that raises stops the rollout with its own exception: at the next ``submit`` or at ``result``,
after the chunks still queued are cancelled.

Times (``Scores``): ``seconds`` inside the reward calls, ``wait_seconds`` the time the sampler was
blocked on the reward: in the serial path all of ``seconds``, overlapped only the wait after the last
chunk (about one chunk's scoring when sampling and scoring are equally fast).
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import torch

from .conditions import reward_inputs
from .media import score_per_frame
from .types import RewardFn

_POOL: Optional[ThreadPoolExecutor] = None
_POOL_LOCK = threading.Lock()

ScoreFn = Callable[..., tuple[torch.Tensor, dict]]  # (images, prompts, **meta) -> (total [n], components)


def score_images(reward: Optional[RewardFn], images: torch.Tensor, prompts: list, *, frame_stride: Optional[int] = None,
                 **meta) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Run a reward on decoded samples -> (total [N] float32, components name -> [N]).

    ``prompts`` may be :class:`flowrl.data.items.PromptItem` s: the reward gets their texts and,
    when any has a source image, ``sources=`` (:func:`flowrl.conditions.reward_inputs`).

    A reward with a ``components`` method (``flowrl.rewards.MultiReward``) reports its parts and
    ``combine`` makes the total; a wrong shape is an error that names the reward, never a silent
    broadcast.

    Videos ``[N, 3, F, H, W]`` are scored by :func:`flowrl.media.score_per_frame`, the one place frames
    are reduced: every ``frame_stride``-th frame of every video in one image batch, NaN-aware mean
    per video (per component for a ``MultiReward``, before ``combine``). ``frame_stride`` None: the
    stride the reward declares (``MultiReward`` is built with ``reward.frame_stride``), else 1. A
    reward that declares ``takes_videos = True`` gets the videos whole, also inside a ``MultiReward``
    (its ``video_components``).
    """
    n = images.shape[0]
    if reward is None:
        return torch.full((n,), float("nan")), {}
    prompts, meta = reward_inputs(prompts, meta)  # prompt items: their texts, sources= when they have one
    stride = getattr(reward, "frame_stride", 1) if frame_stride is None else frame_stride
    whole = getattr(reward, "takes_videos", False)
    comps: dict[str, torch.Tensor] = {}
    if hasattr(reward, "components"):
        parts = reward.components(images, prompts, **meta) if whole else \
            reward.video_components(images, prompts, stride, **meta) if hasattr(reward, "video_components") else \
            score_per_frame(reward.components, images, prompts, stride, **meta)
        comps = {k: _check_reward(v, n, k) for k, v in parts.items()}
        total = reward.combine(comps)
    else:
        total = reward(images, prompts, **meta) if whole else score_per_frame(reward, images, prompts, stride, **meta)
    name = getattr(reward, "name", type(reward).__name__)
    return _check_reward(total, n, name), comps


def finite_mean(scores: torch.Tensor) -> float:
    """The mean of the finite ``scores`` (a reward is NaN where it does not apply); NaN when none is finite."""
    kept = scores[torch.isfinite(scores)]
    return float(kept.mean()) if kept.numel() else float("nan")


def _check_reward(r, n: int, name: str) -> torch.Tensor:
    r = torch.as_tensor(r).detach().to("cpu", torch.float32)
    if r.shape != (n,):
        raise ValueError(f"reward {name!r} returned shape {tuple(r.shape)} for {n} images; "
                         f"a reward must return one float per image, shape [{n}]")
    return r


def _pool() -> ThreadPoolExecutor:
    """The process's reward worker (one thread, made on first use)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flowrl-reward")
        return _POOL


def overlaps(reward) -> bool:
    """Whether chunks of ``reward`` are scored while the next ones sample (its ``overlap``, default True)."""
    return bool(getattr(reward, "overlap", True))


def row_chunks(n: int, size: Optional[int]) -> Iterator[slice]:
    """Slices of ``range(n)`` with at most ``size`` rows each (one slice of all when ``size`` is None)."""
    step = max(1, size or n)
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


def unit_chunks(units: int, rows_per_unit: int, max_batch: Optional[int]) -> Iterator[slice]:
    """Slices of ``range(units)`` (trees, trajectories) holding at most ``max_batch`` finished samples
    (``rows_per_unit`` per unit), at least one unit each; one slice of all when ``max_batch`` is None."""
    yield from row_chunks(units, None if max_batch is None else max(1, max_batch // max(1, rows_per_unit)))


@dataclass
class Scores:
    """All chunks' scores in submission order."""

    rewards: torch.Tensor                                         # [N] float32 (NaN: not applicable / no reward)
    components: dict[str, torch.Tensor] = field(default_factory=dict)  # name -> [N]
    seconds: float = 0.0       # inside the reward calls (summed over chunks)
    wait_seconds: float = 0.0  # the caller blocked on the reward (serial: all of ``seconds``)

    def stats(self) -> dict[str, float]:
        return {"reward_seconds": self.seconds, "reward_wait_seconds": self.wait_seconds}


def _score_chunk(fn: ScoreFn, images: torch.Tensor, prompts: list[str], meta: dict, threads: int,
                 device: Optional[int]) -> tuple[torch.Tensor, dict, float]:
    """One chunk on the worker thread, in the submitting thread's torch settings."""
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    if device is not None:
        torch.cuda.set_device(device)
    t = time.perf_counter()
    with torch.no_grad():
        total, comps = fn(images, prompts, **meta)
    return total, comps, time.perf_counter() - t


class ChunkScorer:
    """Scores chunks of finished samples in order, overlapped with the caller's sampling (module doc).

    Args:
        reward: the reward (``None``: every sample scores NaN); its ``overlap`` attribute picks the path.
        score: ``(images, prompts, **meta) -> (total [n], components)``; default
            :func:`score_images` of ``reward``.
        overlap: overrides ``reward.overlap``.
    """

    def __init__(self, reward, score: Optional[ScoreFn] = None, overlap: Optional[bool] = None):
        self.reward = reward
        self.fn: ScoreFn = score or (lambda images, prompts, **meta: score_images(reward, images, prompts, **meta))
        self.overlap = overlaps(reward) if overlap is None else bool(overlap)
        self._none = reward is None and score is None
        self._sizes: list[int] = []
        self._pending: list[Future] = []
        self._done: list[tuple[torch.Tensor, dict, float]] = []
        self._wait = 0.0

    def submit(self, images: torch.Tensor, prompts: list[str], **meta) -> None:
        """Score ``images`` [n, 3, H, W] (CPU) with their ``prompts`` after the chunks before them."""
        self._sizes.append(int(images.shape[0]))
        if self._none:
            return
        self._raise_failed()
        if not self.overlap:
            t = time.perf_counter()
            with torch.no_grad():
                total, comps = self.fn(images, list(prompts), **meta)
            dt = time.perf_counter() - t
            self._done.append((total, comps, dt))
            self._wait += dt
            return
        device = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        self._pending.append(_pool().submit(_score_chunk, self.fn, images, list(prompts), meta,
                                            torch.get_num_threads(), device))

    def result(self) -> Scores:
        """Every chunk's scores, concatenated in submission order (waits for the last ones)."""
        n = sum(self._sizes)
        if self._none:
            return Scores(torch.full((n,), float("nan")))
        t = time.perf_counter()
        try:
            for f in self._pending:
                self._done.append(f.result())
        except BaseException:
            self.close()
            raise
        self._pending = []
        self._wait += time.perf_counter() - t if self.overlap else 0.0
        if not self._done:
            return Scores(torch.zeros(0), {}, 0.0, self._wait)
        rewards = torch.cat([d[0] for d in self._done])  # [N]
        names = list(self._done[0][1])
        comps = {k: torch.cat([d[1][k] for d in self._done]) for k in names}  # name -> [N]
        return Scores(rewards, comps, sum(d[2] for d in self._done), self._wait)

    def close(self) -> None:
        """Cancel the chunks not started, wait for the one running (the reward is left idle)."""
        for f in self._pending:
            f.cancel()
        for f in self._pending:
            if not f.cancelled():
                try:
                    f.exception()
                except BaseException:  # noqa: BLE001 (already being raised elsewhere, or cancelled)
                    pass
        self._pending = []

    def _raise_failed(self) -> None:
        """Raise a finished chunk's exception now (the rollout stops instead of sampling on)."""
        for f in self._pending:
            if f.done() and f.exception() is not None:
                self.close()
                raise f.exception()

    def __enter__(self) -> "ChunkScorer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
