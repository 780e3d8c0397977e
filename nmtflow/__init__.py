"""nmtflow: neural machine translation research on information flow."""
__version__ = "0.1.0"

from nmtflow import registry as _registry  # noqa: E402  (imports nothing of nmtflow: no torch, no models)


def _import_builtins() -> None:
    """Import the modules that register nmtflow's own models and attentions; the registry calls this on its first
    lookup. Installed here, above every layer, because every import of an nmtflow module runs this file first."""
    import nmtflow.models  # noqa: F401  (registers on import)
    import nmtflow.nn  # noqa: F401


_registry.set_builtins(_import_builtins)
