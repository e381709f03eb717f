"""The FLUX.2 sampling choices as plain values (no torch), so a command's ``--help`` and the knob tables
(:mod:`flowlift.refine.settings`) read them without loading the maths. :mod:`flowlift.flux2.schedule` and
:mod:`flowlift.flux2.sampling` use these same objects.
"""

from __future__ import annotations

#: The fixed shift of InvokeAI's and ComfyUI's FLUX.2 schedules (and of the founding document's table).
DEFAULT_MU = 2.02
#: ``mu="empirical"``: diffusers' formula, from the full image sequence length and the full step count.
EMPIRICAL_MU = "empirical"
#: The mu a schedule may run with. Below 0 the shift would move steps towards sigma 0, the opposite of
#: every FLUX.2 schedule (0 itself is the unshifted linear schedule); above 15 (a shift factor e^15 of
#: about 3.3e6) a few-step schedule's top sigmas are closer to 1 than float32 resolves (6e-8).
MU_RANGE = (0.0, 15.0)
#: How a denoising window is filled: every step respaced into it, or the full schedule clipped to it.
SCHEDULES = ("respaced", "clipped")
#: The samplers of :mod:`flowlift.flux2.sampling`.
SAMPLERS = ("euler", "heun")
