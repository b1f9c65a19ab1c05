"""One evaluation from start to end: the run itself (evaluate), its tries in fresh processes (supervise, attempt),
what its tasks read (sources), its progress output (progress) and the files it writes (results)."""
