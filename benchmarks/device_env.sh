# Sourced by the device scripts: installs the carried wheels (.whl) and this tree (core, WIDE, the
# baselines) into /tmp on the device machine, which reaches no registry, and sets the environment.
# (a later call on the same warm machine may carry none: what an earlier one installed is still there)
if compgen -G '.whl/*.whl' >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/ck . plugins/wide plugins/baselines
export PYTHONPATH=/tmp/ck:/tmp/site PATH=/tmp/ck/bin:$PATH
export TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
