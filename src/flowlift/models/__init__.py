"""Neural network modules.

* :mod:`flowlift.models.upscaler_unet` — the Flow Upscaler UNet (``TensorForger/FlowUpscaler``), its
  loader/saver and the one-step sampler. Its exact, bounded-memory chunked executor lives in
  :mod:`flowlift.executor`.

Nothing is imported eagerly: ``import flowlift.models`` stays cheap.
"""
