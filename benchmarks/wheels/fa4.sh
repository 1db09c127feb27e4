#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4 4.0.0b36: CuTe-DSL kernels with a Hopper path), bench_attention's
# strongest peer, downloaded here for the GPU machine (Python 3.12, no network) with every wheel it
# imports. A device call carries at most 64 MiB and one of those wheels (nvidia-cutlass-dsl-libs-cu13)
# is 88 MB, so the download is laid out as two halves that fit one call each:
#   DIR/a   the first part of that wheel (cu13part.aa) and some of the other wheels
#   DIR/b   its second part (cu13part.ab) and the rest, each wheel going to the emptier half (about
#           49 MiB each, which leaves room for the working tree that travels with the call)
#
#   benchmarks/wheels/fa4.sh [DIR]          DIR defaults to .fa4 (ignored by git)
#
# Then carry DIR/a in one device call and DIR/b in the next while the machine is still warm:
# benchmarks/gpu_session.sh stages each half it finds, joins the two parts into the wheel, installs
# everything into /tmp/fa4site once both are there and puts it on PYTHONPATH (its env.log says whether
# `flash_attn.cute` imports). FA4 takes (B, N, H, D) tensors (`flash_attn.cute.flash_attn_func`) and
# compiles each kernel configuration on its first call.
set -euo pipefail
DIR=${1:-.fa4}
PYTHON=${PYTHON:-python3}
HALF_LIMIT=$((56 * 1024 * 1024))  # of the 64 MiB a call carries, 8 for the working tree
SPLIT_WHEEL=nvidia_cutlass_dsl_libs_cu13-4.7.0-cp312-cp312-manylinux_2_28_x86_64.whl  # gpu_session.sh's FA4_JOINED
GPU_PYTHON=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
            --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: "${GPU_PYTHON[@]}" -d "$work" \
  flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.7.0 nvidia-cutlass-dsl-libs-base==4.7.0 \
  nvidia-cutlass-dsl-libs-core==4.7.0 nvidia-cutlass-dsl-libs-cu13==4.7.0 quack-kernels==0.6.5 \
  apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 "nvidia-cuda-nvdisasm>=13.3,<14"
[ -f "$work/$SPLIT_WHEEL" ] || { echo "fa4.sh: expected $SPLIT_WHEEL among the downloads" >&2; exit 1; }

rm -rf "$DIR/a" "$DIR/b"
mkdir -p "$DIR/a" "$DIR/b"
size() { stat -c %s "$1"; }
split -n 2 -a 2 "$work/$SPLIT_WHEEL" "$work/cu13part."  # two equal parts: cu13part.aa, cu13part.ab
mv "$work/cu13part.aa" "$DIR/a/"
mv "$work/cu13part.ab" "$DIR/b/"
rm "$work/$SPLIT_WHEEL"
used_a=$(size "$DIR/a/cu13part.aa") used_b=$(size "$DIR/b/cu13part.ab")
for wheel in $(ls -S "$work"/*.whl); do  # largest first, each into the emptier half
  bytes=$(size "$wheel")
  if (( used_a <= used_b )); then
    mv "$wheel" "$DIR/a/" && used_a=$((used_a + bytes))
  else
    mv "$wheel" "$DIR/b/" && used_b=$((used_b + bytes))
  fi
done
if (( used_a > HALF_LIMIT || used_b > HALF_LIMIT )); then
  echo "fa4.sh: a half exceeds $((HALF_LIMIT / 1048576)) MiB; a device call may not carry it with the tree" >&2
  exit 1
fi
ls -l "$DIR/a" "$DIR/b"
echo "$DIR/a: $((used_a / 1048576)) MiB, $DIR/b: $((used_b / 1048576)) MiB; carry $DIR/a, then $DIR/b in the next call"
