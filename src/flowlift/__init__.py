"""flowlift: FLUX.2 latent-space image work.

Conventions used everywhere in the package (documented once, here and in the README):

* images are float tensors in [0, 1], NCHW, RGB;
* latents are *normalized*, *unpatchified*, 32-channel FLUX.2 latents at 1/8 of the image size,
  unless a name says otherwise (``packed``: (B, h*w, 128) transformer tokens; ``raw``: the VAE's
  un-normalized output; ``patchified``: (B, 128, H/2, W/2)).

Importing flowlift never downloads, allocates large tensors or touches the network.
"""

__version__ = "0.1.0"
