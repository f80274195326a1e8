"""`--quantization`: weight-only quantised copies of a model's linears (quantize.py), the GGUF
file's own 4-bit blocks (gguf_int4.py) and the int4 / int8 weight formats (weights.py)."""
