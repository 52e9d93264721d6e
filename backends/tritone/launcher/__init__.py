"""The launcher: finds tritonserver (install.py), fills the model repository's templates
(repository.py) from the options (options.py, tritone.config.OPTIONS), and runs and supervises
the server and tritone-openai (server.py). `python -m tritone.launcher --help` lists the options."""

from tritone.launcher.install import MALLOC_LIBRARIES, TritonInstall, find_malloc, find_tritonserver
from tritone.launcher.options import ADMIN_HEADER, RESTRICTED_APIS, build_parser, template_values
from tritone.launcher.repository import ENSEMBLE_MODELS, INLINE_MODELS, model_repository, render_repository
from tritone.launcher.server import Server, temporary_server
from tritone.processes import free_port

__all__ = ["ADMIN_HEADER", "ENSEMBLE_MODELS", "INLINE_MODELS", "MALLOC_LIBRARIES", "RESTRICTED_APIS", "Server",
           "TritonInstall", "build_parser", "find_malloc", "find_tritonserver", "free_port", "model_repository",
           "render_repository", "template_values", "temporary_server"]
