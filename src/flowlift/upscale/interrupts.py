"""Cancel points inside an upscale: a front-end's ``check_interrupt()`` (ComfyUI's interrupt, a server's cancel)
called before every leaf module of the models runs and after every strip and tile, so that a stop request takes
effect within one layer's time instead of one stage's (a plain 2x pass of a large image is one UNet call of many
seconds). The check raises to stop; it sees no data, so results are unchanged bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch

_MARK = "_flowlift_interrupt_hook"
#: A front-end's cancel check: returns when the run may go on, raises to stop it.
InterruptCheck = Callable[[], None]


@contextmanager
def checked_modules(check: InterruptCheck | None, modules: Iterable[object]) -> Iterator[None]:
    """While inside, ``check()`` runs before the forward of every leaf module of each ``torch.nn.Module`` in
    ``modules`` (others are skipped); the hooks are removed on the way out, also when ``check`` raised. Nested
    scopes (an image run around its latent passes) hook each leaf once."""
    hooked = []
    if check is not None:
        for module in modules:
            if not isinstance(module, torch.nn.Module):
                continue
            for leaf in module.modules():
                if next(leaf.children(), None) is None and not hasattr(leaf, _MARK):
                    setattr(leaf, _MARK, leaf.register_forward_pre_hook(lambda _module, _args: check()))
                    hooked.append(leaf)
    try:
        yield
    finally:
        for leaf in hooked:
            getattr(leaf, _MARK).remove()
            delattr(leaf, _MARK)


def with_check(check: InterruptCheck | None, report: Callable[[int, int], None] | None):
    """``report(done, total)`` (progress per strip or tile) preceded by ``check()``; None when both are None."""
    if check is None:
        return report

    def checked(done: int, total: int) -> None:
        check()
        if report is not None:
            report(done, total)

    return checked
