"""Models register themselves on import; see :mod:`nmtflow.registry`."""
from nmtflow.models import transformer  # noqa: F401
