"""Tests of the app layer: run-config, presets, sweeps, results, the reporter and the apps' error paths."""
