"""Benchmarks, each measured side by side in one run: a table on stdout (progress on stderr), and
JSON + PNG written only where asked (``--out DIR``, or ``--json PATH``).

- ``precision``: speed, memory and reward-ranking fidelity of Sol-RL's exploration backends
  (``flowrl bench precision``; :func:`flowrl.bench.precision.bench_precision`)
- ``samplers`` / ``training``: reward per wall-clock second of BranchGRPO / TempFlow-GRPO vs flat GRPO
- ``offline``: offline (GDRO) training benchmarks
"""
