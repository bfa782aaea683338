# Sourced by the GPU-host scripts: installs the wheels copied over (.whl) and this tree (core, WIDE, the
# baselines) into /tmp on a GPU host that reaches no registry, and sets the environment.
# (a later command on the same host needs no .whl: what an earlier one installed is still there)
if compgen -G '.whl/*.whl' >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/ck . plugins/wide plugins/baselines
export PYTHONPATH=/tmp/ck:/tmp/site PATH=/tmp/ck/bin:$PATH
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
