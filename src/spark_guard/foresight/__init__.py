"""The footprint library: how many bytes a load will hold, known before it allocates.

core.argv reads a loader's command line; here gguf reads the model's header
(safetensors: a Hugging Face model directory's headers and config.json), estimate adds
weights, KV cache and compute buffers as llama.cpp does, and predict runs the model reads
off the guard's loop, with the unit owner's rights, and applies the servers' own rules
(vLLM, SGLang, TGI). lmstudio and ollama find the model a server's load names."""
