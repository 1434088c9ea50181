"""The Gradio app: layout (ui), handlers, request checks and pacing (race), rendering, charts, the compute worker. The
only package that imports gradio."""
