"""RL co-design: leases, trajectories, pack/fork, clean-room grading, gym-style env."""
