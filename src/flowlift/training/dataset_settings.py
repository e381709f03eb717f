"""``flowlift dataset``'s dtype knobs, declared once and free of torch: the command's options are made from them (its
``--help`` imports no torch), and :class:`~flowlift.training.dataset_jobs.DatasetRequest` / ``TeacherSource`` check
by them. :data:`flowlift.training.shards.STORAGE_DTYPES` maps the same names to torch dtypes (a test holds the two
equal)."""

from __future__ import annotations

from flowlift.knobs import Knob

#: The dtypes a shard stores its tensors in, and a teacher's weights run in, by name.
DTYPE_NAMES = ("float16", "bfloat16", "float32")
#: The shards' dtype and the teacher's: a choice compared, never hashed (a list is no name).
STORAGE_DTYPE = Knob("storage_dtype", str, "float16", "tensor dtype in shards", choices=DTYPE_NAMES)
TEACHER_DTYPE = Knob(
    "teacher_dtype",
    str,
    None,
    "teacher weights dtype (default bfloat16 on CUDA, float32 on the CPU)",
    choices=DTYPE_NAMES,
    optional=True,
)
