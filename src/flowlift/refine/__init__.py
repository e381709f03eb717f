"""FLUX.2 txt2img, img2img, inpaint, outpaint and the hires fix on diffusers components."""
