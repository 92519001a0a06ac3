"""A client's error reply, read: the real exception first, and a ClientApp that can never answer stopped at once.

Flower answers a message whose ClientApp raised with an error reply whose reason is the exception as text:
``<class 'KeyError'>:<''secaggplus_configs''>`` from a SuperNode, and in a Ray simulation the whole remote
traceback (ANSI colours, ``ray::ClientAppActor.run()`` headers, file lines, the exception the ClientApp raised,
then Flower's ``ClientAppException`` around it). :func:`client_error_text` turns either into one line that starts
with the exception the ClientApp raised (``KeyError: 'secaggplus_configs'``), so a reason kept to a few hundred
characters still shows it.

Some client errors say the ClientApp is set up so that it can never answer a pollen strategy; a round that
waited for them would be the first of many empty ones. :func:`incompatibility` knows them, and the collector
stops the run when every reply of a phase is one (:class:`ClientAppIncompatible`, raised out of ``start``) with
the reason and what to change; one among usable replies is rejected like any other error (a reason is the
client's to write, and one client must not stop everybody's run):

- Flower's ``secaggplus_mod`` / ``secagg_mod`` read the SecAgg+ stage record (``secaggplus_configs``) that only
  Flower's ``SecAggPlusWorkflow`` (legacy ServerApp API) sends;
- mods and clients of Flower's legacy API (``flwr.client.mod.LocalDpMod``, ``fixedclipping_mod``,
  ``adaptiveclipping_mod``, a ``NumPyClient``) read ``fitins.parameters``, which no Message API strategy sends;
- a pollen client piece that found a mod order that cannot work says so itself
  (:data:`pollen.wire.protocol.SETUP_ERROR_PREFIX`, e.g. ``compression_mod`` inside Flower's ``LocalDpMod``).
"""

from __future__ import annotations

import re

from pollen.wire import protocol

#: The longest client error reason logged and kept with a rejection (the exception first, then what follows).
MAX_CLIENT_ERROR_LENGTH = 1000

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_FLOWER_FORM = re.compile(r"^<class '(?P<name>[^']+)'>:<'(?P<body>.*)'>$", re.DOTALL)
# A traceback's exception line: ``KeyError: 'x'``, ``pkg.mod.SomeError: text`` at the start of a line.
_EXCEPTION_LINE = re.compile(r"^(?P<name>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt))(?:: (?P<text>.*))?$")

_SECAGG = (
    "'secaggplus_configs'",
    "the ClientApp runs Flower's secaggplus_mod (or secagg_mod), which answers only the SecAgg+ stages that "
    "Flower's SecAggPlusWorkflow sends through the legacy ServerApp API; pollen's strategies send plain train "
    "messages and cannot drive it; allowed: a ClientApp without secaggplus_mod/secagg_mod",
)
_LEGACY = (
    "'fitins.parameters'",
    "the ClientApp runs a mod or client of Flower's legacy API (flwr.client.mod's LocalDpMod, fixedclipping_mod "
    "or adaptiveclipping_mod, or a NumPyClient) that reads the record 'fitins.parameters', which Message API "
    "strategies (pollen's, flwr.serverapp.strategy's) never send; allowed: the Message API mods of "
    "flwr.clientapp.mod, or @app.train functions",
)


class ClientAppIncompatible(RuntimeError):
    """A client's error reply says its ClientApp can never answer this server; the run stops at once."""


def client_error_text(reason: str) -> str:
    """One line for a Flower error reply's ``reason``: the exception the ClientApp raised first, at most
    :data:`MAX_CLIENT_ERROR_LENGTH` characters."""
    text = _ANSI.sub("", str(reason)).strip()
    body = text
    if (form := _FLOWER_FORM.match(text)) is not None:
        name, body = form.group("name").rsplit(".", 1)[-1], form.group("body")
        text = f"{name}: {body}" if "\n" not in body else body
    if "\n" in body:  # a traceback: its exception lines, the first raised first
        raised = [m for line in body.splitlines() if (m := _EXCEPTION_LINE.match(line.rstrip()))]
        raised = [m for m in raised if (m.group("text") or "").strip()]
        if raised:
            first = raised[0].group("name").rsplit(".", 1)[-1] + ": " + raised[0].group("text").strip()
            last = raised[-1].group("name").rsplit(".", 1)[-1]
            text = first if len(raised) == 1 else f"{first} (raised in the ClientApp, reported as {last})"
        else:
            text = " ".join(line.strip() for line in body.splitlines() if line.strip())
    text = " ".join(text.split())
    if len(text) > MAX_CLIENT_ERROR_LENGTH:
        text = text[: MAX_CLIENT_ERROR_LENGTH - 3] + "..."
    return text


def incompatibility(reason: str) -> str | None:
    """Why a client error with this ``reason`` means its ClientApp can never answer (``None``: it might next time)."""
    text = _ANSI.sub("", str(reason))
    if protocol.SETUP_ERROR_PREFIX in text:  # the line a pollen client piece raised, as it wrote it
        return text.split(protocol.SETUP_ERROR_PREFIX, 1)[1].splitlines()[0].strip().rstrip("'>")
    for key, why in (_SECAGG, _LEGACY):
        if f"KeyError: {key}" in text or f"KeyError'>:<'{key}" in text or f"Message: {key}" in text:
            return why
    return None
