"""The single-sequence engine and drafters as they were before the one engine: the oracle its batch-1 tokens and
step events are tested against. Deleted once that test passes."""
