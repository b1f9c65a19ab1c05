"""The data-parallel pool: vLLM engines on Ray actors behind one Engine (engine.DataParallelEngine, the door);
what runs in an actor (actor), the actors held, started and replaced (replicas), one call spread over them
(dispatch), the pool's pure decisions (plan), and what an actor's failure says (output)."""
