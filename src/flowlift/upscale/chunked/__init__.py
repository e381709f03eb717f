"""Exact bounded-memory execution of the Flow Upscaler UNet in row strips."""
