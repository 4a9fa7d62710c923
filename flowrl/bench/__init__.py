"""Benchmarks, each measured side by side in one run: a table on stdout (progress on stderr), and
JSON + PNG written only where asked (``--out DIR``, or ``--json PATH``).

- ``precision``: speed, memory and reward-ranking fidelity of Sol-RL's exploration backends
  (``flowrl bench precision``; :func:`flowrl.bench.precision.bench_precision`)
- ``samplers`` / ``training``: reward per wall-clock second of BranchGRPO / TempFlow-GRPO vs flat GRPO
- ``offline``: offline (GDRO) training benchmarks

Where a benchmark writes is checked before it runs (:func:`check_outputs`, called by ``flowrl bench``
for every verb): a result is never measured for an hour and then lost to a bad ``--out``.
"""
from __future__ import annotations

# the options of the `flowrl bench` verbs that name where results go, by argparse dest: directories
# (made when absent) and files
OUTPUT_DIRS = ("out", "workdir", "profile")
OUTPUT_FILES = ("json", "png")


def check_outputs(args) -> None:
    """Every output option a bench verb was given (:data:`OUTPUT_DIRS`, :data:`OUTPUT_FILES`) names a place
    this process can write (:mod:`flowrl.bench.outputs`); a ``ConfigError`` naming the option otherwise."""
    from .outputs import check_output_dir, check_output_file

    for dests, check in ((OUTPUT_DIRS, check_output_dir), (OUTPUT_FILES, check_output_file)):
        for dest in dests:
            value = getattr(args, dest, None)
            if value:
                check(value, f"--{dest}")
