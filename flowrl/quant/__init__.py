"""Low-precision copies of a policy for exploration (Sol-RL): one backend per file."""
