#!/usr/bin/env bash
# The one device script: build, GPU tests, compute-sanitizer, benchmarks; logs into OUT_DIR.
#
#   [TK_OPS_COMMIT=SHA TK_OPS_DIRTY=0|1] benchmarks/gpu_session.sh OUT_DIR [PART ...]
#
# PARTS (default: build tests sanitize bench:gemm), run in the order given:
#   build          cold in-place build of tk_ops._C with every core (prints the time)
#   build:warm     incremental build (after an edit, on a machine that is still warm)
#   build:baseline cold in-place build of the baseline tree .ab/baseline (made by benchmarks/ab_prepare.sh)
#   tests[=ARGS]   pytest -m gpu over tests/ (or over ARGS, e.g. tests=tests/test_matmul.py, or
#                  tests=@ids.txt: the test ids in a file) in TESTS_WORKERS xdist processes (default 8;
#                  0: one); stopped after TESTS_TIMEOUT seconds (default 420); every outcome in tests.log
#   sanitize[=F,..] memcheck, racecheck and synccheck over each kernel family's `bench_* --check` run
#                  (benchmarks/families.py): those with kernels in this build, or those named
#   profile[=F,..] Nsight Compute sections of each family's profile cases (benchmarks/profile_kernels.py);
#                  F may also name single cases (benchmarks/families.py)
#   apply:PATCH    apply the patch file PATCH to this copy only, to measure a variant (then build:warm)
#   bench:NAME[@baseline][=A,B]  python3 -m benchmarks.bench_NAME --out results/TREE-K [A B], TREE new
#                  or baseline (the baseline tree's own bench_NAME on its own tk_ops), K the how-many-th
#                  run of NAME on that tree in this call. Every comma splits: a value that holds commas
#                  goes as a repeated flag where the bench appends (bench:training=--variants,tk-compile,
#                  --variants,reference-compile), not as one comma-separated value
#   compare:NAME   benchmarks/compare_results.py over the pairs (results/baseline-K, results/new-K) of
#                  NAME.json so far in this call: new/old time per row, and each side's run-to-run spread
#   tune:NAME      python3 -m benchmarks.tune_NAME (compares candidate tile plans)
#   sass           HGMMA / UTMALDG / spill counts of the built kernels
#   fa4            nothing more than the FA4 setup every call makes (below): a call that only brings
#                  .fa4/a, or says whether FA4 is installed
# Run from the repository root. At most 8 files come back from OUT_DIR: one log per kind of part (every
# bench in bench.log, every tuning in tune.log, so that tests.log and sanitize.log are never crowded out), and
# OUT_DIR/results.tar.gz, the folder results/ of every JSON and plot the benches wrote, packed again
# after each bench (the folder itself lies outside OUT_DIR, so a call cut short still brings it back).
# The device copy has no .git: pass the tree's commit and dirty flag as TK_OPS_COMMIT / TK_OPS_DIRTY
# for the results files (benchmarks/common.py environment()); the baseline's comes from .ab/baseline/COMMIT.
#
# Peer packages, downloaded on this side (the device has no network) into ignored folders and named
# in the device call's carry list:
#   .baselines   benchmarks/wheels/baselines.sh: fla-core, liger-kernel, mamba_ssm's Triton SSD
#                (bench_linear_attention, bench_norms, bench_rope, bench_mamba2, bench_training)
#   .fa4         benchmarks/wheels/fa4.sh: FlashAttention-4 (bench_attention's fa4 rows)
# .fa4 comes as two halves, .fa4/a and .fa4/b, each small enough for one device call with the tree.
# Carry .fa4/a in one call and .fa4/b in the next while the machine is still warm. Every call copies
# the halves it finds into /tmp/fa4stage (outside the tree); once both are there it joins the split
# wheel and installs everything into /tmp/fa4site, once (a later call, or a second half carried
# again, finds the install and skips it; a changed stage installs afresh), puts it on PYTHONPATH and
# says whether `flash_attn.cute` imports (env.log, "FA4: ..." lines).
#
# A/B against a commit (run `benchmarks/ab_prepare.sh REV` first, carry .ab): baseline and new runs
# alternate, so that each side's spread shows the noise, e.g.
#   build build:baseline bench:gemm@baseline bench:gemm bench:gemm@baseline bench:gemm compare:gemm
set -o pipefail
OUT=${1:?usage: benchmarks/gpu_session.sh OUT_DIR [PART ...]}
shift
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)  # absolute: the baseline's parts run from .ab/baseline
REPO=$PWD
BASELINE=$REPO/.ab/baseline
RESULTS_ROOT=$(mktemp -d)  # holds results/
trap 'rm -rf "$RESULTS_ROOT"' EXIT
parts=("$@")
[ ${#parts[@]} -eq 0 ] && parts=(build tests sanitize bench:gemm)

# The image's /opt/gcc wrappers make every C++ exception thrown from an extension segfault.
export CC=/usr/bin/gcc CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++
export PYTHONUNBUFFERED=1
# Peer packages for the baselines (Liger, fla, mamba_ssm's Triton SSD), when the call carries
# .baselines (benchmarks/wheels/baselines.sh).
if [ -d .baselines ]; then
  python3 -m pip install -q --no-index --no-deps --upgrade --target /tmp/site .baselines/*.whl > /dev/null 2>&1
  export PYTHONPATH=/tmp/site:$PWD/.baselines/site${PYTHONPATH:+:$PYTHONPATH}
fi
status=0
declare -A runs=()  # TREE-NAME -> how many runs of bench_NAME on that tree so far

# fa4_setup: FlashAttention-4 from the halves of .fa4 (see the header), into FA4_SITE, on PYTHONPATH.
FA4_STAGE=/tmp/fa4stage FA4_SITE=/tmp/fa4site
FA4_JOINED=nvidia_cutlass_dsl_libs_cu13-4.7.0-cp312-cp312-manylinux_2_28_x86_64.whl  # what benchmarks/wheels/fa4.sh split
fa4_setup() {
  local half signature
  for half in a b; do
    if compgen -G ".fa4/$half/*" > /dev/null; then  # this call carried the half (or an earlier one left it)
      rm -rf "$FA4_STAGE/$half" && mkdir -p "$FA4_STAGE" && cp -r ".fa4/$half" "$FA4_STAGE/$half" ||
        { echo "FA4: could not stage .fa4/$half"; return 1; }
    fi
  done
  [ -d "$FA4_STAGE" ] || { echo "FA4: no .fa4 here (not installed; bench_attention runs without fa4 rows)"; return 0; }
  signature=$(cd "$FA4_STAGE" && find . -type f -printf '%p %s\n' | sort | md5sum | cut -c1-32)
  if [ "$(cat "$FA4_SITE/.fa4-stage" 2> /dev/null)" = "$signature" ]; then
    echo "FA4: already installed in $FA4_SITE from these wheels"
  elif [ -f "$FA4_STAGE/a/cu13part.aa" ] && [ -f "$FA4_STAGE/b/cu13part.ab" ]; then
    echo "FA4: joining the two halves and installing into $FA4_SITE"
    rm -rf "$FA4_SITE" "$FA4_SITE.new" /tmp/fa4join && mkdir -p /tmp/fa4join &&
      cat "$FA4_STAGE/a/cu13part.aa" "$FA4_STAGE/b/cu13part.ab" > "/tmp/fa4join/$FA4_JOINED" &&
      python3 -m pip install -q --no-index --no-deps --no-cache-dir --target "$FA4_SITE.new" \
        "$FA4_STAGE"/a/*.whl $(compgen -G "$FA4_STAGE/b/*.whl") "/tmp/fa4join/$FA4_JOINED" 2>&1 |
        grep -v "^WARNING: Running pip as"
    if [ "${PIPESTATUS[0]}" -ne 0 ] || [ ! -d "$FA4_SITE.new/flash_attn/cute" ]; then
      rm -rf "$FA4_SITE.new"; echo "FA4: install FAILED (bench_attention runs without fa4 rows)"; return 1
    fi
    mv "$FA4_SITE.new" "$FA4_SITE" && echo "$signature" > "$FA4_SITE/.fa4-stage" && rm -rf /tmp/fa4join
  else
    echo "FA4: only half $(ls "$FA4_STAGE" | tr '\n' ' ')is here: carry the other half (.fa4/a or .fa4/b) in the next" \
      "call while this machine is warm; not installed, bench_attention runs without fa4 rows"
    return 0
  fi
  # The .pth of nvidia-cutlass-dsl (dsl_packages on sys.path, for `import cutlass`) is read only in site
  # directories, not on PYTHONPATH: the folder goes on PYTHONPATH itself. Compiled kernels are kept in
  # /tmp/fa4cache, so a later run on this machine does not compile them again.
  export PYTHONPATH=$FA4_SITE:$FA4_SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=${FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED:-1}
  export FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=${FLASH_ATTENTION_CUTE_DSL_CACHE_DIR:-/tmp/fa4cache}
  local imported
  if imported=$(python3 -c "import importlib.metadata as m; from flash_attn.cute import flash_attn_func
print('FA4: imported, flash-attn-4', m.version('flash-attn-4'), '/ nvidia-cutlass-dsl', m.version('nvidia-cutlass-dsl'))" 2>&1)
  then
    echo "$imported" | tail -1
  else
    echo "$imported" | tail -4 | sed 's/^/FA4 import: /'
    echo "FA4: NOT importable (above); bench_attention runs without fa4 rows"
    return 1
  fi
}

section() { printf '\n===== %s =====\n' "$*"; }

# build_tree DIR cold|warm: build tk_ops._C in place in DIR with every core (cold: from scratch).
build_tree() {
  (
    cd "$1" || exit 1
    [ "$2" = cold ] && rm -rf build tk_ops/_C*.so
    start=$(date +%s)
    MAX_JOBS=$(nproc) python3 setup.py build_ext --inplace
    rc=$?
    echo "build of $1 took $(( $(date +%s) - start )) s, exit $rc"
    exit $rc
  )
}

# family_lines checks|profiles PART: benchmarks/families.py's lines for the families named after
# '=' in PART (comma-separated), or for those with kernels in this build.
family_lines() {
  local -a names=()
  [[ "$2" == *=* ]] && IFS=, read -r -a names <<< "${2#*=}"
  python3 -m benchmarks.families "$1" "${names[@]}"
}

pack_results() {
  tar -czf "$OUT/results.tar.gz.part" -C "$RESULTS_ROOT" results && mv "$OUT/results.tar.gz.part" "$OUT/results.tar.gz"
}

baseline_commit() { cat "$BASELINE/COMMIT" 2> /dev/null || echo "missing: run benchmarks/ab_prepare.sh REV and carry .ab"; }

{
  section environment
  date -u
  nvidia-smi
  nvcc --version | tail -2
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  echo "commit: ${TK_OPS_COMMIT:-unknown} dirty: ${TK_OPS_DIRTY:-unknown}"
  [ -d "$BASELINE" ] && echo "baseline (.ab/baseline): $(baseline_commit)"
  echo "parts: ${parts[*]}"
} 2>&1 | tee "$OUT/env.log"
# In this shell (its exports are the benches'), its lines into env.log too.
fa4_setup > /tmp/fa4_setup.log 2>&1 || status=1
{ section "FlashAttention-4"; cat /tmp/fa4_setup.log; } | tee -a "$OUT/env.log"

for part in "${parts[@]}"; do
  case "$part" in
    build | build:warm)
      mode=warm
      [ "$part" = build ] && mode=cold
      { section "$part"; build_tree "$REPO" "$mode"; } 2>&1 | tee -a "$OUT/build.log" || status=1
      ;;
    build:baseline)
      { section "$part: $(baseline_commit)"; build_tree "$BASELINE" cold; } 2>&1 | tee -a "$OUT/build.log" || status=1
      ;;
    tests*)
      selection=tests
      [[ "$part" == tests=* ]] && selection=${part#tests=}
      # TESTS_WORKERS pytest-xdist processes (default 8; 0: one process). The whole GPU suite takes
      # longer than one call even so (CONTRIBUTING.md): a call cut short is continued by test ids
      # (benchmarks/unfinished_tests.py).
      workers=(-n "${TESTS_WORKERS:-8}")
      [ "${TESTS_WORKERS:-8}" = 0 ] && workers=()
      # Verbose, every outcome into tests.log (a run cut short says which tests finished); only the
      # failures and the summary on the console. TESTS_TIMEOUT (seconds, default 420) stops a hang before it takes the whole call.
      part_log=$(mktemp)
      section "pytest -m gpu ${workers[*]} $selection" > "$part_log"
      timeout "${TESTS_TIMEOUT:-420}" python3 -m pytest $selection "${workers[@]}" -m gpu -v --maxfail=30 \
        --durations=15 -p no:cacheprovider >> "$part_log" 2>&1
      code=$?
      echo "pytest exit $code (124: stopped after TESTS_TIMEOUT)" >> "$part_log"
      cat "$part_log" >> "$OUT/tests.log"
      grep -E "FAILED|ERROR|passed|failed|pytest exit" "$part_log" | tail -40
      rm -f "$part_log"
      [ "$code" = 0 ] || status=1
      ;;
    sanitize | sanitize=*)
      # Each family's correctness run (its results against float64) under each tool.
      checks=$(family_lines checks "$part" 2>> "$OUT/sanitize.log") || status=1
      for tool in memcheck racecheck synccheck; do
        while read -r -u 3 -a check; do
          [ ${#check[@]} -gt 0 ] || continue
          { section "compute-sanitizer $tool: ${check[0]}"
            compute-sanitizer --tool "$tool" --error-exitcode 1 python3 -m "${check[@]:1}"; } 2>&1 |
            tee -a "$OUT/sanitize.log" || status=1
        done 3<<< "$checks"
      done
      ;;
    profile | profile=*)
      # Nsight Compute on one call of each case after its warm-up calls; the kernel regexes name the
      # kernel structs, which are template arguments: only the demangled name holds them.
      profiles=$(family_lines profiles "$part" 2>> "$OUT/profile.log") || status=1
      while read -r -u 3 profile_case kernels launch_skip launch_count; do
        [ -n "$profile_case" ] || continue
        { section "ncu $profile_case: $kernels"
          ncu --clock-control none --kernel-name-base demangled -k "regex:$kernels" \
            --launch-skip "$launch_skip" --launch-count "$launch_count" \
            --section SpeedOfLight --section Occupancy --section WarpStateStats --section SchedulerStats \
            --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
            python3 -m benchmarks.profile_kernels "$profile_case"; } 2>&1 | tee -a "$OUT/profile.log" || status=1
      done 3<<< "$profiles"
      ;;
    apply:*)
      patch_file=${part#apply:}
      { section "$part"; git apply --verbose "$patch_file" || patch -p1 --forward < "$patch_file"; } 2>&1 |
        tee -a "$OUT/env.log" || status=1
      ;;
    bench:*)
      spec=${part#bench:}
      extra=()
      [[ "$spec" == *=* ]] && IFS=, read -r -a extra <<< "${spec#*=}" && spec=${spec%%=*}
      name=${spec%@baseline}
      tree=new root=$REPO commit=${TK_OPS_COMMIT:-} dirty=${TK_OPS_DIRTY:-}
      [ "$spec" != "$name" ] && tree=baseline root=$BASELINE commit=$(baseline_commit) dirty=0
      runs[$tree-$name]=$(( ${runs[$tree-$name]:-0} + 1 ))
      results="results/$tree-${runs[$tree-$name]}"
      mkdir -p "$RESULTS_ROOT/$results"
      { section "benchmark $name, $tree run ${runs[$tree-$name]} (${commit:-commit unknown}) -> $results"
        (cd "$root" &&
          PYTHONPATH=$root${PYTHONPATH:+:$PYTHONPATH} TK_OPS_COMMIT=$commit TK_OPS_DIRTY=$dirty \
            python3 -m benchmarks.bench_"$name" --out "$RESULTS_ROOT/$results" "${extra[@]}"); } 2>&1 |
        tee -a "$OUT/bench.log" || status=1
      pack_results || status=1
      ;;
    compare:*)
      name=${part#compare:}
      pairs=()
      for (( k = 1; ; k++ )); do
        [ -f "$RESULTS_ROOT/results/baseline-$k/$name.json" ] && [ -f "$RESULTS_ROOT/results/new-$k/$name.json" ] || break
        pairs+=("results/baseline-$k/$name.json" "results/new-$k/$name.json")
      done
      { section "compare $name: baseline $(baseline_commit) (old) vs this tree ${TK_OPS_COMMIT:-} (new)"
        [ ${#pairs[@]} -gt 0 ] || { echo "no pair of runs of bench:$name@baseline and bench:$name in this call"; exit 1; }
        (cd "$RESULTS_ROOT" && PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH} python3 -m benchmarks.compare_results "${pairs[@]}"); } 2>&1 |
        tee -a "$OUT/compare.log" || status=1
      ;;
    tune:*)
      name=${part#tune:}
      { section "tuning $name"; python3 -m benchmarks.tune_"$name"; } 2>&1 | tee -a "$OUT/tune.log" || status=1
      ;;
    sass)
      { section "SASS of tk_ops._C"
        for so in tk_ops/_C*.so; do
          cuobjdump --dump-sass "$so" > /tmp/tk_sass.txt
          for op in HGMMA UTMALDG UTMASTG STSM LDL STL; do echo "$op: $(grep -c "$op" /tmp/tk_sass.txt)"; done
        done; } 2>&1 | tee -a "$OUT/sass.log" || status=1
      ;;
    fa4) ;;  # the setup above is all
    *) echo "unknown part: $part" | tee -a "$OUT/env.log"; status=1 ;;
  esac
done
echo "gpu_session: exit $status"
exit $status
