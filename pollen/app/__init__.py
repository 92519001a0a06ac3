"""The app: run-config schema and validation, experiment building, presets, sweeps, results, compare.

The ServerApp and ClientApp entry points stay at the package top (``pollen.server_app``,
``pollen.client_app``), where Flower's templates and ``pyproject.toml`` put them; they read the config
through this package, build and run.
"""
