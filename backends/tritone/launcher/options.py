"""The launcher's command line: its own options (addresses, processes, keys), then one flag per
option of tritone.config.OPTIONS, each with the declaration's type, default, choices and help."""

from __future__ import annotations

import argparse
import pathlib

from tritone.config import OPTIONS, Option

# Triton's administrative APIs, which no client of a model needs: registering shared memory
# (any region, the Python backend's own included: NVIDIA's CVE-2025-23319/23320/23334 chain),
# the repository, logging, trace and statistics. They answer only requests that carry this
# header with the admin key (--admin-key); health, metadata, model config and inference stay open.
RESTRICTED_APIS = "shared-memory,model-repository,logging,trace,statistics"
ADMIN_HEADER = "tritone-admin-key"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="scripts/serve", description="Serve a model with Tritone on tritonserver.")
    p.add_argument("--model", help="local Hugging Face causal-LM directory (default: SmolLM2-135M-Instruct, prepared once)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind HTTP and gRPC to (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=8000,
                   help="tritonserver's HTTP port (KServe v2, `generate`, `generate_stream`)")
    p.add_argument("--grpc-port", type=int, default=8001, help="tritonserver's gRPC port")
    p.add_argument("--metrics-port", type=int, default=8002,
                   help="tritonserver's Prometheus metrics port (`/metrics`, with the engine's `tritone_*` metrics)")
    p.add_argument("--preprocessing-instances", type=int, default=2, help="processes of the tokenizer model")
    # One: under the dynamic batcher one instance takes every waiting chunk in one execute, and a
    # second only splits the batches (default model, 2 cores: text path 0.46-0.52 -> 0.41-0.46 ms
    # of CPU per token at concurrency 32 and 128). More where the text path falls behind.
    p.add_argument("--postprocessing-instances", type=int, default=1,
                   help="processes of the detokenizer model (more where the text path falls behind)")
    p.add_argument("--exit-timeout", type=int, default=30,
                   help="seconds in-flight requests get to finish on shutdown, while new ones are refused")
    p.add_argument("--pipeline", default="auto", choices=["auto", "ensemble", "inline"],
                   help="where the text work runs: ensemble (preprocessing and postprocessing models in processes "
                        "of their own, chained to the engine by Triton's ensemble), inline (tokenizer and "
                        "detokenizer in the engine's process, the model llm_inline served under the name "
                        "ensemble, same inputs and outputs), auto (default): inline where the engine runs on the "
                        "CPU, whose cores the text processes and their messages would take from it, the ensemble "
                        "on a GPU")
    p.add_argument("--openai-port", type=int, default=9000,
                   help="port of tritone-openai, the OpenAI-compatible API on --host (default 9000; 0: off)")
    p.add_argument("--api-key", default=None,
                   help="key tritone-openai requires as 'Authorization: Bearer KEY' (default: $TRITONE_API_KEY; "
                        "none: open)")
    p.add_argument("--admin-key", default=None,
                   help=f"key of Triton's administrative APIs ({RESTRICTED_APIS}), sent as the header "
                        f"'{ADMIN_HEADER}: KEY' (default: $TRITONE_ADMIN_KEY; none: a random one, so closed)")
    p.add_argument("--max-body-bytes", type=int, default=0,
                   help="largest request body tritone-openai reads (default 0: 4 x --max-input-bytes)")
    p.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "llama3_json"],
                   help="the model's tool-call syntax for tritone-openai (default auto: from the chat template; "
                        "hermes where it names none)")
    p.add_argument("--reasoning-parser", default=None, choices=["deepseek_r1", "qwen3"],
                   help="the model's thinking syntax: tritone-openai's chat answers then carry the thinking as "
                        "reasoning_content apart from the content (default none: off)")
    p.add_argument("--malloc", default="auto",
                   help="memory allocator of tritonserver and its model processes, preloaded: auto (the first "
                        "found of mimalloc, jemalloc, tcmalloc; else the C library's), mimalloc, jemalloc, "
                        "tcmalloc, system (the C library's), or a library's path")
    p.add_argument("--log-verbose", type=int, default=0, help="tritonserver's --log-verbose level")
    models = p.add_argument_group("engine and text options (passed to the models)")
    for option in OPTIONS:
        _add_option(models, option)
    return p


def _add_option(group, option: Option) -> None:
    if option.type is bool:
        # A flag turns on what is off by default, or off what is on.
        group.add_argument(option.flag_name, dest=option.name, action="store_false" if option.default else "store_true",
                           help=f"do not {option.help}" if option.default else option.help)
        return
    group.add_argument(option.flag_name, dest=option.name, type=option.type, default=option.default,
                       choices=list(option.choices) or None, help=f"{option.help} (default {option.default})")


def resolve_pipeline(args) -> str:
    """`--pipeline` as served: auto is inline where the engine's device is the CPU. On a 2-core
    Xeon with AMX, the default model, our client, concurrency 32 / 128: 612 / 720 tok/s through the
    ensemble, 762 / 782 inline (docs/performance-log.md, 2026-12-06); a token's trip through
    tritonserver to postprocessing and back costs CPU the engine's threads wait for."""
    pipeline = getattr(args, "pipeline", "auto")
    if pipeline != "auto":
        return pipeline
    return "inline" if engine_on_cpu(args) else "ensemble"


def engine_on_cpu(args) -> bool:
    """Whether the engine's device (--device, auto: a GPU where there is one) is the CPU."""
    device = getattr(args, "device", "auto")
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device == "cpu"


def template_values(args, model_dir: pathlib.Path) -> dict[str, object]:
    """What the model repository's templates are filled with: every option's value, the model's
    directory and the instance counts (the launcher adds the paths it makes for each start)."""
    return {**{option.name: getattr(args, option.name) for option in OPTIONS},
            "model_dir": str(model_dir),
            "preprocessing_instances": args.preprocessing_instances,
            "postprocessing_instances": args.postprocessing_instances}
