# Sourced after setup.sh by the scripts that run perf_analyzer (perf_analyzer, genai_perf,
# bench_suite): the perf_analyzer 2.51 binary of the tritonclient==2.51.0 wheel needs
# libb64.so.0d and libcudart.so.12, which the nvidia-pytriton wheel in the project's environment
# holds under hashed names, so links under the expected names suffice. Sets
# TRITONE_PERF_ANALYZER_LIBS to their folder (where it is already set, or the environment's
# perf-analyzer-libs).
libs=${TRITONE_PERF_ANALYZER_LIBS:-$VENV/perf-analyzer-libs}
mkdir -p "$libs"
wheel_libs=$("$VENV/bin/python" -c 'import pathlib, pytriton; print(pathlib.Path(pytriton.__file__).parents[1] / "nvidia_pytriton.libs")')
for pair in "libb64-*.so.0d libb64.so.0d" "libcudart-*.so.12* libcudart.so.12"; do
  read -r pattern name <<< "$pair"
  found=$(ls "$wheel_libs"/$pattern 2>/dev/null | head -n 1 || true)
  if [ -z "$found" ]; then
    echo "error: no $pattern in $wheel_libs; reinstall nvidia-pytriton (rm -rf $VENV, then scripts/serve)" >&2
    exit 1
  fi
  ln -sf "$found" "$libs/$name"
done
export TRITONE_PERF_ANALYZER_LIBS="$libs"
