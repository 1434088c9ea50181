"""`python -m specdemo bench`: our decoders on a prompt set against transformers and vLLM (cli.DESCRIPTION says how)."""

from .cli import main

__all__ = ["main"]
