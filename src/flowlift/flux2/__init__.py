"""The FLUX.2 latent space and its sampling maths.

The latent format, the shifted schedule, the samplers, img2img start latents and the transformer as a
velocity function: pure functions and thin wrappers, no weights loaded here.
"""
