#!/usr/bin/env bash
# DeepSpeed ZeRO-2 launch of `trl-agentic train` with a training config of configs/ (docs/distributed.md).
#
#   bash examples/deepspeed_launch.sh cpu [--field value ...]   # 2 CPU processes (DeepSpeed's CPU accelerator, gloo)
#   bash examples/deepspeed_launch.sh gpu [--field value ...]   # one process per GPU, bf16
#
# Arguments after the mode override fields of the training config, e.g. `cpu --max_steps 1`. Environment:
# CONFIG (training config, default configs/tool_rollback.yaml), NUM_GPUS (gpu mode; default: what nvidia-smi lists),
# CPU_CONFIG (where cpu mode writes its accelerate config), DRY_RUN=1 (print the commands without running them).
# Run from the repository root with the project's environment active (`accelerate` on the PATH).
set -euo pipefail

MODE=${1:-cpu}
shift $(($# > 0 ? 1 : 0))
CONFIG=${CONFIG:-configs/tool_rollback.yaml}
export HF_HUB_OFFLINE=${HF_HUB_OFFLINE:-1} # the embedded model needs no Hub access

run() {
  echo "+ $*"
  [[ -n ${DRY_RUN:-} ]] || "$@"
}

case $MODE in
gpu)
  # The shipped config is GPU-ready (bf16, num_processes: 8); set the process count to the GPU count. The training
  # configs of configs/ are CPU demos (`use_cpu: true`): switch them to the GPU on the command line.
  NUM_GPUS=${NUM_GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)}
  [[ $NUM_GPUS -gt 0 ]] || { echo "no GPU found: set NUM_GPUS or use the cpu mode" >&2; exit 1; }
  run accelerate launch --config_file configs/accelerate/zero2.yaml --num_processes "$NUM_GPUS" \
    -m trl_agentic train --config "$CONFIG" --use_cpu false --bf16 true "$@"
  ;;
cpu)
  # A copy of the shipped config with three values changed: use_cpu: true, num_processes: 2, mixed_precision: 'no'.
  # Do NOT pass --cpu to `accelerate launch` instead: it starts ONE process without DeepSpeed. The training config
  # must have `use_cpu: true` (the configs of configs/ do). The first start JIT-compiles DeepSpeed's CPU all-reduce
  # kernel (about two minutes, cached in ~/.cache/torch_extensions).
  CPU_CONFIG=${CPU_CONFIG:-outputs/accelerate/zero2_cpu.yaml}
  mkdir -p "$(dirname "$CPU_CONFIG")"
  sed -e 's/^use_cpu: false$/use_cpu: true/' -e 's/^num_processes: [0-9]*$/num_processes: 2/' \
    -e "s/^mixed_precision: .*$/mixed_precision: 'no'/" configs/accelerate/zero2.yaml >"$CPU_CONFIG"
  grep -q '^use_cpu: true$' "$CPU_CONFIG" && grep -q '^num_processes: 2$' "$CPU_CONFIG" &&
    grep -q "^mixed_precision: 'no'$" "$CPU_CONFIG" || { echo "could not make $CPU_CONFIG" >&2; exit 1; }
  run accelerate launch --config_file "$CPU_CONFIG" -m trl_agentic train --config "$CONFIG" "$@"
  ;;
*)
  echo "usage: $0 cpu|gpu [--field value ...]" >&2
  exit 2
  ;;
esac
