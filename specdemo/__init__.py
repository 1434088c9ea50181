"""specdemo: speculative decoding you can watch, on real models, with honest timing."""

__version__ = "0.1.0"
