"""Unit tests of the Flower-free layers: core, math (optim, compression, vr, gossip, lazy) and task."""
