"""Benchmarks, each measured side by side in one run (table on stdout, JSON, PNG chart).

- ``precision``: speed, memory and reward-ranking fidelity of Sol-RL's exploration backends
  (``flowrl bench precision``; :func:`flowrl.bench.precision.bench_precision`)
- ``samplers`` / ``training``: reward per wall-clock second of BranchGRPO / TempFlow-GRPO vs flat GRPO
- ``offline``: offline (GDRO) training benchmarks
"""
