"""Helpers of bench/rl.py: host-side cgroup reads, the hand freezer, the copy baseline, statistics."""
