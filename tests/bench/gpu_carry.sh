#!/usr/bin/env bash
# Constrained decoding's cost on a lent GPU (docs/benchmarks.md, "Constrained decoding with a
# 151,936-token vocabulary"): the device machine has no package index and takes at most 64 MiB
# a call, and MLX's CUDA wheel is 90 MB, so the wheels go in three carried folders, each call
# made while the machine is still warm (30 s), and are installed by the third.
#
#   here:   bash tests/bench/gpu_carry.sh prepare TOKENIZER_DIR   # .gpuwhl/{a,b,c}
#           echo /.gpuwhl/ >> .git/info/exclude
#   device: call 1, carry .gpuwhl/a:  bash tests/bench/gpu_carry.sh a
#           call 2, carry .gpuwhl/b:  bash tests/bench/gpu_carry.sh b
#           call 3, carry .gpuwhl/c:  bash tests/bench/gpu_carry.sh run
#           (TOKEN_READ=0 skips tests.bench.token_read; STREAMS="8": the serve bench at 8 only)
#           or, call 3: bash tests/bench/gpu_carry.sh compare   # docs/benchmarks.md's GPU section:
#           bench against mlx-lm, 3 alternated rounds, the 2,048-vocabulary 8B-shaped model
#           or, call 3: bash tests/bench/gpu_carry.sh split     # issue 53: a CUDA rank prefills,
#           a CPU rank decodes (tests/bench/handoff_gpu.py; PROMPT=32768 REPEAT=2 SMALL=1). Its CPU rank
#           wants OpenBLAS: `prepare` packs this machine's (Debian's libopenblas0-pthread) into c
#
# TOKENIZER_DIR: a model folder whose tokenizer.json has the vocabulary to measure (made by
# `python -m tests.bench.constrained_bench --vocab 151936 ...`, or make_bench_model).
set -euo pipefail
here() {  # the carried wheels installed under /tmp/site, an mlx-cluster command on PATH
  if [ ! -d /tmp/site/mlx ]; then
    cp .gpuwhl/c/part.ac /tmp/w/
    cat /tmp/w/part.aa /tmp/w/part.ab /tmp/w/part.ac \
      > /tmp/w/mlx_cuda_13-0.32.4-py3-none-manylinux_2_35_x86_64.whl
    rm /tmp/w/part.*
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target /tmp/site /tmp/w/*.whl
  fi
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
  mkdir -p /tmp/bin
  printf '#!/bin/sh\nexec python3 -c "import sys; sys.argv[0] = %s; from cluster.commands import main; main()" "$@"\n' "'mlx-cluster'" > /tmp/bin/mlx-cluster
  chmod +x /tmp/bin/mlx-cluster
  export PATH=/tmp/bin:$PATH
}

case "${1:-}" in
prepare)
  tok=$2; w=$(mktemp -d)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_35_x86_64 --platform manylinux_2_31_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$w" mlx==0.32.4 mlx-cuda-13==0.32.4 mlx-lm==0.32.2 \
    llguidance==1.9.1 paramiko bcrypt pynacl cryptography cffi pycparser invoke \
    prometheus-client
  rm -rf .gpuwhl && mkdir -p .gpuwhl/a .gpuwhl/b/tok .gpuwhl/c
  split -b 30000000 "$w"/mlx_cuda_13-*.whl "$w"/part.
  mv "$w"/part.aa .gpuwhl/a/ && mv "$w"/part.ab .gpuwhl/b/ && mv "$w"/part.ac .gpuwhl/c/
  rm "$w"/mlx_cuda_13-*.whl && mv "$w"/*.whl .gpuwhl/a/
  cp "$tok"/tokenizer.json "$tok"/tokenizer_config.json .gpuwhl/b/tok/
  b=$(mktemp -d) && cp -L /usr/lib/x86_64-linux-gnu/libopenblas.so.0 \
    /lib/x86_64-linux-gnu/libgfortran.so.5 /lib/x86_64-linux-gnu/libquadmath.so.0 "$b"/
  tar cJf .gpuwhl/c/blas.tar.xz -C "$b" . ;;
a) mkdir -p /tmp/w && cp .gpuwhl/a/* /tmp/w/ ;;
b) cp .gpuwhl/b/part.ab /tmp/w/ && mkdir -p /tmp/tok && cp .gpuwhl/b/tok/* /tmp/tok/ ;;
run)
  here
  python3 -c "from pathlib import Path; from tests.bench.gpu import make_8b
make_8b(Path('/tmp/m8b'), Path('/tmp/tok'))"
  [ "${TOKEN_READ:-1}" = 0 ] || timeout 170 python3 -m tests.bench.token_read --model /tmp/m8b --streams 8 --tokens 128 --variants free,grammar,grammar-grouped \
    --repeat 3 2>&1 | tee "$OUT/token_read.txt" || true
  for streams in ${STREAMS:-1 8}; do
    timeout 160 python3 -m tests.bench.constrained_bench --model /tmp/m8b --ranks 1 \
      --modes pipeline --streams $streams --repeat 3 --max-tokens 64 2>&1 \
      | tee "$OUT/gpu$streams.txt" || true
  done ;;
compare)  # decode and prefill against mlx-lm by the method's rule: 3 rounds, one bench job each
  here
  python3 -c "from pathlib import Path; from tests.bench.gpu import make_8b
make_8b(Path('/tmp/m8b2k'))"
  for i in 1 2 3; do
    timeout 170 mlx-cluster bench --model /tmp/m8b2k --ranks 1 --baselines mlx-lm \
      --prompt-tokens 512 --gen-tokens 128 --repeat 1 --warmup 1 --json "$OUT/r$i.json" \
      >/dev/null 2>"$OUT/r$i.err" || true
    python3 -c "import json, sys
for r in json.load(open(sys.argv[1]))['results']:
    ok = r['status'] == 'ok'
    print('round', sys.argv[2], r['impl'], *(('gen', round(r['generation_tps']['median'], 1),
          'prefill', round(r['prefill_tps']['median'], 1)) if ok else (r['status'], r['reason'])))
" "$OUT/r$i.json" "$i"
  done ;;
split)  # issue 53: the GPU rank prefills, a CPU rank of the same host decodes
  here
  tar xJf .gpuwhl/c/blas.tar.xz -C /tmp/w
  for f in libopenblas.so.0 libgfortran.so.5 libquadmath.so.0; do  # where cluster.core.blas looks
    [ -e /usr/lib/x86_64-linux-gnu/$f ] || cp /tmp/w/$f /usr/lib/x86_64-linux-gnu/ || true
  done
  ls -la /usr/lib/x86_64-linux-gnu/libopenblas.so.0 || true
  nproc; python3 -c "import mlx.core as mx; print(mx.default_device(), mx.cuda.is_available())"
  timeout "${SPLIT_S:-540}" python3 -m tests.bench.handoff_gpu --prompt-tokens "${PROMPT:-32768}" \
    --repeat "${REPEAT:-2}" --log "$OUT/serve.log" ${SMALL:+--small} \
    --settings "${SETTINGS:-cpu,split,gpu}" --warm-tokens "${WARM:-0}" 2>&1 | tee "$OUT/split.txt" \
    || true ;;
*) echo "usage: $0 prepare TOKENIZER_DIR | a | b | run | compare | split" >&2; exit 2 ;;
esac
