"""Tensor parallelism: how a model is split over ranks (partition.py), the process group the ranks
share (group.py), and starting the ranks of one worker (ranks.py)."""
