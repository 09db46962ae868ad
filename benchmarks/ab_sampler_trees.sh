#!/usr/bin/env bash
# The device sampler's figures for several git revisions in one device call (a lease is short and starting one costs
# minutes, so every tree runs in the same call, on the same GPU).
#
#   benchmarks/ab_sampler_trees.sh prepare main 'exp/x:t=1 top_p 0.95;t=3 top_p 0.95'   # here: build/ab/<rev> trees
#   benchmarks/ab_sampler_trees.sh run [--tests[=TREE]] [SETTING ...]    # on the GPU (device tool, carry build/ab)
#
# `prepare` writes each revision's tree (git archive); `REV:S1;S2` times only those settings on that tree (a branch
# that changes one kernel needs only the settings that run it, and every setting costs its kernels' compilation).
# `run` times every tree under build/ab in the order `prepare` wrote them (bench_sampler.py --device --profile, R=256,
# vocab 200,064; default: the tree's settings, else the issue's settings and t=3 top_p; SETTING ... overrides both),
# writes $OUT/bench_<tree>.txt (or build/ab/out without $OUT), prints the GPU-busy lines, and with --tests then runs
# tests/ops/test_sampling_gpu.py on the working tree (--tests=TREE: on build/ab/TREE).
set -euo pipefail
cd "$(dirname "$0")/.."
root=build/ab
case "${1:-}" in
  prepare)
    shift
    rm -rf "$root" && mkdir -p "$root"
    for arg in "$@"; do
      rev=${arg%%:*}
      focus=""
      if [ "$rev" != "$arg" ]; then focus=${arg#*:}; fi
      name=${rev//\//_}
      mkdir -p "$root/$name"
      git archive "$rev" fastdeploy_ext benchmarks tests pytest.ini | tar -x -C "$root/$name"
      printf '%s\t%s\n' "$name" "$focus" >> "$root/order"
      echo "$root/$name: $(git rev-parse --short "$rev")${focus:+ ($focus)}"
    done
    ;;
  run)
    shift
    tests=""
    case "${1:-}" in
      --tests) tests=.; shift ;;
      --tests=*) tests=$root/${1#--tests=}; shift ;;
    esac
    given=("$@")
    all=(greedy "t=1" "t=1 top_p 0.95" "t=3 top_p 0.95" "t=0.7 top_k 50 top_p 0.9" "t=1 rep 1.1 presence 0.5"
         "t=1 logprobs 5" "t=1 JSON-schema mask")
    out=${OUT:-$root/out}
    mkdir -p "$out"
    out=$(cd "$out" && pwd)  # the trees run from their own folders
    nvidia-smi --query-gpu=name --format=csv,noheader || true
    while IFS=$'\t' read -r name focus; do
      if [ ${#given[@]} -gt 0 ]; then settings=("${given[@]}")
      elif [ -n "$focus" ]; then IFS=';' read -r -a settings <<< "$focus"
      else settings=("${all[@]}"); fi
      echo "=== $name $(date +%T)"
      (cd "$root/$name" && PYTHONPATH=. timeout 170 python benchmarks/bench_sampler.py --device --profile --rows 256 \
        --vocab 200064 --settings "${settings[@]}" > "$out/bench_$name.txt" 2>&1) || echo "$name: exit $?"
      grep -h "GPU busy" "$out/bench_$name.txt" | cut -c1-200 || true
    done < "$root/order"
    if [ -n "$tests" ]; then
      echo "=== tests in $tests $(date +%T)"
      (cd "$tests" && PYTHONPATH=. timeout 300 python -m pytest -q -p no:cacheprovider tests/ops/test_sampling_gpu.py \
        > "$out/tests.txt" 2>&1) || echo "tests: exit $?"
      tail -3 "$out/tests.txt"
    fi
    ;;
  *)
    sed -n '2,13p' "$0"
    exit 2
    ;;
esac
