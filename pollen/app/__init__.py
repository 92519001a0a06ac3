"""The app: run-config schema and validation, the methods, experiment building, presets, sweeps, results, compare.

- :mod:`pollen.app.spec`: what a run-config key is (type, default, allowed values);
- :mod:`pollen.app.methods`: one module per method family (its keys, its papers' values, its builders)
  and the table of every method; :mod:`pollen.app.registry`: looking methods up in such a table;
- :mod:`pollen.app.config`: the schema assembled from the common keys and the families', the precedence
  of user, preset, method and pyproject values, and the validated ``AppConfig``.

The ServerApp and ClientApp entry points stay at the package top (``pollen.server_app``,
``pollen.client_app``), where Flower's templates and ``pyproject.toml`` put them; they read the config
through this package, build and run.
"""
