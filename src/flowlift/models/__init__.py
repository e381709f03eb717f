"""Network architectures, one file each."""
