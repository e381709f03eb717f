"""The refine options' choices that are the refine package's own, in a module without torch (the
command line's ``--help`` reads them)."""

#: How an img2img strength becomes the window's start (:func:`flowlift.refine.loop.denoising_start_for`):
#: ``linear`` 1 - s, ``canvas`` 1 - s**0.2.
STRENGTH_MAPS = ("linear", "canvas")
