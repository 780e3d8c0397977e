"""Building blocks: attention variants (registered by name), layers, positions."""
from nmtflow.nn import attention  # noqa: F401
from nmtflow.nn import shortcuts  # noqa: F401  (lexical shortcuts, SPEC §2)
from nmtflow.nn import phrasal  # noqa: F401  (phrasal attention, SPEC §3)
