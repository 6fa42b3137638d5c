"""`spark-guard doctor`: why a model server died or the GPU fell off. cli gathers (the
kernel log, NVML, the journal), judge turns what was gathered into findings, xid knows
NVIDIA's Xid codes, logscan reads the logs."""
