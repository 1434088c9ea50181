"""`python -m specdemo.train ...`, the same as `python -m specdemo distill ...`."""

import os
import sys

from ..config import runtime_from_env
from .cli import main

sys.exit(main(runtime=runtime_from_env(os.environ)))
