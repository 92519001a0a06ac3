"""Check a ``--run-config`` before ``flwr run``: each mistake named by its key, as pollen would say it.

    python -m pollen.app.check --run-config "strategy='fedcams' compresor='topk' num-server-rounds=30"
    python -m pollen.app.check path/to/app --run-config my-config.toml

Flower 1.39 refuses two mistakes before pollen's code runs, without naming the key:

- a value that is not TOML (``compressor=topk``: a string without quotes) stops ``flwr run`` itself with
  "The provided configuration string is in an invalid format";
- a key that is not in the app's ``[tool.flwr.app.config]`` (``compresor``) is refused by the SuperLink
  with "[code: 15] Invalid run configuration." (the key is named only in the SuperLink's own log).

This command parses the overrides with Flower's own parser, then names the first token Flower cannot read
or the first unknown key with the nearest allowed one, then validates the whole config as the ServerApp
does before round 1 (every value, the method's own checks). It prints one line and exits 0 when the config
is valid, 1 when not. It does not check what only a running federation knows (connected nodes, the data).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tomllib

from pollen.app.config import AppConfig, ConfigError, schema_defaults
from pollen.app.spec import unknown_name

#: ``flwr run``'s own pattern for one ``key=value`` of ``--run-config`` (flwr.common.config.parse_config_args).
_PAIR = re.compile(r"(\S+?)=(\'[^\']*\'|\"[^\"]*\"|\S+)")


def app_defaults(app_dir: Path) -> dict[str, Any]:
    """The run-config an app declares (its ``pyproject.toml``'s ``[tool.flwr.app.config]``), or the schema's."""
    path = Path(app_dir) / "pyproject.toml"
    if not path.is_file():
        return schema_defaults()
    with path.open("rb") as handle:
        table = tomllib.load(handle).get("tool", {}).get("flwr", {}).get("app", {}).get("config")
    return dict(table) if table else schema_defaults()


def token_problem(text: str) -> str | None:
    """What Flower's parser cannot read in one ``--run-config`` string, or None.

    A value that is not TOML (a string without quotes), or text that is not ``key=value`` at all (Flower
    would drop it without a word: ``strategy = 'x'`` with spaces).
    """
    leftover = _PAIR.sub(" ", text).strip()
    if leftover:
        return f"--run-config text {leftover.split()[0]!r} is not key=value; allowed: key=value pairs without spaces"
    for key, raw in _PAIR.findall(text):
        try:
            tomllib.loads(f"{key} = {raw}")
        except tomllib.TOMLDecodeError:
            return (
                f"run-config '{key}' = {raw} is not a TOML value; allowed: a string in quotes ({key}='{raw}'), "
                "a number or true/false without quotes"
            )
    return None


def check(overrides: Sequence[str], app_dir: Path = Path(".")) -> str:
    """The one-line verdict on ``overrides`` (``--run-config`` strings); ``ConfigError`` for the first mistake."""
    from flwr.common.config import parse_config_args

    texts = [text for text in overrides if text]
    if not (len(texts) == 1 and texts[0].endswith(".toml")):
        for text in texts:
            problem = token_problem(text)
            if problem:
                raise ConfigError(problem)
    given = parse_config_args(texts or None)
    defaults = app_defaults(app_dir)
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        note = " to this app (Flower's SuperLink refuses it: '[code: 15] Invalid run configuration.')"
        raise ConfigError(unknown_name("run-config key", unknown[0], defaults, note))
    cfg = AppConfig.from_run_config({**defaults, **given}, given=set(given))
    from pollen.app.experiment import build_strategy

    build_strategy(cfg)  # a method's own refusals of its settings
    return f"ok: {cfg['strategy']} on {cfg['dataset']}, {len(given)} keys given; pollen accepts this run-config"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("app", nargs="?", type=Path, default=Path("."), help="the app folder (its pyproject.toml)")
    parser.add_argument("--run-config", "-c", action="append", default=[], help="as for flwr run (repeatable)")
    args = parser.parse_args(argv)
    try:
        print(check(args.run_config, args.app))
    except ValueError as err:  # ConfigError, and a method's refusals
        print(f"pollen: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
