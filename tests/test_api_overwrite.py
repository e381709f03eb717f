"""Issue 43.1: through the Python API, no non-bool ever counts as ``overwrite=True`` (nor ``color_fix=True``).

A script, a web form or another front-end passing a form value (``"no"``, ``"false"``) must get one line, and a
file flowlift did not write must stay as it was: at construction (the request objects) and at the replace rule
itself (every writer's last check), so a request built another way cannot slip past either.
"""

from __future__ import annotations

import pytest
from PIL import Image

from flowlift.errors import FlowliftError
from flowlift.files.image_outputs import check_single_output
from flowlift.files.own_files import check_replaceable, replace_problem
from flowlift.jobs.batch import Job, existing_output, pending
from flowlift.refine.request import HiresSettings, PromptRequest, RefineRequest, RefinerSource
from flowlift.training.config import TrainConfig
from flowlift.upscale.colorfix_job import ColorFixRequest
from flowlift.upscale.plan import UpscaleRequest

NOT_BOOLS = ["no", "false", "False", "0", "", "yes", 1, 0, 1.0, None, [], [True]]
USERS_BYTES = b"the user's own notes, not an image of flowlift's"


@pytest.fixture
def users_file(tmp_path):
    path = tmp_path / "photo_x2.png"
    path.write_bytes(USERS_BYTES)
    return path


def _refine(**fields):
    return RefineRequest(
        mode="img2img", prompt=PromptRequest(text="a cat"), source=RefinerSource(model="m"), image="in.png", **fields
    )


@pytest.mark.parametrize("value", NOT_BOOLS, ids=repr)
def test_requests_refuse_a_non_bool_overwrite(value):
    for build in (
        lambda: UpscaleRequest(inputs=["in.png"], overwrite=value),
        lambda: _refine(overwrite=value),
        lambda: ColorFixRequest(inputs=["a.png"], references=["b.png"], overwrite=value),
    ):
        with pytest.raises(FlowliftError, match=r"^overwrite must be true or false, got"):
            build()


@pytest.mark.parametrize("value", NOT_BOOLS, ids=repr)
def test_hires_color_fix_refuses_a_non_bool(value):
    with pytest.raises(FlowliftError, match=r"^color_fix must be true or false, got"):
        HiresSettings(color_fix=value)


@pytest.mark.parametrize("value", [True, False])
def test_requests_keep_a_real_bool(value):
    assert UpscaleRequest(inputs=["in.png"], overwrite=value).overwrite is value
    assert _refine(overwrite=value).overwrite is value
    assert HiresSettings(color_fix=value).color_fix is value


@pytest.mark.parametrize("value", ["no", "false", 1], ids=repr)
def test_the_replace_rule_itself_refuses_a_non_bool_and_keeps_the_file(users_file, value):
    """A request object built around its checks (``object.__setattr__``) still reaches the sinks, which refuse."""
    request = UpscaleRequest(inputs=["in.png"])
    object.__setattr__(request, "overwrite", value)
    checks = [
        lambda: replace_problem(users_file, lambda _path: False, request.overwrite, "upscale"),
        lambda: check_replaceable({users_file: lambda _path: False}, request.overwrite, "bands"),
        lambda: existing_output(Job(users_file.with_name("photo.png"), users_file), request.overwrite),
        lambda: pending([Job(users_file.with_name("photo.png"), users_file)], request.overwrite),
        lambda: check_single_output(users_file, request.overwrite),
    ]
    for check in checks:
        with pytest.raises(FlowliftError, match="overwrite must be true or false"):
            check()
    assert users_file.read_bytes() == USERS_BYTES


def test_a_users_image_at_the_output_name_is_refused_without_a_true(tmp_path):
    """The rule with real bools: False keeps a user's finished image, True (and only True) allows replacing it."""
    output = tmp_path / "photo_x2.png"
    Image.new("RGB", (8, 8), (10, 20, 30)).save(output)
    job = Job(tmp_path / "photo.png", output, expected_size=(16, 16))
    assert existing_output(job, False).action == "refuse"
    assert existing_output(job, True).action == "new"
    with pytest.raises(FlowliftError, match="was not written by flowlift"):
        check_single_output(output, False)


@pytest.mark.parametrize("value", ["no", "false", 1], ids=repr)
def test_train_config_refuses_a_non_bool_overwrite(value):
    with pytest.raises(FlowliftError, match="overwrite"):
        TrainConfig(data="d", output="o", overwrite=value).validate()
