#!/usr/bin/env bash
# Sample teacher text on every GPU, then train variants on it with pair.py: one unattended
# pipeline for a machine whose calls are limited to 10 minutes. Started detached (setsid), it
# outlives the call that starts it; later calls only wait for WORK/done and collect.
#
#   sample_and_train.sh WORK TEACHER DATA SAMPLE_MINUTES "GENERATE_ARGS" PAIR_ARGS...
#
# Runs from a copy of tools/train and python/ in WORK/code, so a call that refreshes the
# checkout cannot change code under a running job (the whole script is read before it runs,
# for the same reason). GPU g writes WORK/synthetic/synthetic-g.u16 (generate_text.py
# GENERATE_ARGS --seed SEED+g, SEED from the environment, default 0; the attention path from
# WORK/attention.txt when bench_generate.py wrote one); those files must not exist yet (a
# rerun with the same seeds would append copies of the same records). Then pair.py runs with
# PAIR_ARGS, which name those files in its --common "--synthetic ...". WORK/done gets the exit
# status (pair.py's, or 90-93 when a step before it failed); WORK/pipeline.log has every
# step's output.

main() {
    set -u -f  # -f: GENERATE_ARGS is split into arguments, never expanded as file patterns
    WORK=$1 TEACHER=$2 DATA=$3 SAMPLE_MINUTES=$4 GENERATE_ARGS=$5
    shift 5
    local seed=${SEED:-0} here code gpus attention=sdpa g status
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
    code=$WORK/code
    mkdir -p "$code/tools" "$WORK/synthetic"
    if compgen -G "$WORK/synthetic/synthetic-*.u16" >/dev/null; then
        echo "[pipeline] $WORK/synthetic already holds records: use a fresh WORK"
        return 93
    fi
    mkdir -p "$code/python"  # python/ without model files: export.py needs the format writer only
    cp -r "$here" "$code/tools/" &&
        (cd "$here/../../python" && tar cf - --exclude='*.tinyloop' .) | (cd "$code/python" && tar xf -) ||
        return 90
    export PYTHONUNBUFFERED=1

    [ -s "$WORK/attention.txt" ] && attention=$(cat "$WORK/attention.txt")
    gpus=$(python3 -c "import torch; print(max(1, torch.cuda.device_count()))")  # 1: the CPU
    [[ $gpus =~ ^[0-9]+$ ]] || { echo "[pipeline] cannot count the GPUs: $gpus"; return 91; }
    echo "[pipeline] $(date -u +%T) sampling $SAMPLE_MINUTES min on $gpus GPU(s), attention $attention"
    local pids=()
    for ((g = 0; g < gpus; g++)); do
        # shellcheck disable=SC2086  # GENERATE_ARGS is a list of arguments
        CUDA_VISIBLE_DEVICES=$g python3 "$code/tools/train/generate_text.py" --teacher "$TEACHER" \
            --data "$DATA" --out "$WORK/synthetic/synthetic-$g.u16" --minutes "$SAMPLE_MINUTES" \
            --seed $((seed + g)) --attention "$attention" $GENERATE_ARGS >"$WORK/generate-$g.log" 2>&1 &
        pids+=($!)
    done
    local failed=0
    for g in "${!pids[@]}"; do
        wait "${pids[$g]}" || { echo "[pipeline] sampling on GPU $g failed"; failed=1; }
        tail -n 2 "$WORK/generate-$g.log"
    done
    [ $failed = 0 ] || return 92
    echo "[pipeline] $(date -u +%T) training"
    python3 "$code/tools/train/pair.py" --teacher "$TEACHER" "$@"
    status=$?
    echo "[pipeline] $(date -u +%T) pair.py exited $status"
    return $status
}

finish() {  # WORK/done appears whole, whatever ended the job
    local status=$?
    [ -n "${WORK:-}" ] && echo "$status" >"$WORK/done.tmp" && mv "$WORK/done.tmp" "$WORK/done"
}

if [ $# -lt 5 ]; then
    echo "usage: $0 WORK TEACHER DATA SAMPLE_MINUTES \"GENERATE_ARGS\" PAIR_ARGS..." >&2
    exit 2
fi
rm -f "$1/done"
trap finish EXIT
main "$@"
exit
