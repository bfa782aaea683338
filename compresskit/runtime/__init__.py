"""A lean inference runtime for Llama-family models (Llama, Mistral, Qwen2, Qwen3), written as one
readable forward per block with a static KV cache, in the manner of gpt-fast. It shares the loaded
Hugging Face model's weights (no copy) and knows nothing of any pruning method: a dense model, a
static-width or a static-depth one (smaller shapes, fewer layers) runs on it unchanged.

``Runtime(model)`` then ``runtime.generate(prompts, max_new_tokens=...)``; ``compresskit generate``
streams text from it. On a CPU it runs eagerly.
"""

from compresskit.runtime.llama import Runtime, StaticCache

__all__ = ["Runtime", "StaticCache"]
