"""Every comma-separated list a door takes goes through one parser (:func:`flowlift.knobs.comma_items`): an empty item
(``lanczos,,bicubic``, a trailing comma) and an item given twice are one line naming the option, never dropped or
run twice without a word (``eval --run`` skipped the empty item; ``train --set val_images=a,,b`` dropped it)."""

from __future__ import annotations

import pytest

from flowlift.commands.cli import main
from flowlift.errors import FlowliftError
from flowlift.measure.methods import parse_methods
from flowlift.training.config import TrainConfig, apply_overrides


def _one_line(capsys, command: str) -> str:
    err = capsys.readouterr().err.strip()
    assert err.splitlines() == [err] and err.startswith(f"flowlift {command}: error: ") and "Traceback" not in err
    return err


@pytest.mark.parametrize("text", ["lanczos,,bicubic", "lanczos,", ",lanczos", "lanczos, ,bicubic"])
def test_an_empty_item_is_refused_not_skipped(text):
    with pytest.raises(FlowliftError, match="empty item") as caught:
        parse_methods(text)
    assert caught.value.fields == ("run",)
    with pytest.raises(FlowliftError, match="empty item"):
        parse_methods(["bicubic", text])


@pytest.mark.parametrize(
    "given", ["lanczos,bicubic,lanczos", ["lanczos", "bicubic,lanczos"], "flow:seed=1:color=on,flow:color=on:seed=1"]
)
def test_a_method_given_twice_is_refused(given):
    with pytest.raises(FlowliftError, match="twice") as caught:
        parse_methods(given)
    assert caught.value.fields == ("run",)


def test_the_shared_parser_keeps_the_order_and_strips_each_item():
    from flowlift.knobs import comma_items

    assert comma_items(" a , b,c ", "x") == ["a", "b", "c"]
    assert comma_items(["a,b", "c"], "x") == ["a", "b", "c"]


def test_eval_run_with_an_empty_item_is_one_line_naming_run_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "report"
    argv = ["eval", "--run", "lanczos,,bicubic", "--dataset", str(tmp_path), "-o", str(out), "--no-progress"]
    assert main(argv) == 2
    err = _one_line(capsys, "eval")
    assert "--run 'lanczos,,bicubic' has an empty item" in err, err
    assert not out.exists()
    assert (
        main(["eval", "--run", "lanczos", "--run", "bicubic,lanczos", "--dataset", str(tmp_path), "-o", str(out)]) == 2
    )
    assert "--run 'bicubic,lanczos' gives 'lanczos' twice" in _one_line(capsys, "eval")
    assert not out.exists()


def test_train_list_settings_refuse_an_empty_item_and_keep_an_empty_text_as_no_list(capsys):
    with pytest.raises(FlowliftError, match="val_images 'a.png,,b.png' has an empty item"):
        apply_overrides(TrainConfig(), {"val_images": "a.png,,b.png"})
    with pytest.raises(FlowliftError, match="val_images 'a.png, a.png' gives 'a.png' twice"):
        apply_overrides(TrainConfig(), {"val_images": "a.png, a.png"})
    assert apply_overrides(TrainConfig(), {"val_images": ""}).val_images == []
    assert main(["train", "--set", "val_images=a.png,", "--print-config"]) == 2
    assert "empty item" in _one_line(capsys, "train")
