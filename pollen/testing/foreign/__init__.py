"""Flower's own example projects, rebuilt with local data: where pollen's strategies are dropped in.

Each module is one of Flower's examples as a user has it (its model, its ``train`` / ``test``, its
``ClientApp`` with ``@app.train()`` / ``@app.evaluate()``, its sampling and learning rate), with one
change: the data are made here or read from disk, since the Hugging Face hub cannot be reached.

- :mod:`~pollen.testing.foreign.quickstart_pytorch`: ``examples/quickstart-pytorch`` (LeNet on 32x32
  colour images, SGD with momentum, IID partitions);
- :mod:`~pollen.testing.foreign.fl_tabular`: ``examples/fl-tabular`` (an MLP on 14 standardised census
  features, local Adam, binary cross-entropy);
- :mod:`~pollen.testing.foreign.advanced_pytorch`: ``examples/advanced-pytorch`` (a larger CNN on
  Fashion-MNIST with crop-and-flip augmentation, Dirichlet(1.0) label skew, half the clients a round).

:mod:`~pollen.testing.foreign.harness` runs any strategy on any of them in process, as ``flwr run`` would
on a local simulation (one persistent ``Context`` per node), and measures the server's test accuracy
each round.
"""

from pollen.testing.foreign.project import Project

__all__ = ["Project"]
