"""polestar-jax: LLaDA diffusion-LM decoding (LLaDA, Fast-dLLM, Polestar) in JAX."""
from polestar_jax.config import DecodeConfig, ModelConfig
from polestar_jax.errors import CheckpointError, ConfigError, PolestarError

__all__ = ["DecodeConfig", "ModelConfig", "PolestarError", "CheckpointError", "ConfigError"]
__version__ = "0.1.0"
