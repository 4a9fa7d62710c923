"""Measurement helpers of the precision benchmarks: peak memory, device timing, machine description."""
from __future__ import annotations

import os
import platform
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import torch


def _rss_bytes() -> Optional[int]:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        try:
            import psutil

            return int(psutil.Process().memory_info().rss)
        except Exception:  # noqa: BLE001 - memory is reported as unknown then
            return None


def _malloc_trim() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the peak then includes cached heap
        pass


class PeakMemory:
    """Peak memory inside the block, bytes: CUDA peak allocation (``torch.cuda.max_memory_allocated``),
    else resident memory sampled every 5 ms (``base``: at entry, after returning freed heap to the
    OS; ``peak``: the maximum seen)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device
        self.base = self.peak = None
        self._stop = threading.Event()

    def __enter__(self) -> "PeakMemory":
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        else:
            _malloc_trim()  # hand freed heap back to the OS, so the peak shows this block's own growth
            self.base = self.peak = _rss_bytes()
            if self.base is not None:
                self._thread = threading.Thread(target=self._poll, daemon=True)
                self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(0.005):
            r = _rss_bytes()
            if r is not None and r > self.peak:
                self.peak = r

    def __exit__(self, *exc) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device)
        elif self.base is not None:
            self._stop.set()
            self._thread.join()
            r = _rss_bytes()
            self.peak = max(self.peak, r or 0)


def sync_device(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing on a CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds ``fn()`` takes: CUDA events around it on a GPU (device time of the queued work,
    host launch gaps included), ``perf_counter`` on a CPU."""
    if device.type == "cuda":
        sync_device(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000.0
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``, as ``lscpu`` shows it), else the platform's processor."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict:
    """torch / CUDA versions, CPU and GPU names, threads, load, nvidia-modelopt version."""
    info = {"torch": torch.__version__, "cuda": torch.version.cuda, "threads": torch.get_num_threads(),
            "python": platform.python_version(), "cpu": cpu_name()}
    try:
        info["load_average"] = list(os.getloadavg())
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        cap = torch.cuda.get_device_capability()
        info["gpu_capability"] = f"sm_{cap[0]}{cap[1]}"
        info["gpu_memory_gb"] = round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1)
    try:
        from importlib.metadata import version

        info["nvidia_modelopt"] = version("nvidia-modelopt")
    except Exception:  # noqa: BLE001 - not installed
        info["nvidia_modelopt"] = None
    return info


def write_outputs(out: dict, json_path, png_path, log: Callable[[str], None],
                  plot: Callable[[dict, Path], None]) -> dict:
    """Write a benchmark result where asked: JSON (atomic) at ``json_path``, its plot at ``png_path``
    (default beside the JSON); each file written is named to ``log``. The table is the caller's to
    print (``flowrl bench precision`` prints it on stdout)."""
    from ..utils.io import write_json

    if json_path:
        jp = Path(json_path)
        write_json(out, jp)
        png_path = png_path or jp.with_suffix(".png")
        log(f"[bench precision] wrote {jp}")
    if png_path:
        plot(out, Path(png_path))
        out["png"] = str(png_path)
        log(f"[bench precision] wrote {png_path}")
    return out
