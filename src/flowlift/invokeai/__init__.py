"""The InvokeAI node pack: the Flow Upscaler and the colour fix as InvokeAI invocations.

``nodes`` holds the three invocations (ids ``flowlift_*``, category ``flowlift``) and needs InvokeAI's
``invokeai.invocation_api``; ``latents`` (InvokeAI's raw FLUX.2 latents and the node inputs' checks) and
``files`` (weight files named by their SHA-256) are plain flowlift and import no InvokeAI module.
The repository root's ``__init__.py`` is the pack's entry point (see docs/invokeai.md).
"""
