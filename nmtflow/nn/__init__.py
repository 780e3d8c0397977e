"""Building blocks: attention variants (registered by name), layers, positions."""
from nmtflow.nn import attention  # noqa: F401
