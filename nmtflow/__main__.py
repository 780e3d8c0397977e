"""``python -m nmtflow`` (also what ``torchrun -m nmtflow`` runs)."""
import logging
import os
import sys

from nmtflow.cli import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1") or 1) > 1:
    # a torchrun process leaves without the interpreter's finalisation: gloo's worker threads, torn down there
    # in no set order, sometimes abort the process ("terminate called without an active exception") after
    # the run has finished and saved everything
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
