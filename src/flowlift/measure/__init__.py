"""Metrics, eval runs, band response and the other upscalers they compare against."""
