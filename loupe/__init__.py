"""Loupe: train and evaluate vision-language models that search large images by zooming.

The shared library: what two or more stages use (protocol, crop tool, trajectories, rollout, rewards, data,
the embedded tiny model). Each stage's own logic lives in `stages/<name>/`.
"""

__version__ = "0.1.0"
