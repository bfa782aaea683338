#!/usr/bin/env bash
# Downloads into .whl/ the Python packages the device machine lacks (it reaches no registry), for
# Python 3.12 x86-64: what the core test suite, the WIDE runs and the kernel benchmark need beyond
# the device's own torch/transformers/triton stack. Run here (with registry access), then carry
# ".whl" in the device call (.gitignore keeps it out of git; carried paths may be ignored ones).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for pkg in lm-eval==0.4.13 datasets==5.2.0 evaluate==0.4.6 dill multiprocess pytablewriter DataProperty mbstrdecoder \
           pathvalidate tabledata tcolorpy typepy chardet more-itertools stevedore pydantic pydantic-core \
           annotated-types typing-inspection gensim smart-open jsonlines zstandard numexpr rouge-score nltk \
           tqdm-multiprocess absl-py gguf==0.19.0 setuptools==80.9.0 pytest-xdist==3.8.0 execnet==2.1.2; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$pkg"
done
# sdist-only, pure Python: build the wheels here
python3 -m pip wheel -q --no-deps -w .whl sqlitedict word2number
du -sh .whl
