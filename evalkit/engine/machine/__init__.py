"""What the engines read of the machine: its GPUs and which of them an engine uses (gpus), the environment and
library versions (environment), the checks before a start (preflight), the settings chosen for the machine
(tuning, shared by the offline vLLM engine and the vLLM server evalkit starts), the embedded model (embedded)
and process groups (process_group). It imports no engine."""
