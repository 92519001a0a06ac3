"""The app's run-config: every key, its type, its allowed values, checked before round 1.

``AppConfig.from_run_config(context.run_config)`` returns a typed, validated config or
raises ``ConfigError`` with one line naming the key, the bad value and what is allowed.
Defaults live in ``pyproject.toml`` (``[tool.flwr.app.config]``); the table below is
the single place that says what each key may hold.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from pollen.gossip import TOPOLOGIES
from pollen.lazy.rules import DOWNLINK_MODES, EF_MODES, REF_MODES
from pollen.optim.schedule import SCHEDULES, parse_decay_rounds


def strategy_names() -> tuple[str, ...]:
    """The names the strategy modules register (``pollen.strategies.registry``), in registration order.

    Read from the registry, not copied here, and only when a run-config is checked on the server:
    a ClientApp (a fresh ``flwr-clientapp`` process per message in deployment) validates its
    run-config without the strategy check, so it never imports the server-side strategies.
    """
    from pollen.strategies import strategy_names as registered

    return registered()


SERVER_OPTIMIZERS = ("adagrad", "adam", "adabelief", "yogi", "lamb", "sgd")
TABLE_PRECISIONS = ("fp32", "fp16", "int8", "int4")
VR_WEIGHTINGS = ("sampled-normalised", "horvitz-thompson", "literal")
DATASETS = ("fashion-mnist", "mnist", "cifar10", "cifar100")
PARTITIONERS = ("iid", "dirichlet", "pathological", "shards")
MODELS = ("mlp", "cnn", "lenet5", "resnet18", "convmixer")
NORMS = ("bn", "gn")
COMPRESSORS = ("sign", "topk", "fp16", "none")
GRANULARITIES = ("model", "tensor")
AGGREGATIONS = ("mean", "weighted")
EPS_MODES = ("paper", "max", "add", "inside")  # paper: each method's own placement


def _decay_rounds_ok(text: str) -> bool:
    try:
        parse_decay_rounds(text)
    except ValueError:
        return False
    return True


class ConfigError(ValueError):
    """A run-config value that cannot be used; the message is one line for the user."""


@dataclass(frozen=True)
class Key:
    """One run-config key: its Python type, a check and the words that say what is allowed."""

    type: type
    check: Callable[[Any], bool] = lambda value: True
    allowed: str | Callable[[], str] = ""

    @property
    def words(self) -> str:
        """What is allowed, in words (computed on demand where it names registered things)."""
        return self.allowed() if callable(self.allowed) else self.allowed


def _choice(options: tuple[str, ...]) -> Key:
    return Key(str, lambda v: v in options, "one of " + ", ".join(options))


_POSITIVE = Key(float, lambda v: v > 0, "a number > 0")
_NON_NEGATIVE = Key(float, lambda v: v >= 0, "a number >= 0")
_BETA = Key(float, lambda v: 0 <= v < 1, "a number in [0, 1)")
_POS_INT = Key(int, lambda v: v >= 1, "an integer >= 1")
_NON_NEG_INT = Key(int, lambda v: v >= 0, "an integer >= 0")
_ANY_STR = Key(str)

SCHEMA: dict[str, Key] = {
    "run-name": _ANY_STR,
    "preset": _ANY_STR,
    "results-dir": Key(str, lambda v: bool(v), "a non-empty path"),
    "seed": _NON_NEG_INT,
    "num-server-rounds": _POS_INT,
    "strategy": Key(str, lambda v: v in strategy_names(), lambda: "one of " + ", ".join(strategy_names())),
    "fraction-train": Key(float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "fraction-evaluate": Key(float, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "min-train-nodes": _POS_INT,
    "min-evaluate-nodes": _NON_NEG_INT,
    "node-wait-seconds": _NON_NEGATIVE,
    "aggregation": _choice(AGGREGATIONS),
    "server-lr": _POSITIVE,
    "beta1": _BETA,
    "beta2": _BETA,
    "eps": _NON_NEGATIVE,
    "eps-mode": _choice(EPS_MODES),
    "bias-correction": Key(bool, allowed="true or false"),
    "compressor": _choice(COMPRESSORS),
    "topk-ratio": Key(float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "error-feedback": Key(bool, allowed="true or false"),
    "compression-granularity": _choice(GRANULARITIES),
    "server-optimizer": _choice(SERVER_OPTIMIZERS),
    "table-precision": _choice(TABLE_PRECISIONS),
    "table-path": _ANY_STR,
    "vr-weighting": _choice(VR_WEIGHTINGS),
    "num-clients": _NON_NEG_INT,
    "dataset": _choice(DATASETS),
    "partitioner": _choice(PARTITIONERS),
    "dirichlet-alpha": _POSITIVE,
    "classes-per-partition": _POS_INT,
    "shards-per-partition": _POS_INT,
    "val-fraction": Key(float, lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "data-dir": _ANY_STR,
    "model": _choice(MODELS),
    "norm": _choice(NORMS),
    "local-lr": _POSITIVE,
    "lr-schedule": _choice(SCHEDULES),
    "lr-decay-rounds": Key(str, _decay_rounds_ok, "strictly increasing comma-separated rounds >= 2, e.g. \"30,70\" (or empty)"),
    "lr-decay-factor": Key(float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "local-epochs": _POS_INT,
    "local-steps": _NON_NEG_INT,
    "batch-size": _POS_INT,
    "momentum": Key(float, lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "weight-decay": _NON_NEGATIVE,
    "device": Key(str, lambda v: v in ("auto", "cpu", "cuda", "mps") or v.startswith("cuda:"), "auto, cpu, cuda, cuda:N or mps"),
    "eval-batch-size": _POS_INT,
    "eval-every": _POS_INT,
    "resume": _ANY_STR,
    "stop-after-round": _NON_NEG_INT,
    "state-dir": _ANY_STR,
    "round-timeout": _POSITIVE,
    "sync-every": _POS_INT,
    "cluster-size": _NON_NEG_INT,
    "topology": _choice(TOPOLOGIES),
    "gossip-every": _POS_INT,
    "active-prob": Key(float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "gossip-lambda": Key(float, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "gossip-offsets": Key(str, lambda v: all(p.strip().isdigit() for p in v.split(",")) if v.strip() else True,
                          "comma-separated positive integers, e.g. \"1,3\" (or empty)"),
    "uploaders-per-cluster": _POS_INT,
    "sync-phase": _choice(("first", "last")),
    "min-replies": _POS_INT,
    "outlier-rule": _choice(("reject", "clip", "off")),
    "outlier-factor": Key(float, lambda v: v > 1, "a number > 1"),
    "tau-up": _NON_NEGATIVE,
    "tau-down": _NON_NEGATIVE,
    "compressor-down": _choice(COMPRESSORS),
    "topk-ratio-down": Key(float, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "downlink-mode": _choice(DOWNLINK_MODES),
    "ef-mode": _choice(EF_MODES),
    "ref-mode": _choice(REF_MODES),
    "bookkeeping-dir": _ANY_STR,
    "fault-fraction": Key(float, lambda v: 0 <= v <= 1, "a number in [0, 1]"),
    "fault-kind": _choice(("error", "garbage", "timeout", "mixed")),
    "fault-delay": _NON_NEGATIVE,
}

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
    "data-dir",
    "state-dir",
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


@dataclass(frozen=True)
class AppConfig:
    """The validated run-config (kebab-case keys become snake_case attributes)."""

    values: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any], *, check_strategy: bool = True, given: Collection[str] = ()) -> AppConfig:
        """Check every key; unknown keys and bad values raise ``ConfigError``.

        ``check_strategy=False`` skips only the strategy name (checked by the ServerApp before
        round 1), so a ClientApp does not import the server-side strategy registry. A ``preset``
        (:mod:`pollen.app.preset`) is applied first: its values replace the pyproject defaults, keys given
        on the command line (``given``, and any that differ from their default) win.
        """
        run_config = effective_run_config(run_config, given)
        unknown = sorted(set(run_config) - set(SCHEMA))
        if unknown:
            raise ConfigError(
                f"run-config key '{unknown[0]}' is unknown; allowed keys: {', '.join(sorted(SCHEMA))}"
            )
        missing = sorted(set(SCHEMA) - set(run_config))
        if missing:
            raise ConfigError(f"run-config key '{missing[0]}' is missing (it has a default in pyproject.toml)")
        values = {}
        for key, spec in SCHEMA.items():
            value = _coerce(key, run_config[key], spec)
            if key == "strategy":
                if check_strategy and not spec.check(value):
                    raise ConfigError(f"run-config '{key}' = {value!r} is out of range; allowed: {spec.words}")
            elif not spec.check(value):
                raise ConfigError(f"run-config '{key}' = {value!r} is out of range; allowed: {spec.words}")
            values[key] = value
        if values["lr-schedule"] == "step" and not values["lr-decay-rounds"].strip():
            raise ConfigError("run-config 'lr-schedule' = 'step' needs 'lr-decay-rounds', e.g. \"30,70\"; it is empty")
        if values["min-evaluate-nodes"] == 0 and values["fraction-evaluate"] > 0:
            raise ConfigError("run-config 'min-evaluate-nodes' = 0 with 'fraction-evaluate' > 0; allowed: >= 1")
        return cls(values)

    def __getitem__(self, key: str) -> Any:
        return self.values[key]

    def as_dict(self) -> dict[str, Any]:
        return dict(self.values)

    def replace(self, **changes: Any) -> AppConfig:
        """A copy with some keys changed (kebab-case names via ``**{"key": v}``), re-validated."""
        return AppConfig.from_run_config({**self.values, **changes})


def effective_run_config(run_config: Mapping[str, Any], given: Collection[str] = ()) -> dict[str, Any]:
    """``run_config`` with its ``preset`` applied (unchanged without one); ``ConfigError`` for a bad preset.

    ``given``: the keys the user set on the command line (they win even where they equal a default).
    """
    if not run_config.get("preset"):
        return dict(run_config)
    from pollen.app.preset import PresetError, apply_preset, pyproject_defaults

    try:
        return apply_preset(run_config, pyproject_defaults(), given)
    except PresetError as err:
        raise ConfigError(f"run-config 'preset': {err}") from None


def defaults_from_pyproject(path: str) -> dict[str, Any]:
    """The ``[tool.flwr.app.config]`` table of a pyproject file (used by tests and benchmarks)."""
    import tomllib

    with open(path, "rb") as handle:
        return dict(tomllib.load(handle)["tool"]["flwr"]["app"]["config"])

