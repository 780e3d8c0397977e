"""Name → class registries for models and attention variants.

Users extend nmtflow from their own code, without editing it::

    from nmtflow.registry import register_model, register_attention

    @register_attention("my_attention", MyOptions)
    class MyAttention(MultiHeadAttention): ...

and load the module with ``nmtflow --plugin my_module train config.yaml``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Entry:
    """A registered class and the dataclass that types its configuration."""

    cls: type
    config_cls: type


class Registry:
    """A case-sensitive mapping from names to (class, config dataclass)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry] = {}

    def register(self, name: str, config_cls: type) -> Callable[[type[T]], type[T]]:
        def decorator(cls: type[T]) -> type[T]:
            if name in self._entries and self._entries[name].cls is not cls:
                raise ValueError(f"{self.kind} {name!r} is already registered "
                                 f"({self._entries[name].cls.__qualname__})")
            self._entries[name] = Entry(cls, config_cls)
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


MODELS = Registry("model")
ATTENTIONS = Registry("attention")


def register_model(name: str, config_cls: type) -> Callable[[type[T]], type[T]]:
    """Class decorator: make a model selectable as ``model: {name: NAME}`` in configs."""
    return MODELS.register(name, config_cls)


def register_attention(name: str, options_cls: type) -> Callable[[type[T]], type[T]]:
    """Class decorator: make an attention variant selectable as ``{type: NAME, ...options}``."""
    return ATTENTIONS.register(name, options_cls)


_BUILTINS_LOADED = False


def _load_builtins() -> None:
    """Import the modules that register nmtflow's own models and attentions (once)."""
    global _BUILTINS_LOADED
    if _BUILTINS_LOADED:
        return
    _BUILTINS_LOADED = True
    import nmtflow.models  # noqa: F401  (registers on import)
    import nmtflow.nn  # noqa: F401
