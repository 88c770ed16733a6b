"""Density: swap the edge manages, and pushing paused sandboxes' memory out of RAM and back."""
