"""Numeric formats: an encoder and an exact decoder per (format, layout), and the registry that names them."""

from ninfer.quant.registry import Codec, codec_for, registered_formats

__all__ = ["Codec", "codec_for", "registered_formats"]
