"""The test and benchmark harness; nothing in the product imports it.

- :mod:`pollen.testing.fakes`: an in-process ``Grid`` and message builders for strategy tests;
- :mod:`pollen.testing.inprocess`: pollen's real ServerApp and ClientApp in one process (no Ray, no SuperLink);
- :mod:`pollen.testing.flwr_cli`: ``flwr run`` against a private local SuperLink, stopped by process id;
- :mod:`pollen.testing.local_federation`: SuperLink + SuperNodes on loopback (TLS, node authentication);
- :mod:`pollen.testing.faults`: a Flower mod that makes seeded clients fail, stall or send garbage;
- :mod:`pollen.testing.relay_demo`: the round-protocol example (``relay-demo``), server and client side;
- :mod:`pollen.testing.apps`: pollen's ServerApp and ClientApp with the two above (strategy ``relay-demo``,
  ``fault-*`` keys), and the ``pyproject.toml`` of an app directory that runs them.

The modules that start Flower processes or read ``pyproject.toml`` run from a checkout of the repository.
"""
