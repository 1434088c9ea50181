"""Distil a draft head (an EAGLE-3 head, specdemo.models.eagle3) from a target, using only the target's own answers:
instructions -> answers (stage 1) -> features (stage 2) -> training (stage 3), each cached in a work folder so a rerun
resumes; cli.py is the command line (`python -m specdemo distill`), config.TrainConfig holds every setting.
"""

from .cli import main
from .config import TrainConfig

__all__ = ["TrainConfig", "main"]
