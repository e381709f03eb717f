"""``flowlift app``: the local Gradio page and its handlers."""
