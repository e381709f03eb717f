"""Many images: batch planning and resume, the job manifest, torchrun shards."""
