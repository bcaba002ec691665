"""``python -m polestar_jax.convert``: HF LLaDA / Dream safetensors <-> converted orbax folders.

The reusable logic lives in :mod:`polestar_jax.convert.hf`; ``__main__`` is the thin command line.
"""
from polestar_jax.convert.hf import ConversionSummary, convert_hf_to_orbax, convert_orbax_to_hf

__all__ = ["ConversionSummary", "convert_hf_to_orbax", "convert_orbax_to_hf"]
