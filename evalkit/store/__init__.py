"""Decides what a run may reuse of earlier work, so that "why was this answer reused?" is read in this one folder.

The fingerprint that keys a request store and the coarser key of the run lock (fingerprint), the store of answers
and the engine that resumes from it (requests), and the lock that keeps two runs of one set of answers apart (lock).
"""
