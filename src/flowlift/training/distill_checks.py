"""``flowlift dataset distill``'s inputs found before any model loads, every missing piece named in one line.

The teacher (a local pipeline or transformer folder, or a hub id in the cache or on the hub), the prompts its kind
needs (``--prompts`` for a pipeline, ``--prompt-embeds`` for a bare transformer) and the VAE: a user missing two of
them learns both from one run, as ``upscale`` and ``img2img`` say every missing weight at once.
"""

from __future__ import annotations

from pathlib import Path

from flowlift.errors import FlowliftError


def teacher_kind(teacher: str) -> str | None:
    """``"pipeline"`` (a folder with model_index.json, or a hub id), ``"transformer"`` (a folder with config.json),
    else None."""
    from flowlift.models.weights import looks_like_repo_id

    path = Path(teacher).expanduser()
    if (path.is_dir() and (path / "model_index.json").is_file()) or (not path.exists() and looks_like_repo_id(teacher)):
        return "pipeline"
    if path.is_dir() and (path / "config.json").is_file():
        return "transformer"
    return None


def distill_problems(teacher: str, prompts: str | None, prompt_embeds: str | None, vae: str) -> list[str]:
    """Every missing piece of a distill run, in the order a user fixes them (empty: nothing is missing)."""
    from flowlift.models.vae_loading import check_vae_spec
    from flowlift.refine.source_checks import check_model_part

    problems: list[str] = []
    kind = teacher_kind(teacher)
    if kind is None:
        problems.append(
            f"--teacher {teacher}: not a diffusers pipeline (model_index.json), a transformer folder "
            "(config.json) or a hub repo id"
        )
    elif kind == "pipeline" and not Path(teacher).expanduser().exists():
        try:
            check_model_part(teacher, "transformer", "--teacher")  # the cache (offline) or the hub
        except FlowliftError as error:
            problems.append(str(error))
    if kind == "pipeline":
        if not prompts:
            problems.append("a pipeline teacher needs --prompts (a text file, one prompt per line)")
        elif not Path(prompts).is_file():
            problems.append(f"--prompts {prompts}: file not found")
    elif kind == "transformer":
        if not prompt_embeds:
            problems.append("a transformer teacher needs --prompt-embeds (a safetensors file with 'prompt_embeds')")
        elif not Path(prompt_embeds).is_file():
            problems.append(f"--prompt-embeds {prompt_embeds}: file not found")
    try:
        check_vae_spec(vae)
    except FlowliftError as error:
        problems.append(str(error))
    return problems


def check_distill_inputs(teacher: str, prompts: str | None, prompt_embeds: str | None, vae: str) -> None:
    """One FlowliftError naming every missing piece (:func:`distill_problems`), before any model loads."""
    problems = distill_problems(teacher, prompts, prompt_embeds, vae)
    if len(problems) == 1:
        raise FlowliftError(problems[0])
    if problems:
        parts = "; ".join(f"({i}) {problem}" for i, problem in enumerate(problems, 1))
        raise FlowliftError(f"{len(problems)} things are missing: {parts}")
