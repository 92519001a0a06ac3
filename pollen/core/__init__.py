"""Core: numpy and the standard library only, below every other layer.

- :mod:`pollen.core.layout`: a model's named arrays <-> one flat float32 vector (trainable) + buffers;
- :mod:`pollen.core.files`: atomic file writes and the one hardened ``.npz`` reader (no pickle, sizes checked
  against the bytes before allocating);
- :mod:`pollen.core.checkpoint`: the checkpoint tree format, on top of :mod:`pollen.core.files`.
"""
