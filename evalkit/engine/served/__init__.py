"""engine=served, an OpenAI-compatible server over HTTP: the engine (engine.ServedEngine), the server evalkit
may start (start), the probe of what the server is (probe), the request bodies and reads of vLLM's fields
(body) and of the OpenAI API alone (openai), and the HTTP client (http, concurrency). The door: factory
starts it through engine, probe and http."""
