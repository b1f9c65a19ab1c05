"""engine=hf, HF transformers as a reference: the engine (engine.HFEngine, the door) and its settings
(settings)."""
