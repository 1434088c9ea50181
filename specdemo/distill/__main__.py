"""`python -m specdemo.distill ...`, the same as `python -m specdemo distill ...`."""

import sys

from .cli import main

sys.exit(main())
