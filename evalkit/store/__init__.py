"""What a run may reuse: "why was this answer reused" is answered by reading this folder. The fingerprint that
keys a request store and the coarser key of the run lock (fingerprint), the store of answers and the engine that
resumes from it (requests), and the lock that keeps two runs of one set of answers apart (lock)."""
