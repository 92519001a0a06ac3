"""pollen's ServerApp and ClientApp as the test harness runs them: with fault injection and the relay demo.

The product's apps (``pollen.server_app:app``, ``pollen.client_app:app``) have neither. These reuse
their handlers and add

- :func:`pollen.testing.faults.fault_mod` in front of every train message, set by node-config
  ``fault-fraction`` / ``fault-kind`` / ``fault-delay`` or, in a simulation, by the run-config keys of
  the same names, which only this app's config accepts (:data:`TESTING_KEYS`; the product's run-config
  refuses them as unknown);
- :func:`pollen.testing.placement.placement_mod`, which notes where each train message ran when
  run-config ``trace-dir`` is set (multi-node Ray tests);
- the round-protocol example ``relay-demo`` (:mod:`pollen.testing.relay_demo`): a method in the
  ServerApp's table, its client steps in the ClientApp's.

Before pollen's handlers see a ``Context``, the testing keys are taken out of its run-config, so the
product's validation runs unchanged. A Flower app directory runs them when its ``pyproject.toml``
names ``pollen.testing.apps:serverapp`` and ``pollen.testing.apps:clientapp`` and its config table
holds the testing keys: :func:`testing_pyproject` writes that from the product's file, and
:meth:`pollen.testing.flwr_cli.LocalFlower.app` snapshots such an app for ``flwr run``.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections import ChainMap
from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable
from flwr.serverapp import Grid, ServerApp

from pollen import client_app, server_app
from pollen.app.methods import METHODS as PRODUCT_METHODS
from pollen.app.spec import ConfigError
from pollen.testing import relay_demo
from pollen.testing.faults import KEYS as FAULT_KEYS
from pollen.testing.faults import fault_mod, fault_settings
from pollen.testing.placement import KEYS as PLACEMENT_KEYS
from pollen.testing.placement import placement_mod

#: Run-config keys only the testing app accepts (with their defaults and checks).
TESTING_KEYS = {**FAULT_KEYS, **PLACEMENT_KEYS}

#: The product's methods plus the harness's demo.
METHODS = {**PRODUCT_METHODS, **relay_demo.METHODS}

#: The product's client steps and phases, then the demo's (looked up live, so a step pollen adds later is seen).
STEPS = ChainMap(relay_demo.CLIENT_STEPS, client_app.LOCAL_STEPS)
PHASES = ChainMap(relay_demo.CLIENT_PHASES, client_app.PHASES)


def product_context(context: Context) -> Context:
    """``context`` without the testing keys in its run-config; the same state object (what handlers write stays)."""
    run_config = {key: value for key, value in context.run_config.items() if key not in TESTING_KEYS}
    return dataclasses.replace(context, run_config=run_config)


def product_config_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    """Flower mod: hand the rest of the chain the context pollen's ClientApp expects (no testing keys)."""
    return call_next(msg, product_context(context))


# ----------------------------------------------------------------------------------------- ClientApp
clientapp = ClientApp()


@clientapp.train(mods=[placement_mod, fault_mod, product_config_mod, *client_app.TRAIN_MODS])
def train(msg: Message, context: Context) -> Message:
    """pollen's train handler with the demo's local steps too."""
    return client_app.run_train(msg, context, STEPS)


@clientapp.train("pollen_phase", mods=[fault_mod, product_config_mod, *client_app.PHASE_MODS])
def train_phase(msg: Message, context: Context) -> Message:
    """pollen's mid-round handler with the demo's phases too."""
    return client_app.run_phase(msg, context, PHASES)


clientapp.evaluate(mods=[product_config_mod])(client_app.evaluate)
clientapp.query("pollen_identify", mods=[product_config_mod])(client_app.identify)


# ----------------------------------------------------------------------------------------- ServerApp
serverapp = ServerApp()


def main(grid: Grid, context: Context) -> None:
    """pollen's ServerApp with the harness's method table; a bad testing key stops the run before round 1."""
    try:
        fault_settings(dataclasses.replace(context, node_config={}))
    except ConfigError as err:
        server_app.refuse(err, context.run_config, context.run_id)
    server_app.serve(grid, product_context(context), methods=METHODS)


serverapp.main()(server_app.quiet_refusals(main))


# ----------------------------------------------------------------------------------------- app directory
def testing_pyproject(text: str) -> str:
    """The product's ``pyproject.toml`` with its components pointing here and the testing keys in its config.

    Refuses (``ValueError``) a file whose components or config table it cannot find, rather than write
    an app that would quietly run the product's apps.
    """
    components = {"serverapp": "pollen.testing.apps:serverapp", "clientapp": "pollen.testing.apps:clientapp"}
    for name, target in components.items():
        text, count = re.subn(rf'(?m)^{name}\s*=\s*"[^"]*"', f'{name} = "{target}"', text)
        if count != 1:
            raise ValueError(f"pyproject.toml: no single '{name} = ...' line under [tool.flwr.app.components]")
    header = "[tool.flwr.app.config]\n"
    if text.count(header) != 1:
        raise ValueError("pyproject.toml: no single [tool.flwr.app.config] table")
    lines = "".join(f"{key} = {_toml(spec.default)}\n" for key, spec in TESTING_KEYS.items())
    return text.replace(header, header + "# the test harness's keys (pollen.testing.apps)\n" + lines)


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, str) else repr(value)


__all__ = [
    "METHODS",
    "PHASES",
    "STEPS",
    "TESTING_KEYS",
    "clientapp",
    "product_context",
    "serverapp",
    "testing_pyproject",
]
