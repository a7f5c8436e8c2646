"""One registry of KV methods: a method's config class, its class and, when it trains, its training
(trainable modules + objective), registered together by one explicit call, PEFT's
``register_peft_method`` style. ``zoomkv/methods/__init__.py`` makes every call, in one list.

    register_method("quest", QuestConfig, Quest)
    register_method("sekv", SeKVConfig, SeKV, training=SeKVTraining())
"""

from __future__ import annotations

from typing import Any

from zoomkv.errors import ConfigError, MethodNotFoundError
from zoomkv.protocol.method import KVMethod, MethodConfig
from zoomkv.protocol.training import MethodTraining

METHODS: dict[str, type[KVMethod]] = {}
TRAINING: dict[str, MethodTraining] = {}


def register_method(name: str, config_cls: type[MethodConfig], method_cls: type[KVMethod], *,
                    training: MethodTraining | None = None) -> None:
    """Make ``name`` a method: ``get_method(name, **hyper)`` builds ``method_cls(config_cls(**hyper))``; with
    ``training``, the adapter artefact and the trainer find its modules and its objective here."""
    if method_cls.name != name or method_cls.config_class is not config_cls:
        raise ValueError(f"{method_cls.__name__} declares name {method_cls.name!r} and config "
                         f"{method_cls.config_class.__name__}, registered as {name!r} with {config_cls.__name__}")
    if name in METHODS and METHODS[name] is not method_cls:
        raise ValueError(f"method {name!r} is registered twice")
    METHODS[name] = method_cls
    if training is not None:
        TRAINING[name] = training


def unregister_method(name: str) -> None:
    """Remove ``name`` from the registry (tests register methods of their own)."""
    METHODS.pop(name, None)
    TRAINING.pop(name, None)


def get_method(name: str | KVMethod, **hyperparameters: Any) -> KVMethod:
    """The method ``name`` built with these hyper-parameters (the rest at their published defaults); a method object is returned as is."""
    if isinstance(name, KVMethod):
        return name
    if name not in METHODS:
        raise MethodNotFoundError(f"unknown method {name!r}; valid methods: {', '.join(sorted(METHODS))}")
    return METHODS[name](**hyperparameters)


def list_methods() -> list[type[KVMethod]]:
    """Every registered method class, by name (``zoomkv methods`` prints them)."""
    return [METHODS[n] for n in sorted(METHODS)]


def get_training(name: str) -> MethodTraining:
    """The training of a trainable method (its modules and objective)."""
    if name not in TRAINING:
        raise ConfigError(f"method {name!r} has no trainable adapter; trainable methods: {sorted(TRAINING)}")
    return TRAINING[name]
