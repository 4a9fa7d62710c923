"""accelerate's process-wide settings across several runs in one process (a notebook, a test session).

accelerate keeps one ``AcceleratorState`` per process and refuses an ``Accelerator`` with another mixed
precision (or ``cpu=True`` on a GPU state) once one was made: a bf16 run followed by an fp32 run in the
same process failed to set up (seen in the GPU tests). :func:`forget_stale_accelerate_settings` drops
those settings when, and only when, they would refuse the next run; the process group stays.
"""
from __future__ import annotations


def accelerate_settings_differ(state: dict, mixed_precision: str, cpu: bool) -> bool:
    """Whether accelerate's process-wide settings ``state`` (``AcceleratorState._shared_state``; empty:
    none yet) would refuse an ``Accelerator(cpu=cpu, mixed_precision=mixed_precision)``."""
    if not state:
        return False
    device = state.get("device")
    return state.get("_mixed_precision") != mixed_precision or (cpu and device is not None and device.type != "cpu")


def forget_stale_accelerate_settings(mixed_precision: str, cpu: bool) -> bool:
    """Drop an earlier run's accelerate settings if they would refuse this one; whether it did."""
    from accelerate.state import AcceleratorState

    if not accelerate_settings_differ(AcceleratorState._shared_state, mixed_precision, cpu):
        return False
    AcceleratorState._reset_state(reset_partial_state=False)
    return True
