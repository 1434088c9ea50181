"""Serving elsewhere: exports (EAGLE-3, speculators) and serve-config for vLLM and SGLang. Deploying the app as a
Hugging Face Space is the app's own (specdemo.app.space)."""
