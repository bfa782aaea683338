#!/usr/bin/env bash
# Downloads into .whl/ the Python packages a GPU host without registry access lacks, for
# Python 3.12 x86-64: what the core test suite, the WIDE runs and the kernel benchmark need beyond
# the host's own torch/transformers/triton stack. Run where a registry is reachable, then copy .whl/
# to the host beside the tree (.gitignore keeps it out of git).
set -euo pipefail
cd "$(dirname "$0")/../.."
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
