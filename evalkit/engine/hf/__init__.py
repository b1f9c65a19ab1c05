"""engine=hf, HF transformers as a reference: the engine (engine.HFEngine, the door), the model as loaded
(model), log-likelihoods and traces from one forward pass (forward), generation by vLLM's conventions
(generation) and the settings HF can honour (settings)."""
