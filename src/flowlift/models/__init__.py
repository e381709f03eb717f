"""Network architectures, one file each.

* :mod:`flowlift.models.upscaler_unet` — the Flow Upscaler UNet (``TensorForger/FlowUpscaler``), its
  loader/saver and the one-step sampler. Its exact, bounded-memory chunked executor lives in
  :mod:`flowlift.upscale.chunked.executor`.
* :mod:`flowlift.models.taef2` — TAEF2, the tiny FLUX.2 autoencoder, with exact tiled encode/decode.

Nothing is imported eagerly: ``import flowlift.models`` stays cheap.
"""
