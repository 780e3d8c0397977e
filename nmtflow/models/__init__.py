"""Models register themselves on import; see :mod:`nmtflow.registry`."""
from nmtflow.models import transformer  # noqa: F401
from nmtflow.models import lm  # noqa: F401  (decoder-only language model)
from nmtflow.models import convs2s  # noqa: F401  (ConvS2S and DenseNMT, SPEC §1 and §4)
from nmtflow.models import rnn  # noqa: F401  (attentional BiLSTM, SPEC §1)
from nmtflow.models import multilingual  # noqa: F401  (attention bridge, language label; SPEC §5)
