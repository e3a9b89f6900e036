#!/bin/sh
# A stand-in for nvidia-smi on a machine without an NVIDIA driver: prints the recorded answers to the two queries the
# launcher makes (state/devices.py); STANDIN_SMI_DIR holds them (gpus.csv, apps.csv).
case "$*" in
*--query-gpu=*) cat "$STANDIN_SMI_DIR/gpus.csv" ;;
*--query-compute-apps=*) cat "$STANDIN_SMI_DIR/apps.csv" 2>/dev/null ;;
*) echo "stand-in nvidia-smi: unknown query $*" >&2; exit 2 ;;
esac
