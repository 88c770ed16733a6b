"""Density: swap the edge manages, pushing paused sandboxes' memory out of RAM and back, KSM,
and CPU classes."""
