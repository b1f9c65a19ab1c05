"""Stage 4, a run: one evaluation (evaluate), its tries in fresh processes (supervise, attempt), the result
folder's lock (lock), progress output (progress) and the files it writes (results)."""
