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
# status (pair.py's, or 90-94 when a step before it failed); WORK/pipeline.log has every
# step's output.
#
# KEEP_SAMPLING_MINUTES=M (environment, default 0): GPU 0 goes on sampling for M minutes more
# while pair.py trains on the other GPUs (--gpus 1,2,...); give train.py --synthetic-follow so
# the training reads the records appended meanwhile. The sampler is stopped when pair.py ends.
# More variants than training GPUs share them in turn (three runs fit one H200's memory).

main() {
    set -u -f  # -f: GENERATE_ARGS is split into arguments, never expanded as file patterns
    WORK=$1 TEACHER=$2 DATA=$3 SAMPLE_MINUTES=$4 GENERATE_ARGS=$5
    shift 5
    local seed=${SEED:-0} keep=${KEEP_SAMPLING_MINUTES:-0} here code gpus attention=sdpa g status minutes
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
    local first=0 train_gpus=()  # first: the first GPU whose sampler ends before training
    if [[ ! $keep =~ ^[0-9]+(\.[0-9]+)?$ ]]; then
        echo "[pipeline] KEEP_SAMPLING_MINUTES=$keep needs a number of minutes"
        return 94
    fi
    if awk "BEGIN { exit !($keep > 0) }"; then
        first=1
        local variants
        variants=$(count_variants "$@")
        if [ $((gpus - first)) -lt "$variants" ]; then
            echo "[pipeline] KEEP_SAMPLING_MINUTES keeps GPU 0 sampling: $((gpus - first)) GPU(s) left for $variants variant(s)"
            return 94
        fi
    fi
    echo "[pipeline] $(date -u +%T) sampling $SAMPLE_MINUTES min on $gpus GPU(s), attention $attention"
    local pids=()
    for ((g = 0; g < gpus; g++)); do
        minutes=$SAMPLE_MINUTES
        [ $g -lt $first ] && minutes=$(awk "BEGIN { print $SAMPLE_MINUTES + $keep }")
        # shellcheck disable=SC2086  # GENERATE_ARGS is a list of arguments
        CUDA_VISIBLE_DEVICES=$g python3 "$code/tools/train/generate_text.py" --teacher "$TEACHER" \
            --data "$DATA" --out "$WORK/synthetic/synthetic-$g.u16" --minutes "$minutes" \
            --seed $((seed + g)) --attention "$attention" $GENERATE_ARGS >"$WORK/generate-$g.log" 2>&1 &
        pids+=($!)
        [ $g -ge $first ] && train_gpus+=("$g")
    done
    local failed=0
    for ((g = first; g < gpus; g++)); do
        wait "${pids[$g]}" || { echo "[pipeline] sampling on GPU $g failed"; failed=1; }
        tail -n 2 "$WORK/generate-$g.log"
    done
    if [ $failed != 0 ]; then
        stop_samplers "${pids[@]:0:first}"
        return 92
    fi
    local gpu_list variants i
    variants=$(count_variants "$@")
    for ((i = ${#train_gpus[@]}; i < variants; i++)); do  # more variants than GPUs: share them in turn
        train_gpus+=("${train_gpus[$((i % ${#train_gpus[@]}))]}")
    done
    gpu_list=$(IFS=,; echo "${train_gpus[*]}")
    echo "[pipeline] $(date -u +%T) training on GPU(s) $gpu_list"
    python3 "$code/tools/train/pair.py" --teacher "$TEACHER" "$@" --gpus "$gpu_list"
    status=$?
    echo "[pipeline] $(date -u +%T) pair.py exited $status"
    stop_samplers "${pids[@]:0:first}"
    return $status
}

count_variants() {  # how many --variant arguments pair.py gets
    local n=0 arg
    for arg in "$@"; do
        case $arg in --variant | --variant=*) n=$((n + 1)) ;; esac
    done
    echo $n
}

running() { [ -n "$(jobs -rp | grep -x "$1")" ]; }  # a child of this shell, not yet reaped

stop_samplers() {  # PIDS of GPU 0, 1, ...: samplers nothing reads from any more
    local g=0 pid i rc
    for pid in "$@"; do
        if running "$pid"; then
            kill "$pid" 2>/dev/null
            for ((i = 0; i < 60; i++)); do running "$pid" || break; sleep 1; done
            running "$pid" && kill -9 "$pid" 2>/dev/null  # it had a minute to finish its batch
            echo "[pipeline] stopped the sampler on GPU $g, which was still running"
        fi
        wait "$pid" 2>/dev/null
        rc=$?
        [ $rc = 0 ] || echo "[pipeline] the sampler on GPU $g exited $rc"
        tail -n 2 "$WORK/generate-$g.log"
        g=$((g + 1))
    done
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
