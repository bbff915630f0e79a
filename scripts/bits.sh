#!/usr/bin/env bash
# Prints the SHA-256 of the combined output of fixed batches through `moe-ep run`, so two builds
# can be compared byte for byte (a change that must not move a result bit: compare the lists).
#   scripts/bits.sh [MOE_EP_BINARY] [WORK_DIR]
# Defaults: build/bin/moe-ep, a fresh temporary directory. Each batch is saved once (W 2) with
# --save-routing and replayed with --load-routing --save-output at W 1-4 (shared-expert ranks:
# 2-4; TP: 4 ranks as 2 x 2) on both transports. --expert-fn scale keeps the experts exact, so
# the hashes depend on moe-ep alone. Exits non-zero if any run fails its own check.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
exe=$(realpath "${1:-$root/build/bin/moe-ep}")
work=${2:-$(mktemp -d)}
mkdir -p "$work"
if [ "$(id -u)" -eq 0 ]; then export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1; fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

special=(--zero-experts 1 --copy-experts 1 --const-experts 1)
int8=(--quant int8 --comm-quant int8)
# name | flags of the saving run (also given to every replay) | world sizes
batches=(
  "shared_mask_int8_special|--shared-experts 1 --mask entries ${int8[*]} ${special[*]}|1 2 3 4"
  "shared_mask_bf16_special|--shared-experts 1 --mask entries ${special[*]}|1 2 3 4"
  "shared_ranks_mask_int8_special|--shared-experts 1 --shared-expert-ranks 1 --mask entries ${int8[*]} ${special[*]}|2 3 4"
  "shared_ranks_prefix_fp16|--shared-experts 1 --shared-expert-ranks 1 --mask prefix --dtype fp16|2 4"
  "tp2_mask_int8|--tp 2 --experts 2 --top-k 2 --mask entries --quant int8|4"
)
for b in "${batches[@]}"; do
  IFS='|' read -r name flags worlds <<<"$b"
  # shellcheck disable=SC2086
  read -r -a f <<<"$flags"
  save_np=2
  [[ " ${f[*]} " == *" --tp 2 "* ]] && save_np=4
  mpirun -n $save_np --oversubscribe "$exe" run --expert-fn scale --tokens 24 --hidden 256 \
    "${f[@]}" --save-routing "$work/$name.in.safetensors" >"$work/$name.save.log" 2>&1 ||
    { cat "$work/$name.save.log"; exit 1; }
  # The replay takes the batch's own flags except those the file fixes (mask, dtype, tokens).
  replay=()
  skip=0
  for a in "${f[@]}"; do
    if ((skip)); then skip=0; continue; fi
    case $a in --mask | --dtype) skip=1; continue ;; esac
    replay+=("$a")
  done
  for n in $worlds; do
    for t in shm mpi; do
      out="$work/$name.np$n.$t.safetensors"
      mpirun -n "$n" --oversubscribe "$exe" run --expert-fn scale --hidden 256 "${replay[@]}" \
        --transport "$t" --load-routing "$work/$name.in.safetensors" --save-output "$out" \
        >"$out.log" 2>&1 || { cat "$out.log"; exit 1; }
      echo "$(sha256sum <"$out" | cut -c1-16)  $name np$n $t"
    done
  done
done
