"""Name → class registries for models and attention variants.

Users extend nmtflow from their own code, without editing it::

    from nmtflow.registry import register_model, register_attention

    @register_attention("my_attention", MyOptions)
    class MyAttention(MultiHeadAttention): ...

and load the module with ``nmtflow --plugin my_module train config.yaml``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Entry:
    """A registered class and the dataclass that types its configuration."""

    cls: type
    config_cls: type


def _same_definition(a: type, b: type) -> bool:
    """The same class defined again (a reloaded plugin module, a re-run notebook cell), not another one."""
    return (a.__module__, a.__qualname__) == (b.__module__, b.__qualname__)


class Registry:
    """A case-sensitive mapping from names to (class, config dataclass).

    ``key`` is the field of the config dataclass that names the entry in a config (``name`` for models,
    ``type`` for attentions): a config class without it could never be selected, so registering one is an error.
    """

    def __init__(self, kind: str, key: str, base: str) -> None:
        self.kind, self.key, self.base = kind, key, base
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, config_cls: type) -> Callable[[type[T]], type[T]]:
        if not isinstance(name, str) or not name:
            raise TypeError(f"a {self.kind} is registered under a non-empty string, got {name!r}")
        if not (isinstance(config_cls, type) and dataclasses.is_dataclass(config_cls)
                and self.key in {f.name for f in dataclasses.fields(config_cls)}):
            raise TypeError(f"{self.kind} {name!r}: its config class must be a dataclass with a {self.key!r} field "
                            f"(subclass {self.base}), got {config_cls!r}")

        def decorator(cls: type[T]) -> type[T]:
            old = self._entries.get(name)
            if old is not None and old.cls is not cls and not _same_definition(old.cls, cls):
                raise ValueError(f"{self.kind} {name!r} is already registered "
                                 f"({old.cls.__module__}.{old.cls.__qualname__})")
            self._entries[name] = Entry(cls, config_cls)  # a redefinition replaces its earlier self
            return cls

        return decorator

    def get(self, name: str) -> Entry:
        _load_builtins()
        if not isinstance(name, str) or name not in self._entries:
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {', '.join(sorted(self._entries))} "
                           f"(one of your own is registered by its module: nmtflow --plugin MODULE ...)")
        return self._entries[name]

    def names(self) -> list[str]:
        _load_builtins()
        return sorted(self._entries)

    def __contains__(self, name: Any) -> bool:
        _load_builtins()
        return name in self._entries


MODELS = Registry("model", "name", "nmtflow.models.base.ModelConfig")
ATTENTIONS = Registry("attention", "type", "nmtflow.nn.attention.AttentionConfig")


def register_model(name: str, config_cls: type) -> Callable[[type[T]], type[T]]:
    """Class decorator: make a model selectable as ``model: {name: NAME}`` in configs."""
    return MODELS.register(name, config_cls)


def register_attention(name: str, options_cls: type) -> Callable[[type[T]], type[T]]:
    """Class decorator: make an attention variant selectable as ``{type: NAME, ...options}``."""
    return ATTENTIONS.register(name, options_cls)


_BUILTINS_LOADED = False
_import_builtins: Callable[[], None] | None = None  # set by the package (nmtflow/__init__.py): see set_builtins


def set_builtins(import_builtins: Callable[[], None]) -> None:
    """``import_builtins`` imports the modules that register nmtflow's own models and attentions; the first lookup
    calls it. The package installs it (nmtflow/__init__.py): the registry sits below those modules, which import
    it, so it imports none of them itself."""
    global _import_builtins
    _import_builtins = import_builtins


def _load_builtins() -> None:
    """Import the modules that register nmtflow's own models and attentions (once)."""
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    _BUILTINS_LOADED = True
    if _import_builtins is not None:
        _import_builtins()
