"""Training the Flow Upscaler: datasets, the flow-matching trainer, validation.

Modules (nothing heavy is imported here):

* :mod:`~flowlift.training.degrade` — pixel-space degradation and conditioning latents
  (decode -> antialiased 2x downscale -> encode; never latent interpolation).
* :mod:`~flowlift.training.shards` — the sharded safetensors dataset format and its streaming loader.
* :mod:`~flowlift.training.datasets` — the ``distill`` (teacher) and ``images`` (real photos) builders.
* :mod:`~flowlift.training.config` — :class:`TrainConfig`, loaded from a file plus overrides.
* :mod:`~flowlift.training.trainer` — the rectified-flow trainer (AdamW, warm-up + cosine, EMA,
  accumulation, checkpoint/resume, DDP under ``torchrun``).
* :mod:`~flowlift.training.loop_support` — beside the loop's steps: batches read ahead, the stop a signal asks for.
* :mod:`~flowlift.training.objective` — the step's pure maths: flow-matching loss, learning-rate
  schedule, EMA, dropout seeds.
* :mod:`~flowlift.training.checkpoints` — checkpoint folders: write, read, prune, pick the one to resume.
* :mod:`~flowlift.training.distributed` — the run's rank in the ``torchrun`` process group and its device.
* :mod:`~flowlift.training.validation` — held-out metrics against lanczos / latent-bicubic, CSV, plot.
"""
