#!/usr/bin/env bash
# The peer libraries the benchmarks compare against, downloaded here for the GPU machine, which has
# Python 3.12 and no network:
#   DIR/*.whl              fla-core 0.6.0 (flash-linear-attention's ops) and liger-kernel 0.8.5
#   DIR/site/mamba_ssm/    the Python files of mamba_ssm 2.3.2's Triton SSD, and nothing else: its CUDA
#                          extensions (selective scan, causal_conv1d) are not needed for
#                          mamba_chunk_scan_combined, and building them would take a GPU toolchain
#
#   benchmarks/wheels/baselines.sh [DIR]          DIR defaults to .baselines (ignored by git)
#
# Then name DIR (about 3 MB) in the device call's carry list. benchmarks/gpu_session.sh installs the
# wheels of .baselines into /tmp/site and puts /tmp/site and .baselines/site on PYTHONPATH; the
# benchmarks import the peers from there (bench_norms, bench_rope: Liger; bench_linear_attention:
# fla; bench_mamba2: mamba_ssm; bench_training's peer models: fla and mamba_ssm) and say in their
# rows when one is missing.
#
# mamba_ssm is published as a source distribution only, whose setup.py imports torch even to report
# its metadata: PYTHON (default python3) must have torch, setuptools, wheel and packaging installed
# (the project's development environment does; nothing is installed into it).
set -euo pipefail
DIR=${1:-.baselines}
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -c "import torch, setuptools, wheel, packaging" 2> /dev/null; then
  echo "baselines.sh: $PYTHON lacks torch, setuptools, wheel or packaging (needed to read mamba_ssm's sdist);" \
    "set PYTHON to an interpreter that has them" >&2
  exit 1
fi
GPU_PYTHON=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
mkdir -p "$DIR/site"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: "${GPU_PYTHON[@]}" -d "$DIR" \
  fla-core==0.6.0 liger-kernel==0.8.5

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
MAMBA_SKIP_CUDA_BUILD=TRUE "$PYTHON" -m pip download -q --no-deps --no-binary=:all: --no-build-isolation \
  -d "$work" mamba-ssm==2.3.2.post1
tar -xzf "$work"/mamba_ssm-*.tar.gz -C "$work"
source_dir=$(echo "$work"/mamba_ssm-*/mamba_ssm)
target="$DIR/site/mamba_ssm"
rm -rf "$target"
mkdir -p "$target/ops/triton" "$target/utils"
# Empty package markers: mamba_ssm's own __init__ files import its CUDA extensions.
touch "$target/__init__.py" "$target/ops/__init__.py" "$target/ops/triton/__init__.py" "$target/utils/__init__.py"
# ssd_combined.py and what it imports.
for module in ssd_bmm ssd_chunk_scan ssd_chunk_state ssd_state_passing ssd_combined layernorm_gated \
  k_activations softplus; do
  cp "$source_dir/ops/triton/$module.py" "$target/ops/triton/"
done
cp "$source_dir/utils/torch.py" "$source_dir/utils/determinism.py" "$target/utils/"
du -sh "$DIR"
ls "$DIR"/*.whl
echo "peer packages ready in $DIR: name it in the device call's carry list"
