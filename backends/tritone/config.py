"""Every option of a Tritone server, declared once.

From `OPTIONS` come the launcher's flags (tritone.launcher.options), the `parameters` of each
model's config.pbtxt (rendered by the launcher in place of the `${parameters}` line), the
parsing of those parameters in the models, and `EngineConfig`, the engine's one configuration
object, validated at construction and passed whole. Adding an option is one `Option(...)` here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

# The models whose config.pbtxt carries an option (`Option.models`).
ENGINE_MODELS = ("llm", "llm_inline")
TEXT_MODELS = ("preprocessing", "llm_inline")


@dataclass(frozen=True, slots=True)
class Option:
    """One option: an `EngineConfig` field (where `engine`), a parameter of `models`, and the
    launcher's `--name-with-dashes` flag (or `flag`)."""

    name: str
    type: type
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    minimum: int | float | None = None
    models: tuple[str, ...] = ENGINE_MODELS
    engine: bool = True
    # The launcher's flag where it is not --name-with-dashes (a bool whose default is true is
    # turned off by its flag).
    flag: str | None = None
    # A check that choices and minimum cannot say: returns the problem, or None.
    check: Callable[[Any], str | None] | None = None

    @property
    def flag_name(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    def parse(self, raw: str) -> Any:
        """The value of a model parameter's string (ValueError naming the option)."""
        try:
            if self.type is bool:
                lowered = raw.strip().lower()
                if lowered not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(f"expected a boolean, got {raw!r}")
                return lowered in ("true", "1", "yes")
            return self.type(raw)
        except ValueError as exc:
            raise ValueError(f"{self.name}: {exc}") from None

    def format(self, value: Any) -> str:
        """The model parameter's string for `value` (parse's inverse)."""
        return str(value).lower() if self.type is bool else str(value)

    def validate(self, value: Any) -> None:
        if self.choices and value not in self.choices:
            raise ValueError(f"{self.name} must be {', '.join(self.choices[:-1])} or {self.choices[-1]}, "
                             f"got {value!r}")
        if self.minimum is not None and value < self.minimum:
            raise ValueError(f"{self.name} must be {'positive' if self.minimum == 1 else f'>= {self.minimum}'}, "
                             f"got {value}")
        problem = self.check(value) if self.check is not None else None
        if problem is not None:
            raise ValueError(f"{self.name} {problem}, got {value!r}")


def _device_problem(value: str) -> str | None:
    ok = value in ("auto", "cpu", "cuda") or (value.startswith("cuda:") and value[5:].isdigit())
    return None if ok else "must be auto, cpu or cuda[:N]"


def _nice_problem(value: str) -> str | None:
    return None if value == "auto" or (value.isdigit() and int(value) <= 19) else "must be auto or 0 to 19"


def text_nice(value: str, pipeline: str) -> int:
    """--text-nice as a number for the served `pipeline` ("inline" or "ensemble"). auto: 19 where
    the text work runs in the engine's process, 10 beside the ensemble's three processes, whose
    flow control takes a chunk unread for a quarter of a second for a lost stream: 19 nicer,
    tritonserver and postprocessing waited longer than that for a core under load, and vllm bench
    serve at concurrency 128 on 2 cores lost 2,575 of 32,768 tokens to streams ended that way."""
    if value != "auto":
        return int(value)
    return 19 if pipeline == "inline" else 10


def _fraction_problem(value: float) -> str | None:
    return None if 0.0 < value <= 1.0 else "must be in (0, 1]"


def parse_lora_modules(text: str) -> list[tuple[str, str]]:
    """`name=path,name=path` (--lora-modules) as (name, path) pairs, in order: adapter i (from 1)
    is the i-th. ValueError for a malformed or repeated entry."""
    modules = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, path = item.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"expected name=path, got {item!r}")
        modules.append((name.strip(), path.strip()))
    names = [name for name, _ in modules]
    if len(set(names)) != len(names):
        raise ValueError("names an adapter twice")
    return modules


def _lora_modules_problem(value: str) -> str | None:
    try:
        parse_lora_modules(value)
    except ValueError as exc:
        return str(exc)
    return None


OPTIONS: tuple[Option, ...] = (
    Option("device", str, "auto", "auto, cpu or cuda[:N]", check=_device_problem),
    Option("dtype", str, "auto", "auto (measured per machine), float32, bfloat16 or float16",
           choices=("auto", "float32", "bfloat16", "float16")),
    Option("max_num_seqs", int, 256, "most requests in the running batch", minimum=1),
    Option("max_num_batched_tokens", int, 512,
           "tokens computed per step, decodes plus prompt chunks: bounds a step's latency", minimum=1),
    Option("max_model_len", int, 0, "longest sequence, prompt plus output, in tokens (0: the model's own limit, "
           "max_position_embeddings)", minimum=0, models=ENGINE_MODELS + ("preprocessing",)),
    Option("block_size", int, 16, "tokens per KV cache block", minimum=1),
    Option("kv_cache_bytes", int, 0, "KV cache budget in bytes, the server's in all (0: --kv-cache-fraction)",
           minimum=0),
    Option("kv_cache_fraction", float, 0.25,
           "share of the available RAM the KV cache takes on a CPU when --kv-cache-bytes is 0",
           check=_fraction_problem),
    Option("gpu_memory_utilization", float, 0.9,
           "share of a GPU's total memory the server may hold: the KV cache gets what the weights and a profiled "
           "step at --max-num-batched-tokens leave of it (when --kv-cache-bytes is 0)", check=_fraction_problem),
    Option("load_format", str, "auto", "auto: the checkpoint's safetensors; dummy: seeded random weights of the "
           "checkpoint's shape, nothing read (for measuring a model shape from its config.json alone)",
           choices=("auto", "dummy")),
    Option("enable_prefix_caching", bool, True,
           "reuse the KV of a prompt prefix computed for an earlier request", flag="--no-prefix-caching"),
    Option("seed", int, 0, "seed of the seeds drawn for requests that give none", minimum=0),
    Option("max_queue_len", int, 1024, "waiting requests beyond this get 'server busy' (0: no limit)", minimum=0),
    # Every core by default, though the text stages share them: served on 2 cores, the model on
    # both made more tokens/s than the model on one with the other left to the text stages.
    Option("num_threads", int, 0, "CPU threads for the model (0: every core)", minimum=0),
    # Served on 2 cores, tritonserver and the engine's response sender 10 nicer than the forward's
    # threads: 775 against 702 tok/s at concurrency 32 (eight alternated windows each); either alone
    # changed nothing. 19 nicer (inline), the text work falls further behind under load and each
    # response carries more tokens, while every response costs tritonserver, tritone-openai and the
    # client the same CPU: vllm bench serve, servers restarted in turn, 690-727 against 604-615
    # tok/s at 32 and 694-741 against 596-641 at 128, for inter-token gaps 2.5-3x as long
    # (docs/performance-log.md, 2026-12-07).
    Option("text_nice", str, "auto", "where the engine runs on the CPU, how much nicer (0 to 19) the server's text "
           "work runs than the engine's forward threads: tritonserver, tritone-openai, the text models' processes "
           "and the engine's response sender (auto: 19 with the inline pipeline, 10 with the ensemble's three "
           "processes; 0: the same priority)", check=_nice_problem),
    Option("compile", str, "auto", "torch.compile the torch forward on CPU (auto: where a C++ compiler is present "
           "and the compiled forward passes the start-up check); the first start compiles, later ones load the cache",
           choices=("auto", "on", "off")),
    Option("forward", str, "auto", "native: Tritone's Llama-family model in one native call per step; torch: the "
           "model's torch modules (compiled per --compile); auto: native where it can run, is fastest and passes "
           "the start-up check", choices=("auto", "native", "torch")),
    Option("gemm", str, "auto", "GEMM kernel of the linears on CPU: auto (for each weight shape, the fastest here of "
           "those that pass the start-up check), or one of them: tritone (AVX2/AVX512-BF16), amx (AMX tiles), "
           "onednn, mm (torch's, on blocks of 32 rows)", choices=("auto", "tritone", "amx", "onednn", "mm")),
    Option("attention", str, "auto", "paged attention kernel (auto: on CPU the faster here of the native kernel and, "
           "where the CPU has AMX, its AMX form cpu-amx, each checked against SDPA at start; on CUDA the first of "
           "flash-varlen and triton that agrees with SDPA on a probe batch at start)",
           choices=("auto", "cpu-native", "cpu-amx", "flash-varlen", "triton", "sdpa")),
    Option("cuda_graphs", str, "auto", "replay decode steps from CUDA graphs captured at start (auto: on CUDA where "
           "the model and attention allow; off: every step eager)", choices=("auto", "off")),
    Option("async_scheduling", str, "auto", "schedule and prepare step N+1 while the device computes step N (auto: "
           "on CUDA, where the device runs asynchronously)", choices=("auto", "on", "off")),
    Option("tensor_parallel_size", int, 1, "split the model over this many ranks, each a worker process: GPUs, or "
           "equal slices of the CPU cores (Llama-family models; heads split by KV head)", minimum=1),
    Option("data_parallel_size", int, 1, "run this many independent engines behind the one llm model, each request "
           "sent to the one holding its prompt's prefix or with the most free KV cache", minimum=1),
    Option("lora_modules", str, "", "LoRA adapters to serve beside the base model, PEFT checkpoints as "
           "name=path,name=path: a request picks one by the OpenAI model name or the ensemble's lora_task_id "
           "(its place in this list, from 1; 0 or none: the base model)", check=_lora_modules_problem),
    Option("max_loras", int, 4, "adapter slots: the most --lora-modules (each step computes every slot's "
           "low-rank product, so fewer is faster)", minimum=1),
    Option("max_lora_rank", int, 16, "largest LoRA rank accepted", minimum=1),
    # Options of the text stages, which the engine does not read.
    Option("stream_interval", int, 1, "tokens per streamed response, except the first and the last (1: every "
           "token); larger values send fewer responses, each with more text", minimum=1, engine=False),
    Option("max_input_len", int, 0, "longest prompt accepted, in tokens (0: --max-model-len)", minimum=0,
           models=TEXT_MODELS, engine=False),
    Option("max_input_bytes", int, 1 << 20, "longest text_input or messages accepted, in bytes, checked before "
           "tokenizing", minimum=1, models=TEXT_MODELS, engine=False),
    Option("chat_template", str, "auto", "auto: wrap text_input in the model's chat template when it has one",
           choices=("auto", "never"), models=TEXT_MODELS, engine=False),
)
OPTIONS_BY_NAME = {option.name: option for option in OPTIONS}


def is_set(value: str | None) -> bool:
    """An unfilled `${template}` or empty parameter counts as unset."""
    return bool(value) and not value.startswith("${")


def parameter(params: dict[str, str], name: str) -> Any:
    """Option `name` as a model's parameters give it (its default where unset), validated."""
    option = OPTIONS_BY_NAME[name]
    raw = params.get(name)
    value = option.parse(raw) if is_set(raw) else option.default
    option.validate(value)
    return value


def model_parameters_text(model: str, values: dict[str, Any]) -> str:
    """The config.pbtxt `parameters` lines of `model`: each option it reads, from `values`."""
    return "\n".join(f'parameters {{ key: "{o.name}" value: {{ string_value: "{o.format(values[o.name])}" }} }}'
                     for o in OPTIONS if model in o.models)


def _post_init(self) -> None:
    for option in OPTIONS:
        if option.engine:
            option.validate(getattr(self, option.name))


def _from_parameters(cls, model: str, params: dict[str, str]):
    """A config from a model's parameters (Triton model config); unset ones keep their default."""
    return cls(model=model, **{o.name: parameter(params, o.name) for o in OPTIONS if o.engine})


# The model directory, then every engine option with its declared default.
EngineConfig = dataclasses.make_dataclass(
    "EngineConfig",
    [("model", str)] + [(o.name, o.type, dataclasses.field(default=o.default)) for o in OPTIONS if o.engine],
    namespace={"__post_init__": _post_init, "from_parameters": classmethod(_from_parameters),
               "__doc__": "The engine's configuration: `model` (a Hugging Face directory) and every engine "
                          "option of `OPTIONS`, each validated at construction."},
    slots=True)
EngineConfig.__module__ = __name__  # pickled by reference, as a class written here would be
