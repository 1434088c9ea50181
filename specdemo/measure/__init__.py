"""Measuring: the race of two runs (compare), the sweeps over k and batch size, metrics and theory, the benchmark."""
