"""engine=served, an OpenAI-compatible server over HTTP: the engine (engine.ServedEngine), the server evalkit
may start (start), the probe of what the server is (probe), the two ways of reading it, each with its request
bodies, its reads and which request gets which (body: vLLM's fields; openai: the OpenAI API alone), the batch
that checks every answer before it is kept (batch), and the HTTP client (http, concurrency). The door: factory
starts it through engine, probe and http."""
