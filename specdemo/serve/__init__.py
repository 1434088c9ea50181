"""Serving elsewhere: exports (EAGLE-3, speculators), serve-config for vLLM and SGLang, deploying as a Space."""
