"""Network architectures, one file each.

* :mod:`flowlift.models.upscaler_unet` — the Flow Upscaler UNet (``TensorForger/FlowUpscaler``) and the
  one-step sampler; :mod:`flowlift.models.upscaler_weights` its loader/saver. Its exact, bounded-memory
  chunked executor lives in :mod:`flowlift.upscale.chunked.executor`.
* :mod:`flowlift.models.taef2` — TAEF2, the tiny FLUX.2 autoencoder, with exact tiled encode/decode
  (:mod:`flowlift.models.taef2_tiling`).

Nothing is imported eagerly: ``import flowlift.models`` stays cheap.
"""
