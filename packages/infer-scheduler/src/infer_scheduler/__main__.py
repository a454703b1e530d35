"""`python -m infer_scheduler --config FILE` (same as `rustinfer-scheduler`)."""

import sys

from infer_scheduler.cli import main

if __name__ == "__main__":
    sys.exit(main())
