"""One configuration path: every option declared in tritone.config.OPTIONS reaches, from the
launcher's flag, the rendered config.pbtxt of each model that reads it, and from there the engine
or the text stage, with nothing written twice to drift apart."""

import dataclasses
import json
import pathlib

import pytest
from google.protobuf import json_format, text_format
from tritonclient.grpc import model_config_pb2

from tritone.config import OPTIONS, EngineConfig, Option, parameter
from tritone.launcher.repository import SERVED_AS
from tritone.launcher import ENSEMBLE_MODELS, INLINE_MODELS, build_parser, model_repository, render_repository, \
    template_values
from tritone.serving.inputs import model_parameters

LAUNCHER_PATHS = {"flow_board": "/run/board", "shutdown_file": "/run/shutting_down"}


def _other_value(option: Option):
    """A valid value of `option` that is not its default."""
    if option.choices:
        return next(c for c in option.choices if c != option.default)
    if option.type is bool:
        return not option.default
    if option.name == "device":
        return "cpu"
    if option.name == "lora_modules":
        return "adapter=/adapters/one,other=/adapters/two"
    if option.name == "text_nice":
        return "7"
    if option.type is float:
        return option.default / 2
    return option.default + 3


def _flags(values: dict) -> list[str]:
    argv = []
    for option in OPTIONS:
        value = values[option.name]
        if option.type is bool:
            argv += [option.flag_name] if value != option.default else []
        else:
            argv += [option.flag_name, str(value)]
    return argv


def _rendered_parameters(tmp_path, argv: list[str], models) -> dict[str, dict[str, str]]:
    """Each model's parameters as Triton reads them: the rendered config.pbtxt parsed as a
    ModelConfig (so the text is valid Triton configuration), then as the model sees it."""
    args = build_parser().parse_args(argv)
    repository = render_repository(tmp_path / "repo", {**template_values(args, pathlib.Path("/models/M")),
                                                       **LAUNCHER_PATHS}, models)
    out = {}
    for model in models:
        text = (repository / SERVED_AS.get(model, model) / "config.pbtxt").read_text()
        assert "${" not in text, f"{model}: a template is left unfilled"
        config = text_format.Parse(text, model_config_pb2.ModelConfig())
        out[model] = model_parameters(json.loads(json_format.MessageToJson(config, preserving_proto_field_name=True)))
    return out


@pytest.mark.parametrize("models", [ENSEMBLE_MODELS, INLINE_MODELS])
def test_every_option_reaches_every_model_that_reads_it(tmp_path, models):
    wanted = {o.name: _other_value(o) for o in OPTIONS}
    params = _rendered_parameters(tmp_path, _flags(wanted), models)
    for model, model_params in params.items():
        for option in OPTIONS:
            if model in option.models:
                assert parameter(model_params, option.name) == wanted[option.name], (model, option.name)
            else:
                assert option.name not in model_params, (model, option.name)
        if "${parameters}" in (model_repository() / model / "config.pbtxt").read_text():
            assert model_params["model_dir"] == "/models/M"
    for model in set(models) & {"llm", "llm_inline"}:
        config = EngineConfig.from_parameters(params[model]["model_dir"], params[model])
        assert dataclasses.asdict(config) == {"model": "/models/M",
                                              **{o.name: wanted[o.name] for o in OPTIONS if o.engine}}


def test_the_defaults_are_declared_once(tmp_path):
    """The launcher's defaults, the rendered parameters and EngineConfig's defaults are the
    declarations' (an unset parameter also gives the default)."""
    params = _rendered_parameters(tmp_path, [], ENSEMBLE_MODELS)["llm"]
    assert EngineConfig.from_parameters("M", params) == EngineConfig(model="M") == EngineConfig.from_parameters("M", {})
    args = vars(build_parser().parse_args([]))
    assert {o.name: args[o.name] for o in OPTIONS} == {o.name: o.default for o in OPTIONS}


def test_inline_takes_the_text_limits_too(tmp_path):
    params = _rendered_parameters(tmp_path, ["--max-input-bytes", "1234", "--max-input-len", "77"], INLINE_MODELS)
    assert parameter(params["llm_inline"], "max_input_bytes") == 1234
    assert parameter(params["llm_inline"], "max_input_len") == 77


def test_a_template_without_a_value_is_refused_naming_it(tmp_path):
    values = template_values(build_parser().parse_args([]), pathlib.Path("M"))
    with pytest.raises(KeyError, match="llm/config.pbtxt: no value for flow_board, shutdown_file"):
        render_repository(tmp_path / "repo", values, ("llm",))


@pytest.mark.parametrize("name,raw,match", [("max_num_seqs", "0", "max_num_seqs must be positive"),
                                            ("dtype", "fp8", "dtype must be auto, float32, bfloat16 or float16"),
                                            ("enable_prefix_caching", "maybe", "enable_prefix_caching: expected a boolean"),
                                            ("kv_cache_fraction", "1.5", r"kv_cache_fraction must be in \(0, 1\]"),
                                            ("device", "tpu", r"device must be auto, cpu or cuda\[:N\]"),
                                            ("stream_interval", "0", "stream_interval must be positive")])
def test_a_bad_parameter_is_refused_naming_the_option(name, raw, match):
    with pytest.raises(ValueError, match=match):
        if OPTIONS_BY_ENGINE.get(name, False):
            EngineConfig.from_parameters("M", {name: raw})
        else:
            parameter({name: raw}, name)


OPTIONS_BY_ENGINE = {o.name: o.engine for o in OPTIONS}


def test_an_installed_package_carries_the_model_repository(tmp_path):
    """Built as a wheel and installed away from the checkout, the launcher still renders every model."""
    import subprocess
    import sys

    import shutil

    root = pathlib.Path(__file__).resolve().parents[1]
    had_build = (root / "build").exists()
    try:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(root),
                        "-w", str(tmp_path / "wheel")], check=True, cwd=tmp_path)
    finally:  # setuptools builds in the checkout: leave it as it was
        if not had_build:
            shutil.rmtree(root / "build", ignore_errors=True)
    wheel = next((tmp_path / "wheel").glob("tritone-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(tmp_path / "site"),
                    str(wheel)], check=True)
    script = ("import pathlib, sys; from tritone.launcher import *; "
              "v = {**template_values(build_parser().parse_args([]), pathlib.Path('M')), 'flow_board': 'F', "
              "'shutdown_file': 'S'}; print(model_repository()); "
              "print([sorted(p.name for p in render_repository(pathlib.Path(sys.argv[1]) / str(i), v, m).iterdir() "
              "if (p / '1').is_dir()) for i, m in enumerate((ENSEMBLE_MODELS, INLINE_MODELS))])")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "rendered")], check=True, text=True,
                         capture_output=True, cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "site"),
                                                                "PATH": "/usr/bin:/bin"}).stdout.splitlines()
    assert out[0].startswith(str(tmp_path / "site"))
    assert out[1] == str([sorted(ENSEMBLE_MODELS), ["ensemble"]])  # llm_inline serves as the ensemble
