"""``python -m nmtflow`` (also what ``torchrun -m nmtflow`` runs)."""
import sys

from nmtflow.cli import main

sys.exit(main())
