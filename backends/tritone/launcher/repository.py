"""The model repository a server loads: the templates of `model_repository/`, filled.

Each config.pbtxt holds `${name}` templates (paths the launcher makes, instance counts) and a
`${parameters}` line, which becomes one parameter per option of tritone.config.OPTIONS that the
model reads: no option is written in a .pbtxt by hand.
"""

from __future__ import annotations

import pathlib
import re
import shutil

from tritone.config import model_parameters_text

# Inside the package (in a checkout, a link to the top-level model_repository/), so that an
# installed Tritone finds its templates as a checkout does.
_SOURCE = pathlib.Path(__file__).resolve().parents[1] / "model_repository"
_TEMPLATE = re.compile(r"\$\{(\w+)\}")
# The models a server loads (--pipeline): the ensemble stack, or the engine's process doing the
# text work too (never both: each loads the model).
ENSEMBLE_MODELS = ("preprocessing", "llm", "postprocessing", "ensemble")
INLINE_MODELS = ("llm_inline",)
# Models served under another name: llm_inline answers as "ensemble" (its inputs and outputs are
# the ensemble's), so that every client of the ensemble calls it unchanged.
SERVED_AS = {"llm_inline": "ensemble"}


def model_repository() -> pathlib.Path:
    """The templates' directory."""
    if not (_SOURCE / "llm" / "config.pbtxt").exists():
        raise RuntimeError(f"the model repository's templates are missing from {_SOURCE}")
    return _SOURCE.resolve()


def render_repository(target: pathlib.Path, values: dict[str, object],
                      models: tuple[str, ...] = ENSEMBLE_MODELS) -> pathlib.Path:
    """Copies the `models` of the model repository to `target`, filling `${name}` templates from
    `values` and each `${parameters}` line with the model's options (`values` holds every option).
    Raises naming a template that has no value: a server must never load a half-filled config."""
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    source = model_repository()
    for model in models:
        name = SERVED_AS.get(model, model)
        shutil.copytree(source / model, target / name, ignore=shutil.ignore_patterns("__pycache__"))
        (target / name / "1").mkdir(exist_ok=True)  # the ensemble's is empty, and packages drop empty folders
        config = target / name / "config.pbtxt"
        filled = {**values, "parameters": model_parameters_text(model, values)}
        text = config.read_text()
        missing = sorted(set(_TEMPLATE.findall(text)) - filled.keys())
        if missing:
            raise KeyError(f"{model}/config.pbtxt: no value for {', '.join(missing)}")
        text = _TEMPLATE.sub(lambda m: str(filled[m.group(1)]), text)
        if name != model:
            text, renamed = re.subn(rf'^name: "{model}"$', f'name: "{name}"', text, count=1, flags=re.M)
            if not renamed:
                raise KeyError(f"{model}/config.pbtxt: no name line to serve it as {name}")
        config.write_text(text)
    return target
