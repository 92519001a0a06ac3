"""Core: numpy and the standard library only, below every other layer.

- :mod:`pollen.core.layout`: a model's named arrays <-> one flat float32 vector (trainable) + buffers;
- :mod:`pollen.core.files`: atomic file writes;
- :mod:`pollen.core.checkpoint`: the checkpoint tree format (no pickle; sizes checked before allocating).
"""
