"""The data-parallel pool: vLLM engines on Ray actors behind one Engine (engine.DataParallelEngine, the door),
how requests are shared among them (plan), and what an actor's failure says (output)."""
