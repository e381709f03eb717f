"""The Flow Upscaler pipeline: sizes and passes, the colour-drift stages, memory planning, model loading."""
