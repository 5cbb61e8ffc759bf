"""`python -m slime_sparse.eval`: the slime-sparse-eval command."""
import sys

from .cli import main

sys.exit(main())
