"""Image files in and out: robust reading, atomic writes, output names."""
