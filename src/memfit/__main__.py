"""`python -m memfit ...` (and `torchrun -m memfit ...`) runs the command line."""
import sys

from memfit.cli import main

sys.exit(main())
