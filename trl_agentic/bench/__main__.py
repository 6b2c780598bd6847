"""`python -m trl_agentic.bench [--out FILE] [...]`: run the benchmarks (the TracIn step benchmark today)."""

import sys

from .tracin import main

if __name__ == "__main__":
    sys.exit(main())
