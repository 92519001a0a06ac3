"""The app's run-config: every key, its type, its default and its allowed values, checked before round 1.

``AppConfig.from_run_config(context.run_config)`` returns a typed, validated config or raises
``ConfigError`` with one line naming the key, the bad value and what is allowed.

The schema is assembled from fragments (:mod:`pollen.app.spec`): the keys every run has are below
(experiment, sampling, the server optimiser's common settings, data, model, local training, resume,
bad clients); each method family declares its own next to its builders (:mod:`pollen.app.methods`).
Allowed names are imported from the modules that own them (the task catalog, the codecs, the
quantiser, the gossip topologies, the strategies' screen), not copied.

Where a value comes from, highest first:

1. a key the user gave (``flwr run . --run-config "k=v"``; a value that differs from its pyproject
   default counts as given too);
2. the ``preset`` (:mod:`pollen.app.preset`), for the keys its ``[config]`` sets;
3. the chosen method's recommended values (its paper's: ``DEFAULTS`` in its family's module), so that
   ``strategy=hafed`` alone runs with HA-Fed's server lr, eps and batch size, not FedAMS's;
4. the defaults in ``pyproject.toml`` (``[tool.flwr.app.config]``; they equal the schema's, and are
   the recommended values of FedAMS, the default method).

:func:`effective_run_config` applies 2 and 3. A ClientApp resolves its run-config the same way; where
it cannot tell a given key from a default (the user gave a key its default value), the ServerApp sends
it the given keys (:func:`clients_need_given_keys`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from pollen.aggregate import AGGREGATORS, DEFAULT_TRIM_FRACTION
from pollen.app import registry
from pollen.app.methods import FAMILIES, METHODS
from pollen.app.spec import (
    ConfigError,
    Key,
    assemble,
    beta,
    choice,
    defaults_of,
    flag,
    node_path,
    non_neg_int,
    non_negative,
    pos_int,
    positive,
    text,
    unit_closed,
    unit_open,
    unknown_name,
)
from pollen.app.trackers.base import TRACKERS, is_tracker_list
from pollen.app.trackers.mlflow import URI_WORDS, is_tracking_uri
from pollen.optim.schedule import SCHEDULES, parse_decay_rounds
from pollen.task.catalog import DATASETS, DEVICES, MODELS, NORMS, PARTITIONERS, is_device

__all__ = [
    "DATASETS",
    "MODELS",
    "PARTITIONERS",
    "RESUME_MAY_DIFFER",
    "SCHEMA",
    "AppConfig",
    "ConfigError",
    "Key",
    "defaults_from_pyproject",
    "effective_run_config",
    "schema_defaults",
    "strategy_names",
]


def strategy_names(methods: registry.Table | None = None) -> tuple[str, ...]:
    """The names of the method table (:data:`pollen.app.methods.METHODS` unless another is given), in its order."""
    return registry.strategy_names(methods)


def _aggregations() -> tuple[str, ...]:
    """How a pollen strategy averages updates (owned by the strategies; read on the server only)."""
    from pollen.strategies.engine.strategy import AGGREGATIONS

    return AGGREGATIONS


def _outlier_rules() -> tuple[str, ...]:
    """What the outlier screen does with an outlier (owned by the strategies; read on the server only)."""
    from pollen.strategies.engine.screening import RULES

    return RULES


def _decay_rounds_ok(value: str) -> bool:
    try:
        parse_decay_rounds(value)
    except ValueError:
        return False
    return True


EXPERIMENT = {
    "run-name": text(""),
    "preset": text(""),
    "results-dir": Key(str, "results", lambda v: bool(v), "a non-empty path"),
    "plots": Key(bool, True, allowed="true or false"),
    "seed": non_neg_int(42),
    "num-server-rounds": pos_int(10),
}
SAMPLING = {
    "strategy": Key(str, "fedams", lambda v: v in METHODS, lambda: "one of " + ", ".join(METHODS)),
    "fraction-train": unit_open(0.5),
    "fraction-evaluate": unit_closed(0.3),
    "min-train-nodes": pos_int(2),
    "min-evaluate-nodes": non_neg_int(2),
    "node-wait-seconds": non_negative(30.0),
    # N > 0: N logical clients (partitions 0..N-1) played by the connected nodes, bound anew each round (a
    # simulation of many clients on a few simulated SuperNodes); the fractions are of N. 0: one client per node.
    "population": non_neg_int(0),
    "aggregation": choice(_aggregations, "mean", server_side=True),
    "aggregator": choice(AGGREGATORS, "mean"),
    "trim-fraction": Key(float, DEFAULT_TRIM_FRACTION, lambda v: 0 <= v < 0.5, "a number in [0, 0.5)"),
}
#: The server optimiser's settings every adaptive method shares (each family's defaults say its own).
SERVER_OPTIMIZER = {
    "server-lr": positive(0.1),
    "beta-1": beta(0.9),
    "beta-2": beta(0.99),
    "eps": non_negative(0.001),
}
DATA = {
    "dataset": choice(DATASETS, "fashion-mnist"),
    "partitioner": choice(PARTITIONERS, "dirichlet"),
    "dirichlet-alpha": positive(0.5),
    "classes-per-partition": pos_int(2),
    "shards-per-partition": pos_int(2),
    "val-fraction": Key(float, 0.1, lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "data-dir": node_path(""),
}
LOCAL_TRAINING = {
    "model": choice(MODELS, "cnn"),
    "norm": choice(NORMS, "bn"),
    "local-lr": positive(0.01),
    "lr-schedule": choice(SCHEDULES, "constant"),
    "lr-decay-rounds": Key(
        str, "", _decay_rounds_ok, 'strictly increasing comma-separated rounds >= 2, e.g. "30,70" (or empty)'
    ),
    "lr-decay-factor": unit_open(0.1),
    "local-epochs": pos_int(1),
    "local-steps": non_neg_int(0),
    "batch-size": pos_int(32),
    "momentum": beta(0.0),
    "weight-decay": non_negative(0.0),
    "device": Key(str, "auto", is_device, ", ".join(DEVICES)),
    "eval-batch-size": pos_int(512),
    "eval-every": pos_int(1),
    "test-examples": non_neg_int(0),
}
RESUME = {
    "resume": text(""),
    "stop-after-round": non_neg_int(0),
    "state-dir": node_path(""),
    # false (with a state-dir): client state only in its state-dir file, none in Flower's context.state, so a
    # simulation of many stateful clients keeps flat memory (each message reads and writes its file).
    "client-state-in-memory": Key(bool, True, allowed="true or false"),
    # Resume from a checkpoint whose sha256 is not the one the run directory recorded when it was written
    # (checkpoint.npz.sha256): a file you edited or copied in on purpose. Every field is still checked.
    "resume-trust-file": Key(bool, False, allowed="true or false"),
}
BAD_CLIENTS = {
    "round-timeout": positive(3600.0),
    "min-replies": pos_int(1),
    "outlier-rule": choice(_outlier_rules, "reject", server_side=True),
    "outlier-factor": Key(float, 10.0, lambda v: v > 1, "a number > 1"),
}


def _speed_ok(value: str) -> bool:
    from pollen.asynchrony import parse_speed

    if not value:
        return True
    try:
        parse_speed(value)
    except ValueError:
        return False
    return True


#: The round driver (:mod:`pollen.strategies.engine.buffered`): lock-step rounds, or buffered asynchronous steps.
DRIVER = {
    "driver": choice(("sync", "async"), "sync"),
    "async-rule": choice(("fadas", "fedbuff", "fedasync"), "fadas"),
    "concurrency": non_neg_int(0),
    "buffer-size": non_neg_int(0),
    "max-staleness": Key(int, -1, lambda v: v >= -1, "an integer >= 0, or -1 for no limit"),
    "refill": choice(("reply", "flush"), "reply"),
    "async-clock": choice(("virtual", "real"), "virtual"),
    "client-speed": Key(
        str,
        "",
        _speed_ok,
        "empty, constant[:d], uniform:lo:hi, exponential:mean, lognormal:sigma[:jitter], "
        "stragglers:fraction:k_lo:k_hi, fadas-mild or fadas-large",
    ),
    "staleness-exponent": non_negative(0.5),
    "fedasync-alpha": unit_open(0.9),
    "delay-adaptive": Key(bool, True, allowed="true or false"),
    "tau-c": non_negative(1.0),
    "da-form": choice(("code", "paper"), "code"),
}
#: Differential privacy (:mod:`pollen.strategies.engine.private`, :mod:`pollen.strategies.engine.local_privacy`).
PRIVACY = {
    "dp": choice(("none", "central", "local"), "none"),
    "dp-clip": positive(1.0),
    "dp-noise-multiplier": positive(1.0),
    "dp-delta": Key(float, 1e-5, lambda v: 0 < v < 1, "a number in (0, 1)"),
    "dp-target-epsilon": non_negative(0.0),
    "dp-sampling": choice(("auto", "without-replacement", "none"), "auto"),
    "dp-adaptive-clip": flag(False),
    "dp-target-quantile": Key(float, 0.5, lambda v: 0 < v < 1, "a number in (0, 1)"),
    "dp-clip-lr": positive(0.2),
    "dp-count-noise": non_negative(0.0),
    "dp-noise-seed": Key(int, -1, lambda v: v >= -1, "an integer >= 0 (simulation only), or -1 (the OS's randomness)"),
    "secagg": flag(False),
    "secagg-bits": Key(int, 16, lambda v: 2 <= v <= 24, "an integer from 2 to 24"),
    "secagg-clip": positive(0.05),
    "secagg-degree": Key(int, 0, lambda v: v >= 0, "an integer >= 1, or 0 (2 ceil(log2 n))"),
    "secagg-threshold": Key(int, 0, lambda v: v == 0 or v >= 2, "an integer >= 2, or 0 (two thirds of the holders)"),
}
#: Experiment trackers (:mod:`pollen.app.trackers`); they change what is tracked, never the run's numbers.
TRACKING = {
    "tracker": Key(
        str, "", is_tracker_list, "empty (none) or a comma-separated list of " + ", ".join(TRACKERS) + ", each once"
    ),
    "tracker-dir": text(""),
    "mlflow-tracking-uri": Key(str, "", is_tracking_uri, URI_WORDS),
    "mlflow-experiment": Key(str, "pollen", lambda v: bool(v.strip()), "a non-empty MLflow experiment name"),
}

#: Every key the app's run-config holds: the common keys, then each family's.
SCHEMA: dict[str, Key] = assemble(
    EXPERIMENT,
    SAMPLING,
    SERVER_OPTIMIZER,
    DATA,
    LOCAL_TRAINING,
    RESUME,
    BAD_CLIENTS,
    DRIVER,
    PRIVACY,
    TRACKING,
    *(family.KEYS for family in FAMILIES),
)


def schema_defaults() -> dict[str, Any]:
    """Key -> default of :data:`SCHEMA` (what ``pyproject.toml``'s config table holds)."""
    return defaults_of(SCHEMA)


#: Keys that may differ between a checkpoint and the run that resumes it (the rest must be equal).
RESUME_MAY_DIFFER = (
    "resume",
    "stop-after-round",
    "num-server-rounds",
    "node-wait-seconds",
    "round-timeout",
    "device",
    "eval-batch-size",
    "results-dir",
    "plots",
    "data-dir",
    "state-dir",
    "client-state-in-memory",
    "resume-trust-file",
    *TRACKING,
)


def _coerce(key: str, value: Any, spec: Key) -> Any:
    if spec.type is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"run-config '{key}' = {value!r} is not a boolean; allowed: {spec.words}")
    if spec.type in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"run-config '{key}' = {value!r} is not a number; allowed: {spec.words}")
        if spec.type is int and float(value) != int(value):
            raise ConfigError(f"run-config '{key}' = {value!r} is not an integer; allowed: {spec.words}")
        return spec.type(value)
    if not isinstance(value, str):
        raise ConfigError(f"run-config '{key}' = {value!r} is not a string; allowed: {spec.words or 'text'}")
    return value


def _strategy_key(methods: registry.Table | None) -> Key:
    """The ``strategy`` key of a method table other than the product's (the test harness adds its demos)."""
    if methods is None:
        return SCHEMA["strategy"]
    return Key(str, "fedams", lambda v: v in methods, lambda: "one of " + ", ".join(methods))


@dataclass(frozen=True)
class AppConfig:
    """The validated run-config (kebab-case keys become snake_case attributes)."""

    values: Mapping[str, Any] = field(default_factory=dict)
    methods: registry.Table | None = field(default=None, compare=False, repr=False)

    @classmethod
    def from_run_config(
        cls,
        run_config: Mapping[str, Any],
        *,
        check_strategy: bool = True,
        given: Collection[str] = (),
        methods: registry.Table | None = None,
    ) -> AppConfig:
        """Check every key; unknown keys and bad values raise ``ConfigError``.

        ``check_strategy=False`` (a ClientApp) skips what only the ServerApp can check: the strategy
        name (the server may serve another method table, as the test harness does) and the keys whose
        allowed values the server-side strategy modules own (``Key.server_side``; their types are still
        checked), so a ClientApp never imports the strategies. The ServerApp checks all of them before
        round 1. ``given``: the keys the user set; values come from the user, the preset, the method's
        recommended values and the pyproject defaults, in that order (module docstring). ``methods``:
        the method table (default: the product's, :data:`pollen.app.methods.METHODS`).
        """
        run_config = effective_run_config(run_config, given, methods)
        unknown = sorted(set(run_config) - set(SCHEMA))
        if unknown:
            raise ConfigError(unknown_name("run-config key", unknown[0], SCHEMA))
        missing = sorted(set(SCHEMA) - set(run_config))
        if missing:
            raise ConfigError(f"run-config key '{missing[0]}' is missing (it has a default in pyproject.toml)")
        values = {}
        for key, spec in SCHEMA.items():
            if key == "strategy":
                spec = _strategy_key(methods)
            value = _coerce(key, run_config[key], spec)
            server_only = key == "strategy" or spec.server_side
            if (check_strategy or not server_only) and not spec.check(value):
                raise ConfigError(f"run-config '{key}' = {value!r} is out of range; allowed: {spec.words}")
            values[key] = value
        if values["lr-schedule"] == "step" and not values["lr-decay-rounds"].strip():
            raise ConfigError("run-config 'lr-schedule' = 'step' needs 'lr-decay-rounds', e.g. \"30,70\"; it is empty")
        if values["min-evaluate-nodes"] == 0 and values["fraction-evaluate"] > 0:
            raise ConfigError("run-config 'min-evaluate-nodes' = 0 with 'fraction-evaluate' > 0; allowed: >= 1")
        if values["driver"] == "async" and 0 < values["concurrency"] < values["buffer-size"]:
            raise ConfigError(
                f"run-config 'buffer-size' = {values['buffer-size']} > 'concurrency' = {values['concurrency']}: a "
                "server step could never fill; allowed: buffer-size <= concurrency (0: a fifth of it, at least 1)"
            )
        if values["population"] > 0 and not values["state-dir"]:
            raise ConfigError(
                f"run-config 'population' = {values['population']} needs 'state-dir': each node plays many clients, "
                "so a client's state (error-feedback residuals, moments, lazy references) lives in a file there and "
                "follows the client to whichever node plays it next; set state-dir (a directory every node reaches)"
            )
        if run_config["client-state-in-memory"] is False and not run_config["state-dir"]:
            raise ConfigError(
                "run-config 'client-state-in-memory' = false needs 'state-dir' (where the state then lives; a "
                "SuperNode's node-config state-dir, where set, wins); set state-dir, or keep it true"
            )
        return cls(values, methods)

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def as_dict(self) -> dict[str, Any]:
        return dict(self.values)

    def replace(self, **changes: Any) -> AppConfig:
        """A copy with some keys changed (kebab-case names via ``**{"key": v}``), re-validated.

        The values are already resolved, so every key counts as given: the changes, and only they, change.
        """
        return AppConfig.from_run_config(
            {**self.values, **changes}, given=set(self.values) | set(changes), methods=self.methods
        )


def effective_run_config(
    run_config: Mapping[str, Any], given: Collection[str] = (), methods: registry.Table | None = None
) -> dict[str, Any]:
    """``run_config`` with its ``preset`` and then its method's recommended values applied.

    ``given``: the keys the user set on the command line (they win even where they equal a default).
    A key the preset sets wins over the method's values; a key nobody set takes the method's value,
    else keeps its pyproject default (module docstring). ``methods``: the method table (default: the
    product's). ``ConfigError`` for a bad preset.
    """
    from pollen.app.preset import PresetError, apply_preset, fill_unset, load_preset, pyproject_defaults

    defaults = pyproject_defaults() or schema_defaults()
    resolved, preset_keys = dict(run_config), set()
    if run_config.get("preset"):
        try:
            resolved = apply_preset(run_config, defaults, given)
            preset_keys = set(load_preset(str(run_config["preset"])).config)
        except PresetError as err:
            raise ConfigError(f"run-config 'preset': {err}") from None
    recommended = registry.method_defaults(resolved.get("strategy"), methods)
    return fill_unset(resolved, recommended, defaults, set(given) | preset_keys)


def clients_need_given_keys(
    run_config: Mapping[str, Any], given: Collection[str], methods: registry.Table | None = None
) -> bool:
    """Whether a ClientApp that does not know ``given`` would resolve ``run_config`` differently.

    It would where the user gave a key the value of its pyproject default and the preset or the
    method recommends another: without the given keys the client would take that other value.
    """
    return bool(given) and effective_run_config(run_config, given, methods) != effective_run_config(
        run_config, (), methods
    )


def defaults_from_pyproject(path: str) -> dict[str, Any]:
    """The ``[tool.flwr.app.config]`` table of a pyproject file (used by tests and benchmarks)."""
    import tomllib

    with open(path, "rb") as handle:
        return dict(tomllib.load(handle)["tool"]["flwr"]["app"]["config"])
