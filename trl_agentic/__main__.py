"""`python -m trl_agentic train --config ...` (also under `accelerate launch -m trl_agentic`)."""

import sys

from .cli import main

sys.exit(main())
